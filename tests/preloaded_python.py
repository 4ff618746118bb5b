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
(:data:`IMPORT_TIME_VARIABLES`), no server. On a machine with a CUDA GPU :func:`python` is ``sys.executable``:
there the server's imports initialise CUDA, which a forked process cannot use. A test that needs Megatron not yet imported
(import order) uses ``sys.executable``.

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


def _server_preload(**changes) -> list[str]:
    """:func:`megatron_deepepv2.testing.preload.server_preload`'s list, read from its file: importing it as a module
    would import the package into the server, and a run would find it imported."""
    namespace: dict = {}
    path = ROOT / "megatron_deepepv2" / "testing" / "preload.py"
    exec(compile(path.read_text(), str(path), "exec"), namespace)  # noqa: S102 - the package's own list
    return namespace["server_preload"](**changes)


#: What the server imports (a missing one is skipped): the shared list (not ``megatron.training``: importing it
#: configures the root logger (to stdout), which a fresh interpreter only does when the run imports it, and after the
#: run's own set-up) without the package, which each run imports itself, and without ``frozen_preload``: the server
#: freezes what it imported itself, after restoring the root logger.
PRELOAD = tuple(_server_preload(package=False, before_megatron=("megatron.core",), freeze=False))
#: Environment variables, and prefixes, that modules read when imported: a run whose values differ from the server's
#: runs in the real interpreter.
IMPORT_TIME_VARIABLES = ("PYTHONPATH", "PYTHONHOME", "PYTHONHASHSEED", "PYTHONSAFEPATH", "PYTHONNOUSERSITE",
                         "LD_PRELOAD", "LD_LIBRARY_PATH", "TORCH", "PYTORCH", "OMP_", "MKL_", "NVTE_", "TRITON_")
_HEADER = struct.Struct("!Q")
_executable: Optional[str] = None
#: The environment the server starts with: this process's when the module was first imported, not what a test that
#: asks first has patched (or what Megatron code run in the process has set since).
SERVER_ENVIRONMENT = dict(os.environ)


def _import_time_environment(env: dict[str, str]) -> dict[str, str]:
    return {key: value for key, value in env.items() if key.startswith(IMPORT_TIME_VARIABLES)}


# --------------------------------------------------------------------------------------------------------- the test side
def python() -> str:
    """The path of the preloaded ``python``; its server starts on the first call.

    One server serves a whole pytest-xdist run (its workers share ``PYTEST_XDIST_TESTRUNUID``): the first worker to
    ask starts it, and it exits when the run's controller does. Without xdist, this process owns it.

    Returns:
        An executable to use where a test would use ``sys.executable``.
    """
    global _executable
    if _executable is not None:
        return _executable
    if _cuda_available():
        # Where a GPU is visible the server's imports initialise CUDA, which a forked process cannot use: the runs
        # start fresh interpreters (such a machine has the cores for it).
        _executable = sys.executable
        return _executable
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run_id:
        folder = Path(tempfile.gettempdir()) / f"preloaded-python-{run_id}"
        try:
            folder.mkdir()
            owner = os.getppid()  # the xdist controller
        except FileExistsError:
            owner = None  # another worker starts it
    else:
        folder, owner = Path(tempfile.mkdtemp(prefix="preloaded-python-")), os.getpid()
    socket_path, executable = folder / "server.sock", folder / "python"
    if owner is not None:
        staged = folder / "python.staged"
        staged.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S -E "{__file__}" "{socket_path}" "$@"\n')
        staged.chmod(0o755)
        with open(folder / "server.log", "wb") as log:  # its import warnings; a run's output goes to its caller
            subprocess.Popen([sys.executable, "-c", "from tests.preloaded_python import serve; serve()",
                              str(socket_path), str(owner)], cwd=ROOT, env=SERVER_ENVIRONMENT, stdin=subprocess.DEVNULL,
                             stdout=log, stderr=log, start_new_session=True)
        staged.rename(executable)
    deadline = time.monotonic() + 60
    while not (socket_path.exists() and executable.exists()):  # bound before the imports: requests wait in its queue
        if time.monotonic() > deadline:
            log_path = folder / "server.log"
            raise RuntimeError("the preloaded python's server did not start: "
                               f"{log_path.read_text() if log_path.exists() else 'no log'}")
        time.sleep(0.01)
    _executable = str(executable)
    return _executable


