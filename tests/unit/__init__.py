"""Tests of the library (``megatron_deepepv2``) on CPU: ops, backends, buffers, Megatron integration."""
