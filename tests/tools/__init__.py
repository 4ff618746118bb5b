"""Tests of the scripts in ``tools/`` (benchmarks, gates, tables and the Megatron conformance runner), on CPU."""
