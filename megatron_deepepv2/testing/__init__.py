"""Test and demo harness (not the library path): CPU shims and small Megatron MoE models.

Nothing here is imported by the library modules; the GPU path never runs these shims.
"""
