"""A ``python`` for the tests' subprocesses that starts with torch and Megatron already imported.

A test that runs a script in a fresh interpreter (a launch through the example script, a tool, a README block) pays
for importing torch and Megatron each time: seconds of CPU, most of what such a test costs. :func:`python` returns an
executable that behaves as ``python`` for what the tests run (``-c CODE``, ``-m MODULE``, ``SCRIPT``; ``-u``, ``-B``)
but is forked from a server, one per test process, that imported them once. Everything else of a fresh interpreter
holds: the caller's arguments, environment, working directory and standard streams, ``sys.path`` as ``python`` sets
it, a new ``__main__``, ``atexit`` handlers, the exit status (a signal's as ``128 + N``), and a caller that kills the
client kills the run.

It runs the real interpreter instead (``exec``, so nothing differs but the time) when it cannot stand in: other
interpreter options, an environment that differs from the server's in what is read at import time
(:data:`IMPORT_TIME_VARIABLES`), no server. A test that needs Megatron not yet imported (import order) uses
``sys.executable``.

The server forks each run from a process with no other Python thread and CUDA not initialised, as the suite's rank
forkserver does (:mod:`tests.distributed`).
"""

from __future__ import annotations

import array
import atexit
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
#: What the server imports (a missing one is skipped). Not ``megatron.training``: importing it configures the root
#: logger (to stdout), which a fresh interpreter only does when the run imports it, and after the run's own set-up.
PRELOAD = ("torch", "torch.distributed", "megatron.core", "megatron.core.transformer.moe.moe_layer",
           "megatron.core.models.gpt.gpt_layer_specs")
#: Environment variables, and prefixes, that modules read when imported: a run whose values differ from the server's
#: runs in the real interpreter.
IMPORT_TIME_VARIABLES = ("PYTHONPATH", "PYTHONHOME", "PYTHONHASHSEED", "PYTHONSAFEPATH", "PYTHONNOUSERSITE",
                         "LD_PRELOAD", "LD_LIBRARY_PATH", "TORCH", "PYTORCH", "OMP_", "MKL_", "NVTE_", "TRITON_")
_HEADER = struct.Struct("!Q")
_server: Optional[tuple[subprocess.Popen, Path]] = None
#: The environment the server starts with: this process's when the module was first imported, not what a test that
#: asks first has patched.
_BASE_ENV = dict(os.environ)


def _import_time_environment(env: dict[str, str]) -> dict[str, str]:
    return {key: value for key, value in env.items() if key.startswith(IMPORT_TIME_VARIABLES)}


# --------------------------------------------------------------------------------------------------------- the test side
def python() -> str:
    """The path of the preloaded ``python`` (its server started on the first call in this process).

    Returns:
        An executable to use where a test would use ``sys.executable``.
    """
    global _server
    if _server is None:
        folder = Path(tempfile.mkdtemp(prefix="preloaded-python-"))
        socket_path = folder / "server.sock"
        with open(folder / "server.log", "wb") as log:  # its import warnings; a run's output goes to the run's caller
            server = subprocess.Popen([sys.executable, "-c", "from tests.preloaded_python import serve; serve()",
                                       str(socket_path)], cwd=ROOT, env=_BASE_ENV, stdin=subprocess.DEVNULL, stdout=log,
                                      stderr=log)
        deadline = time.monotonic() + 60
        while not socket_path.exists():  # bound at once, before the imports: requests wait in its queue
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the preloaded python's server did not start: {(folder / 'server.log').read_text()}")
            time.sleep(0.01)
        executable = folder / "python"
        executable.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S -E "{__file__}" "{socket_path}" "$@"\n')
        executable.chmod(0o755)
        _server = (server, executable)
        atexit.register(_stop, server, folder)
    return str(_server[1])


def _stop(server: subprocess.Popen, folder: Path) -> None:
    server.kill()
    server.wait()
    for path in folder.iterdir():
        path.unlink()
    folder.rmdir()


