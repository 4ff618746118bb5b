"""What exists only to serve Megatron-Core: :mod:`.integration` (``install()``: every patch of Megatron-Core), the
flex dispatcher's manager (:mod:`.manager`) and the receive bound's memory (:mod:`.bounded_receive`), what deepepv2
reads off a ``TransformerConfig`` and the combinations it refuses (:mod:`.megatron_config`), and the grouped-GEMM
experts (:mod:`.experts`) with their fused activation kernels (:mod:`.expert_kernels`).

This file imports nothing, so that importing one of them does not import the others (or Megatron, where they do not).
"""
