"""The DeepEP backend and what only it uses: the adapter (:mod:`.adapter`, DeepEP's calls over a built buffer: what a
dispatch runs), the registered backend (:mod:`.backend`, which builds the buffer), the DeepEP lines (:mod:`.lines`),
what this process has installed of them (:mod:`.probes`), the buffer arithmetic (:mod:`.sizing`), the direct or hybrid
mode from the nodes of a group (:mod:`.topology`) and deterministic mode's receive order (:mod:`.receive_order`).

This file imports nothing, as the backends' own ``__init__``: the package's top module imports :mod:`.backend`, which
registers the backend.
"""