# ------------------------------------------------------------------------------------------------------------ the client
def client(socket_path: str, argv: list[str]) -> None:
    """Runs ``python *argv`` through the server at ``socket_path``; exits with the run's status. Without a server,
    or when the server cannot stand in, becomes the real interpreter."""
    request = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    try:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(socket_path)
        fds = array.array("i", [0, 1, 2])
        connection.sendmsg([_HEADER.pack(len(request))], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds.tobytes())])
        connection.sendall(request)
    except OSError:
        os.execv(sys.executable, [sys.executable, *argv])
    status = b""
    while len(status) < 4:
        chunk = connection.recv(4 - len(status))
        if not chunk:
            sys.exit(1)  # the server went away mid-run
        status += chunk
    sys.exit(struct.unpack("!i", status)[0])


# ------------------------------------------------------------------------------------------------------------ the server
def serve() -> None:
    """The server (``sys.argv[1]``: its socket path): binds, imports :data:`PRELOAD`, then forks a run per request."""
    import gc
    import importlib
    import logging

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sys.argv[1])
    listener.listen(64)  # requests queue while the imports run
    root_handlers, root_level = list(logging.root.handlers), logging.root.level
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    logging.root.handlers[:] = root_handlers  # as a fresh interpreter's, should an import have configured it
    logging.root.setLevel(root_level)
    # After the imports, which set some (torch: TORCHINDUCTOR_CACHE_DIR), as they did in the tests' process.
    server_env = _import_time_environment(dict(os.environ))
    gc.collect()
    gc.freeze()  # the runs' collections skip what the server imported
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the per-request processes reap themselves
    while True:
        connection, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _supervise(connection, server_env)
        connection.close()


def _receive(connection: socket.socket) -> tuple[dict, list[int]]:
    fds = array.array("i")
    data, ancillary, _, _ = connection.recvmsg(_HEADER.size, socket.CMSG_SPACE(3 * fds.itemsize))
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    (size,) = _HEADER.unpack(data)
    body = b""
    while len(body) < size:
        body += connection.recv(size - len(body))
    return json.loads(body), list(fds)


def _supervise(connection: socket.socket, server_env: dict[str, str]) -> None:
    """The per-request process: forks the run, sends its status, kills it if the client goes away."""
    request, fds = _receive(connection)
    pid = os.fork()
    if pid == 0:
        connection.close()
        _run(request, fds, server_env)
    for fd in fds:
        os.close(fd)
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if select.select([connection], [], [], 0.2)[0] and not connection.recv(1):  # the client is gone
            os.kill(pid, signal.SIGKILL)
    code = os.waitstatus_to_exitcode(status)
    try:
        connection.sendall(struct.pack("!i", code if code >= 0 else 128 - code))
    finally:
        os._exit(0)


def _run(request: dict, fds: list[int], server_env: dict[str, str]) -> None:
    """The run: the caller's streams, directory and environment, then ``python``'s ``-c``/``-m``/script semantics."""
    import builtins
    import io
    import runpy
    import types

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    for name in [name for name in sys.modules if name == "tests" or name.startswith("tests.")]:
        del sys.modules[name]  # the server's (this project's): a run imports its own
    argv, env = list(request["argv"]), request["env"]
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(env)
    options = []
    while argv and argv[0] in ("-u", "-B"):
        options.append(argv.pop(0))
    mode = argv[0] if argv and argv[0] in ("-c", "-m") else "script"
    if not argv or (argv[0].startswith("-") and mode == "script") or _import_time_environment(env) != server_env:
        os.execv(sys.executable, [sys.executable, *request["argv"]])
    unbuffered = "-u" in options or bool(env.get("PYTHONUNBUFFERED"))
    sys.dont_write_bytecode = "-B" in options or bool(env.get("PYTHONDONTWRITEBYTECODE"))
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        binary = open(fd, "rb" if fd == 0 else "wb", buffering=0 if unbuffered and fd else -1, closefd=False)
        stream = io.TextIOWrapper(binary, encoding="utf-8", errors="backslashreplace" if fd == 2 else "strict",
                                  line_buffering=fd == 2 or (fd == 1 and os.isatty(1)), write_through=unbuffered)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    code = 0
    try:
        if mode == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[0] = ""
            main = types.ModuleType("__main__")
            main.__builtins__ = builtins
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        elif mode == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if exit_.code is not None and not isinstance(exit_.code, int):
            print(exit_.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 -- as the interpreter: the traceback on stderr, status 1
        import traceback

        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


if __name__ == "__main__":
    client(sys.argv[1], sys.argv[2:])
