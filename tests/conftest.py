import hashlib
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import warm_python

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors, so CI checks every
# kernel against its torch reference. Set before anything imports triton: the interpreter is
# chosen when a kernel is defined. On a GPU machine the real kernels run.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Spark's JVM (one per local session, in this process and in every command a test runs) does
# short jobs: the C1 compiler alone and the serial collector start it and warm it up in half the
# time on two cores. Passed as spark-submit's driver options, which print nothing (unlike
# JAVA_TOOL_OPTIONS, whose notice on stderr would add a line to every command's errors).
# spark-submit first runs a launcher JVM that builds the driver's command: the same options.
os.environ.setdefault("PYSPARK_SUBMIT_ARGS",
                      "--driver-java-options '-XX:TieredStopAtLevel=1 -XX:+UseSerialGC' pyspark-shell")
os.environ.setdefault("SPARK_LAUNCHER_OPTS", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def log_records(path: str, kind: str) -> list[dict]:
    """The records of type ``kind`` in a run's JSON-lines log (``--log_path``), in order."""
    with open(path, encoding="utf-8") as f:
        return [r for r in map(json.loads, f) if r["type"] == kind]


def run_cli(module: str, *args: str, timeout: float = 300, check: bool = True,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Runs ``python -m module args`` as a user would, from the repository root (in ``env``,
    default: this process's without ``TRITON_INTERPRET``: a user's CPU run takes the kernels'
    torch twins, and the interpreter, which the kernel tests check against those twins, would
    make a command-line run of a fused table a hundred times slower)."""
    if env is None:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = warm_python.run(
        [sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
        env={**env, "PYTHONUNBUFFERED": "1"},
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"{module} {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def run_entry_points(module: str, cases: list[list[str]] | list[dict], workdir: pathlib.Path, *,
                     preload: tuple[str, ...] | list[str] = (), timeout: float = 600) -> list[dict]:
    """Each of ``cases`` (argument lists, run in ``workdir``; or dicts with ``args`` and ``cwd``) as
    ``python -m module args``, as forks of one process that imported ``preload`` first
    (tests/entry_point_runner.py: each is still the script run as ``__main__``): their exit codes,
    stdout and stderr, in order. Without ``TRITON_INTERPRET``, as ``run_cli``."""
    spec, results = workdir / f".{os.path.basename(module)}.cases.json", workdir / f".{os.path.basename(module)}.results.json"
    cases = [c if isinstance(c, dict) else {"args": c, "cwd": str(workdir)} for c in cases]
    spec.write_text(json.dumps({"module": module, "preload": list(preload), "cases": cases}))
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "PYTHONPATH": REPO,
           "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = warm_python.run([sys.executable, os.path.join(REPO, "tests", "entry_point_runner.py"), str(spec),
                            str(results)], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(results.read_text())
    os.remove(spec)
    os.remove(results)
    return out


_FORK_SERVER_ENV: dict[str, str] | None = None


def spawn(fn, args: tuple = (), nprocs: int = 1) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs, join=True)`` for the gloo tests, started from
    a fork server that imported torch once (multiprocessing's ``forkserver``) rather than as fresh
    interpreters that each import it (``spawn``): the same separate processes, process groups and
    exit handling, 3 s of CPU less per process. The server's children have the environment it
    started with, so a test whose environment has changed since spawns as before."""
    global _FORK_SERVER_ENV
    import multiprocessing

    import torch.multiprocessing as mp

    env = dict(os.environ)
    if _FORK_SERVER_ENV is None:
        multiprocessing.set_forkserver_preload(["torch", "numpy"])
        _FORK_SERVER_ENV = env
    warm = env == _FORK_SERVER_ENV and os.environ.get("DLRM_TEST_COLD_START") != "1"
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver" if warm else "spawn")


def env_without_this_python(tmp_path: pathlib.Path) -> dict[str, str]:
    """The environment of a venv's python started by its path: its folder is not on PATH, the
    first ``python3`` on PATH is another one (here one that only fails), PYSPARK_PYTHON is unset."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python3").write_text("#!/bin/sh\necho 'not the python to use' >&2\nexit 3\n")
    (fake / "python3").chmod(0o755)
    here = os.path.dirname(sys.executable)
    path = os.pathsep.join([str(fake), *(d for d in os.environ["PATH"].split(os.pathsep) if d != here)])
    env = {k: v for k, v in os.environ.items() if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON")}
    return {**env, "PATH": path, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def tree(root: "str | os.PathLike") -> dict[str, str]:
    """Every entry under ``root``: a file's sha256, a link's target, "dir" for a folder: what a
    refused command must leave exactly as it was."""
    found = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            full = os.path.join(directory, name)
            rel = os.path.relpath(full, root)
            if os.path.islink(full):
                found[rel] = "link:" + os.readlink(full)
            elif os.path.isfile(full):
                found[rel] = hashlib.sha256(open(full, "rb").read()).hexdigest()
            else:
                found[rel] = "dir"
    return found


def fetch_movielens_100k(out: str, root: pathlib.Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``recommender_generate --dataset movielens-100k --output out --heldout_fraction 0.2`` in
    ``env``; skips the test, saying why, only where pip cannot reach the package index."""
    proc = run_cli("dlrm.scripts.recommender_generate", "--dataset", "movielens-100k", "--output", out,
                   "--heldout_fraction", "0.2", env=env, check=False)
    if proc.returncode == 2 and "cannot download" in proc.stderr:
        probe = warm_python.run([sys.executable, "-m", "pip", "download", "--no-deps", "recbole==1.2.1", "-d",
                                str(root / "probe")], capture_output=True, text=True, timeout=600)
        if probe.returncode != 0:
            pytest.skip(f"pip cannot download recbole==1.2.1 here: {(probe.stderr.strip().splitlines() or [''])[-1]}")
    assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(scope="session")
def synthetic_dataset(tmp_path_factory):
    """Writes small split-binary datasets with the project's writer: ``synthetic_dataset(
    num_numerical, table_sizes, rows_per_split, batch_size=, seed=)`` -> its folder, written once
    per test process for each distinct set of arguments (tests only read it)."""
    from dlrm.data.synthetic import write_synthetic_dataset

    written: dict[tuple, str] = {}

    def make(num_numerical: int, table_sizes: list[int], rows: dict[str, int], *, batch_size: int,
             seed: int) -> str:
        key = (num_numerical, tuple(table_sizes), tuple(sorted(rows.items())), batch_size, seed)
        if key not in written:
            root = str(tmp_path_factory.mktemp("data"))
            write_synthetic_dataset(root, num_numerical, list(table_sizes), dict(rows), batch_size=batch_size,
                                    seed=seed)
            written[key] = root
        return written[key]

    return make


@pytest.fixture
def cli():
    return run_cli


# The costliest test files, most first (their summed test times on two cores, 2026-11-29). test.sh
# runs one file to a worker (``--dist loadfile --no-loadscope-reorder``) in this order, so the long
# files start first and the short ones fill in at the end, instead of a long file starting last
# while the other workers have nothing left.
COSTLIEST_FILES = (
    "test_spark_score.py", "test_spark_recommend.py", "test_preproc_engines.py", "test_hostile_outputs.py",
    "test_preproc_cli.py", "test_spark_train.py", "test_quantized_serving.py", "test_kernel_embedding_bag.py",
    "test_row_wise.py", "test_dcn.py", "test_fs_faults.py", "test_kernel_embedding.py", "test_export.py",
    "test_distributed.py", "test_half_weight_kernels.py", "test_multi_hot_data.py", "test_torchrun.py",
    "test_writer_outputs.py", "test_fused_rowwise_adagrad.py", "test_gradient_overlap.py",
    "test_nvidia_commands.py", "test_warm_python.py", "test_bag_embeddings.py", "test_optimizers.py",
    "test_recommender_validation.py", "test_recommender_linear.py", "test_cli.py", "test_triton_server.py",
    "test_cli_errors.py", "test_resume.py",
)


def pytest_collection_modifyitems(config, items):
    """The costliest files first (``COSTLIEST_FILES``; the others after, in their order), and
    tests marked ``gpu`` skip themselves on machines without CUDA."""
    rank = {name: i for i, name in enumerate(COSTLIEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def spark():
    """A local Spark session of two task slots for a test module (a module may define its own)."""
    from dlrm.spark.launch import local_session

    session = local_session("local[2]")
    yield session
    session.stop()


def tensorboard_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the event files in ``logdir``, read with TensorBoard's own reader:
    tag -> [(step, value)] in the order written."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(logdir, size_guidance={"scalars": 0})  # 0: keep every point
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def logged_scalars(log_path: str, kinds: tuple[str, ...]) -> dict[str, list[tuple[int, float]]]:
    """The same curves from the JSON-lines log: each number of each record of ``kinds``."""
    import json
    out: dict[str, list[tuple[int, float]]] = {}
    for record in map(json.loads, open(log_path)):
        if record["type"] in kinds:
            for name, value in record.items():
                if (name not in ("type", "time", "step", "epoch") and isinstance(value, (int, float))
                        and not isinstance(value, bool)):
                    out.setdefault(f"{record['type']}/{name}", []).append((record["step"], value))
    return out