def _cuda_available() -> bool:
    import torch  # noqa: PLC0415

    return torch.cuda.is_available()


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
    """The server (``sys.argv[1]``: its socket path, ``sys.argv[2]``: the process whose end ends it): binds, imports
    :data:`PRELOAD`, then forks a run per request."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sys.argv[1])
    listener.listen(64)  # requests queue while the imports run
    try:
        _serve(listener, owner=int(sys.argv[2]))
    finally:  # the requests queued get an end of file; later ones find no server and run the real interpreter
        listener.close()
        os.unlink(sys.argv[1])
    folder = os.path.dirname(sys.argv[1])
    for name in os.listdir(folder):
        os.unlink(os.path.join(folder, name))
    os.rmdir(folder)


def _serve(listener: socket.socket, owner: int) -> None:
    import gc
    import importlib
    import logging

    root_handlers, root_level = list(logging.root.handlers), logging.root.level
    environment_before = dict(os.environ)
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    logging.root.handlers[:] = root_handlers  # as a fresh interpreter's, should an import have configured it
    logging.root.setLevel(root_level)
    # What the imports set themselves (torch: TORCHINDUCTOR_CACHE_DIR): a run has them as a fresh interpreter's
    # imports would set them; the rest of the import-time variables must be the run's.
    set_by_imports = {key: value for key, value in os.environ.items() if environment_before.get(key) != value}
    server_env = _import_time_environment(environment_before)
    gc.collect()
    gc.freeze()  # the runs' collections skip what the server imported
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the per-request processes reap themselves
    while True:
        if not select.select([listener], [], [], 1.0)[0]:
            try:
                os.kill(owner, 0)
            except ProcessLookupError:  # the test run is over
                return
            continue
        connection, _ = listener.accept()
        if os.fork() == 0:
            try:
                listener.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                _supervise(connection, server_env, set_by_imports)
            finally:  # never back into the server's loop (or its clean-up)
                os._exit(1)
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


def _supervise(connection: socket.socket, server_env: dict[str, str], set_by_imports: dict[str, str]) -> None:
    """The per-request process: forks the run, sends its status, kills it if the client goes away."""
    request, fds = _receive(connection)
    pid = os.fork()
    if pid == 0:
        try:
            connection.close()
            _run(request, fds, server_env, set_by_imports)
        finally:  # _run ends the process itself; this is for what raises before it can
            os._exit(1)
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


def _differing(server_env: dict[str, str], set_by_imports: dict[str, str], env: dict[str, str]) -> list[str]:
    """The import-time variables whose value in ``env`` is not what the server imported with: its environment before
    the imports, or, for one the imports set, unset or the value they set."""
    keys = set(server_env) | set(_import_time_environment(env)) | set(_import_time_environment(set_by_imports))
    return sorted(key for key in keys if env.get(key) != server_env.get(key)
                  and not (key in set_by_imports and env.get(key) in (None, set_by_imports[key])))


def _run(request: dict, fds: list[int], server_env: dict[str, str], set_by_imports: dict[str, str]) -> None:
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
    argv, env = list(request["argv"]), {**set_by_imports, **request["env"]}
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(env)
    options = []
    while argv and argv[0] in ("-u", "-B"):
        options.append(argv.pop(0))
    mode = argv[0] if argv and argv[0] in ("-c", "-m") else "script"
    differing = _differing(server_env, set_by_imports, request["env"])
    if not argv or (argv[0].startswith("-") and mode == "script") or differing:
        if env.get("PRELOADED_PYTHON_DEBUG"):
            os.write(2, f"preloaded python: the real interpreter (options, or {differing} differ)\n".encode())
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
