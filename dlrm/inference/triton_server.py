"""Starts and stops the Triton Inference Server that the ``nvidia-pytriton`` wheel bundles.

That server has the python backend only (no ONNX Runtime or PyTorch backends), so it serves
the python-backend repository flavour. It runs on CPU machines, which makes it the server the
test suite deploys to and the one to try a deployment on without a GPU or Docker.

The server lives in its own virtual environment (``triton/setup_server_env.sh``):
``nvidia-pytriton`` needs numpy < 2, and the python backend's stub, built against numpy 1,
silently returns empty output tensors under numpy 2. ``ServerEnv`` finds the pieces inside
that environment; ``LocalTritonServer`` runs the binary with

- a backend directory holding the python backend and the stub built for the environment's
  Python version (the wheel ships one stub per version, and the backend looks for it next
  to itself);
- the environment's Python library directory first in ``LD_LIBRARY_PATH`` (the stub links
  ``libpython3.X.so`` and would otherwise pick up the system's) and its ``bin`` first in
  ``PATH`` (the stub's interpreter finds its site-packages from the ``python3`` it sees there);
- HTTP, gRPC and metrics bound to 127.0.0.1 on free ports, and ``--exit-timeout-secs`` so a
  SIGTERM ends it promptly.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from dlrm.engine.outputs import OutputKind

SETUP_HINT = "create it with: bash triton/setup_server_env.sh <dir>"

_PROBE = """
import importlib.util, json, os, sys, sysconfig
spec = importlib.util.find_spec("pytriton")
root = list(spec.submodule_search_locations)[0] if spec else None
def has(name):
    return importlib.util.find_spec(name) is not None
print(json.dumps({
    "pytriton": root,
    "version": f"{sys.version_info[0]}.{sys.version_info[1]}",
    "libdir": sysconfig.get_config_var("LIBDIR"),
    "shared": bool(sysconfig.get_config_var("Py_ENABLE_SHARED")),
    "numpy": __import__("numpy").__version__ if has("numpy") else None,
    "onnxruntime": has("onnxruntime"),
    "torch": has("torch"),
}))
"""


class TritonServerError(RuntimeError):
    """The server environment is incomplete, or the server did not start or stop cleanly."""


@dataclass(frozen=True)
class ServerEnv:
    """The parts of a server environment that starting the bundled server needs."""

    root: str  # the virtual environment
    tritonserver: str  # the server binary
    python_backend: str  # directory with libtriton_python.so and triton_python_backend_utils.py
    stub: str  # triton_python_backend_stub built for this environment's Python
    server_libs: str  # the shared libraries the wheel bundles (nvidia_pytriton.libs)
    python_libdir: str  # where this environment's libpython3.X.so lives
    python_version: str
    numpy_version: str | None
    has_onnxruntime: bool
    has_torch: bool

    @staticmethod
    def find(root: str) -> "ServerEnv":
        """Inspects the virtual environment at ``root``; raises ``TritonServerError`` naming
        what is missing and how to create the environment."""
        root = os.path.abspath(root)
        candidates = [os.path.join(root, "bin", name) for name in ("python", "python3")]
        python = next((p for p in candidates if os.path.isfile(p)), None)
        if python is None:
            raise TritonServerError(f"no Triton server environment at {root} (no bin/python); {SETUP_HINT}")
        try:
            out = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=60, check=True).stdout
        except (subprocess.SubprocessError, OSError) as e:
            raise TritonServerError(f"{python} could not describe itself ({e}); {SETUP_HINT}") from e
        info = json.loads(out.strip().splitlines()[-1])
        if info["pytriton"] is None:
            raise TritonServerError(f"{root} lacks nvidia-pytriton (the bundled tritonserver); {SETUP_HINT}")
        if info["numpy"] is None or int(info["numpy"].split(".")[0]) >= 2:
            raise TritonServerError(
                f"{root} has numpy {info['numpy']}: the python backend's stub needs numpy < 2 "
                f"(under numpy 2 it returns empty tensors); {SETUP_HINT}"
            )
        if not info["shared"]:
            raise TritonServerError(f"the Python of {root} has no shared libpython, which the python backend's "
                                    "stub links: build the environment from a Python configured with --enable-shared")
        dist = os.path.join(info["pytriton"], "tritonserver")
        env = ServerEnv(
            root=root,
            tritonserver=os.path.join(dist, "bin", "tritonserver"),
            python_backend=os.path.join(dist, "backends", "python"),
            stub=os.path.join(dist, "python_backend_stubs", info["version"], "triton_python_backend_stub"),
            server_libs=os.path.join(os.path.dirname(info["pytriton"]), "nvidia_pytriton.libs"),
            python_libdir=info["libdir"],
            python_version=info["version"],
            numpy_version=info["numpy"],
            has_onnxruntime=info["onnxruntime"],
            has_torch=info["torch"],
        )
        for path in (env.tritonserver, env.python_backend, env.stub):
            if not os.path.exists(path):
                raise TritonServerError(f"{path} is missing: nvidia-pytriton in {root} has no server for Python "
                                        f"{info['version']}; {SETUP_HINT}")
        return env


def free_port() -> int:
    """A port nothing listens on right now (the server may still lose it to a race; start() retries)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_WORKDIR_ENTRIES = {"tritonserver.log", "backends", "backends/python", "backends/python/libtriton_python.so",
                    "backends/python/triton_python_backend_utils.py", "backends/python/triton_python_backend_stub"}


