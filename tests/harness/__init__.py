"""Tests of the test harness itself, not of the library, on CPU: the multi-process rank runner
(``tests/distributed.py``), the GPU-job lock and command lines (``tests/gpu_jobs.py``), the preloaded ``python``
(``tests/preloaded_python.py``) and the GPU case runner (``tests/functional/runner.py``)."""
