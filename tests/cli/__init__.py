"""Tests of the command lines (``megatron-deepepv2-*``, the demo, the example launch) and of the README as written."""
