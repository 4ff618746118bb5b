"""Test and demo harness (not the library path): CPU shims, small Megatron MoE models, the Megatron modules to preload.

Nothing here is imported by the library modules; the GPU path never runs these shims.
"""
