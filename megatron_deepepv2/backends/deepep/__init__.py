"""The DeepEP backend and what only it uses: the adapter (:mod:`.adapter`, the backend class over ``deep_ep``'s
buffer), the DeepEP lines and their probes (:mod:`.lines`), the buffer arithmetic (:mod:`.sizing`), the direct or
hybrid mode from the nodes of a group (:mod:`.topology`) and deterministic mode's receive order (:mod:`.receive_order`).

This file imports nothing, as the backends' own ``__init__``: the package's top module imports the adapter, which
registers the backend.
"""
