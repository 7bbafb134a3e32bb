"""Run the Triton Inference Server bundled with nvidia-pytriton on a model repository, on this
machine's CPU, until Ctrl-C or SIGTERM.

    bash triton/setup_server_env.sh .venv-tritonserver           # once
    python triton/local_server.py --model_repository models/ [--server_env .venv-tritonserver]

It serves python-backend repositories (deploy with --python_backend --instance_kind cpu) and
prints the HTTP and gRPC addresses (free ports on 127.0.0.1 unless --http_port/--grpc_port are
given). Logic: dlrm/inference/triton_server.py.
"""

import os
import signal
import sys
import tempfile
import threading

from absl import app, flags

from dlrm.engine.outputs import claim_output
from dlrm.inference.triton_server import SERVER_WORKDIR, LocalTritonServer, ServerEnv, TritonServerError
from dlrm.scripts import cli

FLAGS = flags.FLAGS
flags.DEFINE_string("model_repository", None, "Model repository to serve.")
flags.DEFINE_string("server_env", ".venv-tritonserver", "Virtual environment made by triton/setup_server_env.sh.")
flags.DEFINE_string("workdir", None, "Where the backend directory and tritonserver.log go (default: a temporary one).")
flags.DEFINE_integer("http_port", None, "HTTP port (default: a free one).", lower_bound=1, upper_bound=65535)
flags.DEFINE_integer("grpc_port", None, "gRPC port (default: a free one).", lower_bound=1, upper_bound=65535)
flags.mark_flag_as_required("model_repository")


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    if not os.path.isdir(FLAGS.model_repository):
        what = "is not a directory" if os.path.exists(FLAGS.model_repository) else "does not exist"
        raise app.UsageError(f"--model_repository {FLAGS.model_repository} {what}; write one with "
                             f"python triton/deployer.py --python_backend --instance_kind cpu")
    if FLAGS.workdir:  # its log and backend links are rewritten: never in a folder of the user's
        claim_output(FLAGS.workdir, SERVER_WORKDIR, "workdir", inputs={"model_repository": FLAGS.model_repository},
                     keep=True)
    if FLAGS.http_port and FLAGS.http_port == FLAGS.grpc_port:
        raise app.UsageError(f"--http_port and --grpc_port are both {FLAGS.http_port}; give two ports")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    ports = {"http": FLAGS.http_port, "grpc": FLAGS.grpc_port}
    try:
        env = ServerEnv.find(FLAGS.server_env)
        with tempfile.TemporaryDirectory(prefix="tritonserver-") as tmp:
            server = LocalTritonServer(env, FLAGS.model_repository, FLAGS.workdir or tmp,
                                       ports={k: v for k, v in ports.items() if v})
            with server:
                print(f"serving {FLAGS.model_repository}: http {server.http_url}  grpc {server.grpc_url}  "
                      f"(log {server.log_path}); Ctrl-C stops", flush=True)
                while not stop.wait(1.0):
                    if server.process is None or server.process.poll() is not None:
                        print(f"tritonserver exited; log {server.log_path}", file=sys.stderr)
                        return 1
            print("stopped")
    except TritonServerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    cli.run(main)
