"""The backends: the contract every backend meets (:mod:`.base`), the registry that maps a name to a backend class
(:mod:`.registry`), and the two backends: :mod:`.deepep` over DeepEP v2 (a subpackage: the adapter and the helpers
only it uses) and :mod:`.reference` over ``torch.distributed``.

This file imports nothing, so that importing the contract does not import a backend; the package's top module imports
the built-in backends, which register themselves.
"""
