"""Starts the suite's ``python ...`` commands as forks of an interpreter that has torch imported.

Why: most end-to-end tests run a command as a user would (``python -m dlrm.scripts.main ...``),
and each start pays the interpreter's start and torch's import, about 3 s of CPU on two cores,
before the code under test runs (the suite starts over 500 such commands). Here a server process imports torch,
numpy, triton and absl once; each command is a fork of it that runs its module the way the
interpreter's ``-m``, ``-c`` and script modes do (``runpy``, ``__main__``, ``sys.argv``,
``sys.path[0]``, its working directory, its environment, its own stdin, stdout and stderr). So it
is a real process of its own: a real pid, exit status, signals, files and children.

What can differ from a cold start, and how each is kept the same:
- what the interpreter and those libraries read from the environment when they start (thread
  counts, hash seed, paths, encodings): a server serves only environments that agree with its own
  on those variables (``_STARTUP_PREFIXES``), others get their own server;
- PYTHONPATH: servers start without it, and a command's folders go on its ``sys.path`` where a
  cold start puts them (after the script's folder, absolute, without repeats); a command whose
  PYTHONPATH holds one of the preloaded libraries, or a sitecustomize, starts cold;
- the string hash seed, fixed at an interpreter's start: each environment has two servers of
  different seeds, taken in turn (the second starts at the environment's second command), so two
  runs of one test never share a seed (a byte-for-byte comparison of two runs still sees what a
  set's order changes);
- interpreter options (``-X``, ``-W``, ``-u``), another interpreter, or Popen options this does not
  mirror (``preexec_fn``, ``start_new_session``, ``pass_fds``...): those start cold, through
  ``subprocess`` itself.

``DLRM_TEST_COLD_START=1`` starts every command cold, as before. ``run`` and ``Popen`` take
``subprocess``'s arguments; the tests call them where they would call ``subprocess``'s.
"""
from __future__ import annotations

import atexit
import collections
import io
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading

_STARTUP_PREFIXES = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "TORCH", "PYTORCH", "CUDA", "NVIDIA",
                     "TRITON", "LD_", "MALLOC", "NUMEXPR", "LANG", "LC_", "XLA", "HIP", "ROCM")
_UNSUPPORTED = ("preexec_fn", "start_new_session", "pass_fds", "process_group", "user", "group", "extra_groups",
                "umask", "startupinfo", "creationflags", "restore_signals", "executable", "shell")
_PRELOAD = ("torch", "numpy", "triton", "absl.flags", "absl.app")


def _startup_key(env: dict[str, str]) -> tuple:
    """The variables an interpreter and the preloaded libraries read once, at start. Not
    PYTHONPATH: a command's entries are put on its ``sys.path`` where a cold start puts them
    (``_python_path``), and servers start without it."""
    return tuple(sorted((k, v) for k, v in env.items()
                        if k.startswith(_STARTUP_PREFIXES) and k not in ("PYTHONUNBUFFERED", "PYTHONPATH")))


def _python_path(entries: str, cwd: str) -> list[str]:
    """PYTHONPATH's folders as a cold start puts them on ``sys.path``: absolute (an empty entry is
    the working directory), in order, without repeats."""
    return list(dict.fromkeys(os.path.abspath(os.path.join(cwd, p)) for p in entries.split(os.pathsep)))


def _shadows_a_start_up_import(entries: str, cwd: str) -> bool:
    """Whether a PYTHONPATH folder holds what a cold start would import from it before the
    command runs (a preloaded library, sitecustomize): such commands start cold."""
    import glob

    names = [*(n.split(".")[0] for n in _PRELOAD), "sitecustomize", "usercustomize"]
    # A module, an extension or a regular package: a folder without __init__.py is only a
    # namespace portion, which the installed regular package of that name wins over (the
    # repository's own triton/ folder, say).
    return any(os.path.isfile(os.path.join(folder, name + ".py")) or glob.glob(os.path.join(folder, name + ".*so"))
               or os.path.isfile(os.path.join(folder, name, "__init__.py"))
               for folder in _python_path(entries, cwd) for name in names)