def is_server_workdir(path: str) -> bool:
    """Whether ``path`` holds nothing but what ``LocalTritonServer`` writes in its working
    folder: the server's log and the backend folder of links it makes."""
    for directory, dirs, files in os.walk(path, followlinks=False):
        for name in dirs + files:
            rel = os.path.relpath(os.path.join(directory, name), path).replace(os.sep, "/")
            if rel not in _WORKDIR_ENTRIES:
                return False
    return True


SERVER_WORKDIR = OutputKind("Triton server working folder", directory=True, recognise=is_server_workdir)


class LocalTritonServer:
    """One tritonserver process on 127.0.0.1, serving ``repository``.

    ``with LocalTritonServer(env, repository, workdir) as server:`` starts it and waits until
    every model is ready (``server.http_url``, ``server.grpc_url``), and stops it on exit.
    The server's output goes to ``<workdir>/tritonserver.log``; errors quote its tail.
    """

    def __init__(
        self,
        env: ServerEnv,
        repository: str,
        workdir: str,
        exit_timeout_s: int = 10,
        startup_timeout_s: float = 120,
        extra_args: tuple[str, ...] = (),
        ports: dict[str, int] | None = None,
    ) -> None:
        """``ports`` fixes some of ``http``, ``grpc``, ``metrics``; the others are free ones."""
        self.env = env
        self.repository = os.path.abspath(repository)
        self.workdir = os.path.abspath(workdir)
        self.exit_timeout_s = exit_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.extra_args = tuple(extra_args)
        self.log_path = os.path.join(self.workdir, "tritonserver.log")
        self.process: subprocess.Popen | None = None
        self.fixed_ports = dict(ports or {})
        unknown = set(self.fixed_ports) - {"http", "grpc", "metrics"}
        if unknown:
            raise ValueError(f"ports: unknown endpoints {sorted(unknown)}; use http, grpc, metrics")
        self.ports: dict[str, int] = {}

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.ports['http']}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.ports['grpc']}"

    def _pick_ports(self) -> dict[str, int]:
        ports = dict(self.fixed_ports)
        for name in ("http", "grpc", "metrics"):
            while name not in ports:
                port = free_port()
                if port not in ports.values():
                    ports[name] = port
        return ports

    def _backend_dir(self) -> str:
        """A backend directory with the python backend and the right stub next to it."""
        backends = os.path.join(self.workdir, "backends")
        python = os.path.join(backends, "python")
        os.makedirs(python, exist_ok=True)
        links = {name: os.path.join(self.env.python_backend, name)
                 for name in ("libtriton_python.so", "triton_python_backend_utils.py")}
        links["triton_python_backend_stub"] = self.env.stub
        for name, target in links.items():
            link = os.path.join(python, name)
            if os.path.lexists(link):
                os.remove(link)
            os.symlink(target, link)
        return backends

    def _environment(self) -> dict[str, str]:
        env = dict(os.environ)
        libs = [self.env.python_libdir, self.env.server_libs]
        if env.get("LD_LIBRARY_PATH"):
            libs.append(env["LD_LIBRARY_PATH"])
        env["LD_LIBRARY_PATH"] = os.pathsep.join(libs)
        env["PATH"] = os.pathsep.join([os.path.join(self.env.root, "bin"), env.get("PATH", "")])
        for name in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):  # the stub's Python is the server env's
            env.pop(name, None)
        return env

    def _log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no log)"

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def start(self, attempts: int = 3) -> "LocalTritonServer":
        """Starts the server and waits until it is ready; retries on ports lost to a race."""
        if self.process is not None:
            raise TritonServerError("this server is already started")
        os.makedirs(self.workdir, exist_ok=True)
        backends = self._backend_dir()
        for attempt in range(attempts):
            self.ports = self._pick_ports()
            command = [
                self.env.tritonserver,
                f"--model-repository={self.repository}",
                f"--backend-directory={backends}",
                "--http-address=127.0.0.1", f"--http-port={self.ports['http']}",
                "--grpc-address=127.0.0.1", f"--grpc-port={self.ports['grpc']}",
                "--metrics-address=127.0.0.1", f"--metrics-port={self.ports['metrics']}",
                f"--exit-timeout-secs={self.exit_timeout_s}",
                *self.extra_args,
            ]
            with open(self.log_path, "w") as log:
                self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                                env=self._environment(), start_new_session=True)
            deadline = time.monotonic() + self.startup_timeout_s
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    break
                if self._ready():
                    return self
                time.sleep(0.2)
            code = self.process.poll()
            log = self._log_tail()
            if code is None:
                self.stop()
                raise TritonServerError(f"tritonserver not ready after {self.startup_timeout_s:.0f} s "
                                        f"(log {self.log_path}):\n{log}")
            self.process = None
            if "address already in use" not in log.lower() or attempt == attempts - 1:
                raise TritonServerError(f"tritonserver exited with code {code} while starting "
                                        f"(log {self.log_path}):\n{log}")
        raise AssertionError("unreachable")

    def stop(self) -> int:
        """SIGTERM, then up to ``exit_timeout_s`` + 10 s for a clean exit, else SIGKILL of the
        whole process group (the stubs included). Returns the exit code (0 when clean)."""
        if self.process is None:
            return 0
        process, self.process = self.process, None
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=self.exit_timeout_s + 10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        return process.returncode

    def __enter__(self) -> "LocalTritonServer":
        return self.start() if self.process is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
