"""The preloaded ``python`` behaves as the interpreter for what the tests run: arguments, streams, directory,
environment, ``sys.path``, exit status; it runs with Megatron imported, or is the real interpreter where it cannot
stand in; a killed client takes its run with it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests import preloaded_python
from tests.preloaded_python import python

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="with a CUDA GPU the tests' python is the real "
                                "interpreter (a process forked after CUDA is initialised cannot use it)")

PROBE = ("import json, os, sys; data = sys.stdin.read(); "
         "print(json.dumps([sys.argv, os.getcwd(), os.environ.get('PROBE_VALUE'), sys.path[0], data, "
         "'megatron.core' in sys.modules, __name__])); sys.stderr.write('to stderr'); sys.exit(3)")


def _run(executable: str, args: list[str], tmp_path: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    # The server's environment (this process's may have gained variables from Megatron code run here since), and the
    # reason on stderr should the run fall back to the real interpreter.
    env = {**preloaded_python.SERVER_ENVIRONMENT, "PROBE_VALUE": "x", "PRELOADED_PYTHON_DEBUG": "1", **(env or {})}
    return subprocess.run([executable, *args], input="from stdin", capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=240)


@pytest.mark.parametrize("mode", ["-c", "script", "-m"])
def test_runs_as_the_interpreter_does_with_megatron_imported(tmp_path: Path, mode: str) -> None:
    (tmp_path / "probe_module.py").write_text(PROBE)
    args = {"-c": ["-c", PROBE, "a"], "script": [str(tmp_path / "probe_module.py"), "a"],
            "-m": ["-m", "probe_module", "a"]}[mode]
    real, preloaded = _run(sys.executable, args, tmp_path), _run(python(), args, tmp_path)
    assert (preloaded.returncode, preloaded.stderr) == (real.returncode, real.stderr) == (3, "to stderr")
    real_out, preloaded_out = eval(real.stdout.replace("true", "True").replace("false", "False")), \
        eval(preloaded.stdout.replace("true", "True").replace("false", "False"))
    assert real_out[5] is False and preloaded_out[5] is True  # the only difference: Megatron is there already
    assert preloaded_out[:5] + preloaded_out[6:] == real_out[:5] + real_out[6:]


def test_an_import_time_variable_that_differs_gets_the_real_interpreter(tmp_path: Path) -> None:
    done = _run(python(), ["-c", PROBE], tmp_path, env={"TORCHDYNAMO_DISABLE": "0" if os.environ.get(
        "TORCHDYNAMO_DISABLE") == "1" else "1"})
    assert done.returncode == 3 and '"from stdin", false, "__main__"' in done.stdout, done.stdout
    assert "the real interpreter (options, or ['TORCHDYNAMO_DISABLE'] differ)" in done.stderr, done.stderr


def test_a_killed_client_takes_its_run_with_it(tmp_path: Path) -> None:
    client = subprocess.Popen([python(), "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(120)"],
                              stdout=subprocess.PIPE, text=True)
    pid = int(client.stdout.readline())
    client.kill()
    client.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    pytest.fail(f"the run {pid} outlived its client")