def _mode(argv: list[str]) -> tuple[str, str, list[str]] | None:
    """(mode, target, args) of ``python -m mod args`` / ``-c code args`` / ``script args``, or None
    where the command is not one this serves."""
    if len(argv) < 2 or os.path.realpath(argv[0]) != os.path.realpath(sys.executable):
        return None
    first = argv[1]
    if first in ("-m", "-c"):
        return (first[1], argv[2], argv[3:]) if len(argv) > 2 else None
    if first.startswith("-"):
        return None
    return "s", first, argv[2:]


# ----------------------------------------------------------------------------------- the server


def _serve(path: str) -> None:
    for name in _PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # monitors are reaped by the kernel
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    import select

    while True:
        readable, _, _ = select.select([listener, sys.stdin], [], [])
        if sys.stdin in readable:  # the test process went away: so does its server
            if not os.read(sys.stdin.fileno(), 1):
                os._exit(0)
        if listener not in readable:
            continue
        conn, _ = listener.accept()
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 8)
        if os.fork() == 0:
            listener.close()
            _monitor(conn, json.loads(message), fds)
        conn.close()
        for fd in fds:
            os.close(fd)


def _monitor(conn: socket.socket, request: dict, fds: list[int]) -> None:
    """Forks the command, tells the caller its pid, waits for it and tells its status."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    pid = os.fork()
    if pid == 0:
        conn.close()
        _run_command(request, fds)
    for fd in fds:
        os.close(fd)
    conn.sendall(f"{pid}\n".encode())
    _, status = os.waitpid(pid, 0)
    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
    os._exit(0)


def _stream(fd: int, name: str, unbuffered: bool) -> io.TextIOWrapper:
    """``sys.stdin`` / ``stdout`` / ``stderr`` as the interpreter makes them at start."""
    mode = "r" if name == "stdin" else "w"
    raw = io.FileIO(fd, mode, closefd=False)
    tty = raw.isatty()
    if mode == "w" and unbuffered:
        buffered = raw
    else:
        buffered = io.BufferedReader(raw) if mode == "r" else io.BufferedWriter(raw)
    encoding = os.environ.get("PYTHONIOENCODING", "").split(":")[0] or None
    errors = "backslashreplace" if name == "stderr" else "strict"
    return io.TextIOWrapper(buffered, encoding=encoding, errors=errors,
                            line_buffering=tty or name == "stderr", write_through=unbuffered and mode == "w")


def _run_command(request: dict, fds: list[int]) -> None:
    import runpy
    import traceback
    import types

    code = 0
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
        sys.stdin, sys.stdout, sys.stderr = (_stream(i, n, unbuffered) for i, n in
                                              enumerate(("stdin", "stdout", "stderr")))
        sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
        mode, target, args = request["mode"], request["target"], request["args"]
        if os.environ.get("PYTHONPATH"):  # after the script's folder, before the standard library
            sys.path[1:] = list(dict.fromkeys(_python_path(os.environ["PYTHONPATH"], os.getcwd()) + sys.path[1:]))
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if mode == "m":
            sys.argv = ["-m", *args]
            sys.path[0] = os.getcwd()
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        elif mode == "c":
            sys.argv = ["-c", *args]
            sys.path[0] = ""
            main = types.ModuleType("__main__")
            main.__dict__["__builtins__"] = __builtins__
            sys.modules["__main__"] = main
            exec(compile(target, "<string>", "exec"), main.__dict__)
        else:
            sys.argv = [target, *args]
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    except BaseException:
        pass
    if code == -signal.SIGINT:  # as the interpreter ends on an uncaught KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)


def run_here(args: list[str]) -> None:
    """Runs ``python ARGS`` (``-m``, ``-c`` or a script) in this process as a fresh interpreter
    would, then exits with its status: for a helper that prepares a process (a mount namespace,
    say) and then becomes the command, in a fork of its own."""
    mode = _mode([sys.executable, *args])
    if mode is None:
        raise ValueError(f"not a python command this can run: {args}")
    _run_command({"mode": mode[0], "target": mode[1], "args": mode[2], "cwd": os.getcwd(), "env": dict(os.environ)},
                 [0, 1, 2])


# ----------------------------------------------------------------------------------- the caller


class _Server:
    def __init__(self, env: dict[str, str], hash_seed: str | None) -> None:
        self.folder = tempfile.mkdtemp(prefix="warm-python-")
        self.path = os.path.join(self.folder, "socket")
        start_env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
        if hash_seed is not None:
            start_env["PYTHONHASHSEED"] = hash_seed
        self.process = subprocess.Popen([sys.executable, os.path.abspath(__file__), self.path], env=start_env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=self.folder)
        self.ready = False
        self.starting = threading.Lock()  # threads of one test may start commands at once

    def connect(self) -> socket.socket:
        with self.starting:
            if not self.ready:
                import select

                if not select.select([self.process.stdout], [], [], 300)[0]:
                    raise RuntimeError("the warm python server did not start in 300 s")
                line = self.process.stdout.readline()
                if line != b"ready\n":
                    raise RuntimeError(f"the warm python server did not start: {line!r}")
                self.ready = True
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        return conn

    def close(self) -> None:
        try:
            self.process.stdin.close()
            self.process.stdout.close()
            self.process.wait(timeout=10)
        except Exception:
            self.process.kill()
        for name in os.listdir(self.folder):
            os.unlink(os.path.join(self.folder, name))
        os.rmdir(self.folder)


# Per environment, its servers' hash seeds and the servers started so far: the second of a pair
# starts at the environment's second command (many environments serve one command only).
_servers: "collections.OrderedDict[tuple, list[_Server | None]]" = collections.OrderedDict()
_seeds: dict[tuple, list[str | None]] = {}
_turns: dict[tuple, int] = {}
_lock = threading.Lock()
# Servers of this many environments at most (the least recently used go: a server's commands
# keep running without it); each holds about 300 MB.
MAX_ENVIRONMENTS = 3


def _server_for(env: dict[str, str]) -> _Server:
    key = _startup_key(env)
    with _lock:
        if key not in _servers:
            if "PYTHONHASHSEED" in env:
                _seeds[key] = [None]
            else:
                first = random.randrange(1, 2**32)
                _seeds[key] = [str(first), str(first % (2**32 - 1) + 1)]
            _servers[key] = [None] * len(_seeds[key])
            _turns[key] = 0
            while len(_servers) > MAX_ENVIRONMENTS:
                old, servers = _servers.popitem(last=False)
                del _seeds[old], _turns[old]
                for server in filter(None, servers):
                    server.close()
        _servers.move_to_end(key)
        servers = _servers[key]
        turn = _turns[key] % len(servers)
        _turns[key] += 1
        if servers[turn] is None:
            servers[turn] = _Server(env, _seeds[key][turn])
        return servers[turn]


@atexit.register
def _close_servers() -> None:
    for servers in _servers.values():
        for server in filter(None, servers):
            server.close()
    _servers.clear()


def _fd_of(stream, default: int, opened: list[int], ours: list) -> int:
    """The descriptor a child gets for ``stream`` (a subprocess constant, a file, an fd, None)."""
    if stream is None:
        return default
    if stream == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_RDWR)
        opened.append(fd)
        return fd
    if stream == subprocess.PIPE:
        read, write = os.pipe()
        opened.append(write)
        ours.append(read)
        return write
    if isinstance(stream, int):
        return stream
    return stream.fileno()


class Popen:
    """``subprocess.Popen`` for a ``python`` command, served warm where it can be (see the
    module's docstring), else by ``subprocess.Popen`` itself, which it then is."""

    def __new__(cls, args, **kwargs):
        argv = [os.fspath(a) for a in args] if not isinstance(args, (str, bytes)) else None
        env = kwargs.get("env")
        env = dict(os.environ if env is None else env)
        mode = _mode(argv) if argv else None
        unsupported = [k for k in _UNSUPPORTED if kwargs.get(k) not in (None, False, (), 0)]
        if kwargs.get("stdin") == subprocess.PIPE or kwargs.get("close_fds") is False:
            unsupported.append("stdin/close_fds")
        cwd = os.fspath(kwargs["cwd"]) if kwargs.get("cwd") is not None else os.getcwd()
        if (mode is None or unsupported or os.environ.get("DLRM_TEST_COLD_START") == "1"
                or kwargs.get("input") is not None
                or (env.get("PYTHONPATH") and _shadows_a_start_up_import(env["PYTHONPATH"], cwd))):
            return subprocess.Popen(args, **kwargs)
        self = super().__new__(cls)
        self._start(argv, mode, env, kwargs)
        return self

    def _start(self, argv: list[str], mode: tuple, env: dict[str, str], kwargs: dict) -> None:
        self.args = argv
        self.returncode = None
        opened: list[int] = []
        ours: list[int] = []
        stdin = _fd_of(kwargs.get("stdin"), 0, opened, [])
        stdout = _fd_of(kwargs.get("stdout"), 1, opened, ours)
        out_pipe = ours[-1] if kwargs.get("stdout") == subprocess.PIPE else None
        if kwargs.get("stderr") == subprocess.STDOUT:
            stderr = stdout
        else:
            stderr = _fd_of(kwargs.get("stderr"), 2, opened, ours)
        err_pipe = ours[-1] if kwargs.get("stderr") == subprocess.PIPE else None
        text = bool(kwargs.get("text") or kwargs.get("universal_newlines") or kwargs.get("encoding")
                    or kwargs.get("errors"))
        cwd = os.fspath(kwargs["cwd"]) if kwargs.get("cwd") is not None else os.getcwd()
        request = {"mode": mode[0], "target": mode[1], "args": mode[2], "cwd": os.path.abspath(cwd), "env": env}
        try:
            try:
                self._conn = _server_for(env).connect()
            except OSError:  # its server was just closed by another thread's: a new one serves
                self._conn = _server_for(env).connect()
            socket.send_fds(self._conn, [json.dumps(request).encode()], [stdin, stdout, stderr])
        finally:
            for fd in opened:
                os.close(fd)
        self._received = b""
        self.pid = int(self._line(None))

        def wrap(fd):
            if fd is None:
                return None
            if text:
                return open(fd, "r", encoding=kwargs.get("encoding"), errors=kwargs.get("errors"))
            return open(fd, "rb")

        self.stdin = None
        self.stdout = wrap(out_pipe)
        self.stderr = wrap(err_pipe)

    def _line(self, timeout: float | None) -> bytes | None:
        """The server's next line (the pid, then the exit status), or None after ``timeout`` s."""
        import select

        while b"\n" not in self._received:
            if not select.select([self._conn], [], [], timeout)[0]:
                return None
            chunk = self._conn.recv(64)
            if not chunk:
                raise RuntimeError(f"lost the status of process {getattr(self, 'pid', '?')}")
            self._received += chunk
        line, self._received = self._received.split(b"\n", 1)
        return line

    # -- subprocess.Popen's interface
    def poll(self) -> int | None:
        if self.returncode is None:
            line = self._line(0)
            if line is not None:
                self.returncode = int(line)
                self._conn.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            line = self._line(timeout)
            if line is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = int(line)
            self._conn.close()
        return self.returncode

    def communicate(self, input=None, timeout: float | None = None):
        if input is not None:
            raise ValueError("warm_python.Popen takes no input")
        results: dict[str, object] = {}

        def drain(name: str, stream) -> None:
            results[name] = stream.read()
            stream.close()

        threads = [threading.Thread(target=drain, args=(n, s), daemon=True)
                   for n, s in (("stdout", self.stdout), ("stderr", self.stderr)) if s is not None]
        for t in threads:
            t.start()
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        for t in threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return results.get("stdout"), results.get("stderr")

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        self.wait()


def run(args, *, input=None, capture_output: bool = False, timeout: float | None = None, check: bool = False,
        **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run`` for a ``python`` command, served warm where it can be."""
    if input is not None:
        return subprocess.run(args, input=input, capture_output=capture_output, timeout=timeout, check=check,
                              **kwargs)
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    with Popen(args, **kwargs) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
    done = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    if check:
        done.check_returncode()
    return done


if __name__ == "__main__":
    _serve(sys.argv[1])
