"""Every dataset, export and prediction writer against destinations that are not its own
(dlrm.engine.outputs): an existing foreign folder (holding notes.txt), the run's own input, ``.``
run from a project folder, a file, a symbolic link to elsewhere, and a read-only folder. Each
entry point runs for real (``python -m ...`` or the script) and must end in one line on stderr,
exit code 2, with every file of the temporary tree (and of the shared inputs) unchanged,
compared by checksum. Then each is run twice into a new path, as a user repeating a README
command would: the second run says in one line to pass --overwrite, and with --overwrite the
earlier output is replaced.

A read-only folder: as root (which chmod does not stop) the command runs in a private mount
namespace where the folder is bind-mounted read-only; as anyone else the folder is mode 0555.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from conftest import REPO, tree
import warm_python

TIMEOUT_S = 300
PARALLEL = 2  # runs at a time (most import torch, on one core each)

NETWORK = {
    "Kind": "AutoEncoder",
    "Layers": [
        {"Kind": "Input", "N": "auto", "DataSet": "input", "Sparse": True},
        {"Kind": "Hidden", "N": 8, "Activation": "Sigmoid"},
        {"Kind": "Output", "N": "auto", "DataSet": "output", "Activation": "Sigmoid"},
    ],
    "ErrorFunction": "ScaledMarginalCrossEntropy",
}




def _read_only_by_mount() -> str | None:
    """Why a read-only bind mount cannot be made here (None: it can)."""
    if shutil.which("unshare") is None:
        return "needs util-linux's unshare"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount --bind /tmp /tmp && mount -o remount,bind,ro /tmp"],
                           capture_output=True, text=True, timeout=30)
    return None if probe.returncode == 0 else f"unshare -m and mount need privileges: {probe.stderr.strip()}"


AS_ROOT = os.geteuid() == 0
NO_RO_MOUNT = _read_only_by_mount() if AS_ROOT else None
# Runs the rest of the arguments with $RO bind-mounted read-only (in this process's own namespace only).
_RO = 'mount --bind "$RO" "$RO" && mount -o remount,bind,ro "$RO" && exec "$@"'


def run(argv: list[str], cwd: Path | str = REPO, read_only: Path | None = None) -> subprocess.Popen:
    """Starts ``argv`` (after the interpreter) as a user would; ``read_only``: that folder read-only."""
    command = [sys.executable, *argv]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    if read_only is not None and AS_ROOT:
        command = ["unshare", "-m", "sh", "-c", _RO, "sh", *command]
        env["RO"] = str(read_only)
    return warm_python.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=TIMEOUT_S)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def one_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stdout[-2000:], proc.stderr[-4000:])
    assert lines[0].startswith("error: ") and "Traceback" not in proc.stdout + proc.stderr, lines
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


# ----------------------------------------------------------------------------- the shared inputs


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """Tiny inputs of every writer, built once: Criteo TSV, numeric TSV, a CSV source spec, a
    split-binary dataset, DSSTNE text, a recommender dataset and checkpoint, a DLRM checkpoint."""
    import numpy as np
    import torch
    import yaml

    from dlrm.data.synthetic import write_synthetic_dataset
    from dlrm.model.dlrm import DLRM, DLRMConfig
    from dlrm.training.checkpoint import TrainState, save_checkpoint
    from nvidia_specs import SMALL_CSV
    from preproc.generate import generate_criteo_tsv

    root = tmp_path_factory.mktemp("inputs")
    recommender = [run(["-m", "dlrm.scripts.recommender_generate", "--synthetic", "--users", "60", "--items", "40",
                        "--interactions", "1500", "--heldout_fraction", "0.2", "--output", str(root / "rec")])]
    generate_criteo_tsv(str(root / "criteo_train.tsv"), 200, seed=1)
    generate_criteo_tsv(str(root / "criteo_test.tsv"), 60, seed=2)
    rng = np.random.default_rng(0)
    for name, rows in (("train.tsv", 40), ("test.tsv", 20)):
        lines = [f"{rng.integers(0, 2)}\t{rng.random():.3f}\t{rng.integers(0, 5)}" for _ in range(rows)]
        (root / name).write_text("\n".join(lines) + "\n")
    (root / "small_csv.yaml").write_text(yaml.safe_dump(SMALL_CSV))
    write_synthetic_dataset(str(root / "ds"), 2, [5, 7], {"train": 64, "test": 32}, batch_size=64, seed=1)
    (root / "histories.txt").write_text("".join(
        f"u{u}\t" + ":".join(f"i{i}" for i in sorted(rng.choice(30, 6, replace=False))) + "\n" for u in range(40)))
    torch.manual_seed(0)
    config = DLRMConfig(num_numerical_features=2, table_sizes=[5, 7], embedding_dim=4, bottom_mlp_sizes=[8, 4],
                        top_mlp_sizes=[8, 1])
    save_checkpoint(str(root / "ck"), DLRM(config), None, None, TrainState())
    (root / "network.json").write_text(json.dumps(NETWORK))
    assert finish(recommender[0]).returncode == 0
    trained = finish(run(["-m", "dlrm.scripts.recommender_train", "--network", str(root / "network.json"), "--input",
                          str(root / "rec" / "input"), "--checkpoint_path", str(root / "rck"), "--max_steps", "1",
                          "--batch_size", "32", "--device", "cpu"]))
    assert trained.returncode == 0, trained.stderr[-3000:]
    return root


# ----------------------------------------------------------------------------- the writers


@dataclass
class Writer:
    """One entry point and the path flag it writes: ``args(inputs, destination)`` is its command
    line after the interpreter, ``own_input`` the input it reads (a destination it must refuse)."""

    name: str
    flag: str
    args: Callable[[Path, str], list[str]]
    own_input: Callable[[Path], Path]
    file: bool = False  # writes one file, not a folder
    again: list[str] = field(default_factory=list)  # a run that writes other bytes, for --overwrite
    overwrite_test: bool = True
    rerun_flag: str = ""  # the flag a second run's message names, when not ``flag``
    destinations: tuple[str, ...] = ()  # a subset of DESTINATIONS, where the code path is another row's


def _preproc(engine: str) -> Callable[[Path, str], list[str]]:
    return lambda i, d: ["-m", "preproc", "--train", str(i / "criteo_train.tsv"), "--test", str(i / "criteo_test.tsv"),
                         "--workers", "1", "--progress", "off", "--engine", engine, "--output", d]


def _predict(i: Path) -> list[str]:
    return ["-m", "dlrm.scripts.recommender_predict", "--load_checkpoint_path", str(i / "rck"), "--input",
            str(i / "rec" / "input"), "--k", "3", "--device", "cpu"]


def _deploy(i: Path, d: str, script: bool = False) -> list[str]:
    entry = [os.path.join(REPO, "triton", "deployer.py")] if script else ["-m", "dlrm.scripts.deploy"]
    return entry + ["--checkpoint", str(i / "ck"), "--format", "torchscript", "--check_batch_sizes", "1",
                    "--instance_kind", "cpu", "--model_repository", d]


DESTINATIONS = ["foreign_folder", "own_input", "working_directory", "file", "symlink", "read_only_folder"]

WRITERS = [
    Writer("preproc", "--output", _preproc("local"), lambda i: i / "criteo_train.tsv",
           again=["--frequency_threshold", "2"]),
    # The claim comes before either engine starts: the local rows cover the rest.
    Writer("preproc_spark", "--output", _preproc("spark"), lambda i: i / "criteo_test.tsv", overwrite_test=False,
           destinations=("foreign_folder", "own_input")),
    Writer("preproc_work_dir", "--work_dir",
           lambda i, d: _preproc("local")(i, str(Path(d).parent / "fresh_output")) + ["--work_dir", d],
           lambda i: i / "criteo_train.tsv", overwrite_test=False),
    Writer("preproc_generate", "--output",
           lambda i, d: ["-m", "preproc.generate", "--rows", "20", "--output", d], lambda i: i,  # it reads nothing
           file=True, again=["--seed", "7"], destinations=tuple(d for d in DESTINATIONS if d != "own_input")),
    Writer("preproc_generate_days", "--output",
           lambda i, d: ["-m", "preproc.generate", "--rows", "20", "--days", "2", "--output", d], lambda i: i,
           again=["--gzip"], destinations=tuple(d for d in DESTINATIONS if d != "own_input")),
    Writer("transcode", "--output",
           lambda i, d: ["-m", "dlrm.scripts.transcode", "--train", str(i / "train.tsv"), "--test", str(i / "test.tsv"),
                         "--num_numerical", "1", "--num_categorical", "1", "--output", d],
           lambda i: i / "test.tsv", again=["--cardinalities", "9"]),
    Writer("prepare_synthetic_dataset", "--synthetic_dataset_dir",
           lambda i, d: ["-m", "dlrm.scripts.prepare_synthetic_dataset", "--feature_spec", str(i / "ds"),
                         "--synthetic_dataset_num_entries", "64", "--num_test_entries", "32", "--batch_size", "64",
                         "--synthetic_dataset_dir", d],
           lambda i: i / "ds", again=["--seed", "7"]),
    Writer("gen_csv", "--output",
           lambda i, d: ["-m", "dlrm.scripts.gen_csv", "--feature_spec_in", str(i / "small_csv.yaml"), "--size", "5",
                         "--output", d],
           lambda i: i / "small_csv.yaml", again=["--seed", "7"]),
    Writer("recommender_generate", "--output",
           lambda i, d: ["-m", "dlrm.scripts.recommender_generate", "--text", str(i / "histories.txt"), "--output", d],
           lambda i: i / "histories.txt", again=["--heldout_fraction", "0.5"]),
    # An explicit index is read and merged into, so an index of its own is continued; never a foreign file.
    Writer("recommender_generate_features_index", "--features_index",
           lambda i, d: ["-m", "dlrm.scripts.recommender_generate", "--text", str(i / "histories.txt"), "--output",
                         str(Path(d).parent / "fresh_output"), "--features_index", d],
           lambda i: i / "histories.txt", file=True, overwrite_test=False),
    Writer("recommender_predict", "--output", lambda i, d: _predict(i) + ["--output", d],
           lambda i: i / "rec" / "input", file=True, again=["--k", "2"]),
    Writer("recommender_predict_scores", "--scores_path",
           lambda i, d: _predict(i) + ["--output", str(Path(d).parent / "recs_beside.txt"), "--scores_path", d],
           lambda i: i / "rec" / "input", file=True, rerun_flag="--output"),  # the predictions are checked first
    Writer("recommender_evaluate", "--output",
           lambda i, d: ["-m", "dlrm.scripts.recommender_evaluate", "--input", str(i / "rec" / "input"), "--heldout",
                         str(i / "rec" / "heldout"), "--baselines", "popularity", "--k", "5", "--output", d],
           lambda i: i / "rec" / "heldout", file=True, again=["--k", "3"]),
    Writer("export", "--output",
           lambda i, d: ["-m", "dlrm.scripts.export", "--checkpoint", str(i / "ck"), "--format", "torchscript",
                         "--check_batch_sizes", "1", "--output", d],
           lambda i: i / "ck"),
    Writer("deploy", "--model_repository", _deploy, lambda i: i / "ck", again=["--numerical_type", "fp16"],
           rerun_flag="--model_name"),  # the repository takes more models; the model folder is the one there
    # The same main as deploy, started as a script.
    Writer("triton_deployer", "--model_repository", lambda i, d: _deploy(i, d, script=True), lambda i: i / "ck",
           overwrite_test=False, destinations=("foreign_folder", "symlink")),
]



def _expected(writer: Writer, destination: str) -> str:
    """A phrase the one line must hold."""
    if destination == "foreign_folder":
        return "is a folder" if writer.file else "already exists and is not a"
    if destination == "own_input":
        return "the input"
    if destination == "working_directory":
        return "is a folder" if writer.file else "is the working directory"
    if destination == "file":
        return "already exists and is not a" if writer.file else "is a file, not a folder"
    if destination == "symlink":
        return "symbolic link"
    return "read-only file system" if AS_ROOT else "permission denied"


def _sandbox(root: Path, destination: str, writer: Writer, inputs: Path) -> tuple[str, Path, Path | None]:
    """(flag value, working directory, read-only folder) of a destination, built under ``root``."""
    ext = ".npy" if writer.flag == "--scores_path" else ".txt"
    (root / "elsewhere").mkdir()
    (root / "elsewhere" / f"kept{ext}").write_text("someone else's\n")
    project = root / "project"
    project.mkdir()
    (project / "notes.txt").write_text("my notes\n")
    (project / "data.csv").write_text("1,2,3\n")
    cwd: Path | str = REPO
    read_only = None
    if destination == "foreign_folder":
        (root / "mine").mkdir()
        (root / "mine" / "notes.txt").write_text("my notes\n")
        value = str(root / "mine")
    elif destination == "own_input":
        value = str(writer.own_input(inputs))
    elif destination == "working_directory":
        value, cwd = ".", project
    elif destination == "file":
        (root / f"afile{ext}").write_text("my file\n")
        value = str(root / f"afile{ext}")
    elif destination == "symlink":
        os.symlink(root / "elsewhere" / (f"kept{ext}" if writer.file else ""), root / "link")
        value = str(root / "link")
    else:
        read_only = root / "locked"
        read_only.mkdir()
        value = str(read_only / f"out{ext}") if writer.file else str(read_only)
        if not AS_ROOT:
            read_only.chmod(0o555)
    return value, Path(cwd), read_only


@pytest.mark.parametrize("writer", WRITERS, ids=lambda w: w.name)
def test_every_destination_not_its_own_is_refused_in_one_line(writer, inputs, tmp_path):
    """The six destinations of one writer, run a few at a time; each refused, nothing changed."""
    destinations = [d for d in writer.destinations or DESTINATIONS
                    if not (d == "read_only_folder" and AS_ROOT and NO_RO_MOUNT)]
    cases = {}
    for destination in destinations:
        root = tmp_path / destination
        root.mkdir()
        value, cwd, read_only = _sandbox(root, destination, writer, inputs)
        cases[destination] = (root, writer.args(inputs, value), cwd, read_only)
    before_inputs = tree(inputs)
    before = {d: tree(root) for d, (root, *_) in cases.items()}
    results = {}
    pending = list(cases.items())
    while pending:
        batch, pending = pending[:PARALLEL], pending[PARALLEL:]
        started = [(d, run(argv, cwd, read_only)) for d, (_, argv, cwd, read_only) in batch]
        results.update((d, finish(p)) for d, p in started)
    try:
        for destination, proc in results.items():
            line = one_line(proc, _expected(writer, destination))
            if destination != "read_only_folder":  # that line names the path, as the file system's refusals do
                assert writer.flag in line, line
            assert tree(cases[destination][0]) == before[destination], destination
        assert tree(inputs) == before_inputs
    finally:
        for root, _, _, read_only in cases.values():
            if read_only is not None:
                read_only.chmod(0o755)
    if AS_ROOT and NO_RO_MOUNT and "read_only_folder" in (writer.destinations or DESTINATIONS):
        pytest.skip(f"the read-only folder was not tried: {NO_RO_MOUNT}")


def _stamps(path: Path) -> dict[str, int]:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return {str(p): p.stat().st_mtime_ns for p in files}


def _content(path: Path) -> dict[str, str]:
    return tree(path) if path.is_dir() else {path.name: hashlib.sha256(path.read_bytes()).hexdigest()}


@pytest.mark.parametrize("writer", [w for w in WRITERS if w.overwrite_test], ids=lambda w: w.name)
def test_a_second_run_asks_for_overwrite_which_replaces_the_first_output(writer, inputs, tmp_path):
    out = tmp_path / ("out.npy" if writer.flag == "--scores_path" else "out.txt" if writer.file else "out")
    argv = writer.args(inputs, str(out))
    first = finish(run(argv))
    assert first.returncode == 0, first.stderr[-3000:]
    written, stamps, content, read = tree(tmp_path), _stamps(out), _content(out), tree(inputs)
    assert stamps, "the first run wrote nothing"

    one_line(finish(run(argv)), writer.rerun_flag or writer.flag, "pass --overwrite")  # the same command again
    assert tree(tmp_path) == written and tree(inputs) == read

    replaced = finish(run(argv + writer.again + ["--overwrite"]))
    assert replaced.returncode == 0, replaced.stderr[-3000:]
    after = _stamps(out)
    assert all(after.get(path, -1) != stamp for path, stamp in stamps.items()), "a file of the first run was kept"
    if writer.again:  # other settings: other bytes
        assert _content(out) != content
    assert tree(inputs) == read


# ----------------------------------------------------------------------------- N4: a spec's paths


def _csv_spec(tmp_path: Path, train_file: str) -> Path:
    import copy

    import yaml

    from nvidia_specs import SMALL_CSV

    spec = copy.deepcopy(SMALL_CSV)
    spec["source_spec"]["train"][0]["files"] = [train_file]
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.parametrize("escape", ["absolute", "parent"])
def test_gen_csv_never_writes_where_a_spec_points_outside_its_output(tmp_path, escape):
    """A reader follows a spec's absolute or '..' path; gen_csv, which writes, refuses it, even with --overwrite."""
    victim = tmp_path / "victim.csv"
    victim.write_text("0,1,2\n")  # a CSV of numbers, as gen_csv writes: still not to be written
    spec = _csv_spec(tmp_path, str(victim) if escape == "absolute" else "../victim.csv")
    before = tree(tmp_path)
    proc = finish(run(["-m", "dlrm.scripts.gen_csv", "--feature_spec_in", str(spec), "--size", "5", "--output",
                       str(tmp_path / "out"), "--overwrite"]))
    one_line(proc, "source_spec.train[0] file", "would be written outside the output folder")
    assert tree(tmp_path) == before


def test_write_random_csv_replaces_only_its_own_files(tmp_path):
    """With overwrite: a CSV file of numbers (what it writes) is replaced, any other file never."""
    from dlrm.data.csv_source import CsvSource, write_random_csv
    from dlrm.engine.outputs import OutputError

    spec = _csv_spec(tmp_path, "train/numerical.csv")
    out = tmp_path / "out"
    (out / "train").mkdir(parents=True)
    (out / "train" / "numerical.csv").write_text("my notes, not numbers\n")
    source = CsvSource.from_yaml(str(spec), base_directory=str(out))
    before = tree(tmp_path)
    with pytest.raises(OutputError, match="is not a CSV file of numbers written by this program"):
        write_random_csv(source, 5, overwrite=True)
    assert tree(tmp_path) == before
    (out / "train" / "numerical.csv").write_text("0.5,0.25,0.125\n")
    with pytest.raises(OutputError, match="exists; pass `overwrite`"):
        write_random_csv(source, 5)
    assert tree(tmp_path) == {**before, "out/train/numerical.csv": tree(tmp_path)["out/train/numerical.csv"]}
    written = write_random_csv(source, 5, overwrite=True)
    assert str(out / "train" / "numerical.csv") in written
    lines = (out / "train" / "numerical.csv").read_text().splitlines()
    assert len(lines) == 5 and all(len(line.split(",")) == 3 for line in lines)


def test_nvidias_commands_twice_ask_for_overwrite(tmp_path):
    """docs/data_format.md's NVIDIA commands (gen_csv into a folder, transcode into a folder inside
    it), run twice: the second round asks for --overwrite, and with it both run again."""
    from nvidia_specs import SMALL_CSV
    import yaml

    spec = tmp_path / "small_csv.yaml"
    spec.write_text(yaml.safe_dump(SMALL_CSV))
    data = tmp_path / "data"
    gen = ["-m", "dlrm.scripts.gen_csv", "--feature_spec_in", str(spec), "--output", str(data), "--size", "20"]
    transcode = ["-m", "dlrm.scripts.transcode", "--input", str(data), "--output", str(data / "converted")]
    for argv in (gen, transcode):
        assert finish(run(argv)).returncode == 0
    before = tree(tmp_path)
    for argv in (gen, transcode):
        one_line(finish(run(argv)), "--output", "pass --overwrite")
    assert tree(tmp_path) == before
    for argv in (gen, transcode):
        proc = finish(run(argv + ["--overwrite"]))
        assert proc.returncode == 0, proc.stderr


def test_a_folder_filled_while_a_dataset_was_staged_is_not_replaced(tmp_path):
    """atomic.replace_dir claims the destination again just before the rename."""
    from dlrm.data.split_binary_writer import SPLIT_BINARY_DATASET
    from dlrm.engine.atomic import check_writable_dir, replace_dir, temporary_name
    from dlrm.engine.outputs import OutputError

    target = tmp_path / "ds"
    target.mkdir()
    check_writable_dir(target, SPLIT_BINARY_DATASET, "output_dir", overwrite=True)  # empty: free
    staging = temporary_name(target)
    os.mkdir(staging)
    (Path(staging) / "feature_spec.yaml").write_text("{}")
    (target / "notes.txt").write_text("written meanwhile\n")
    with pytest.raises(OutputError, match="is not a dataset written by this program"):
        replace_dir(staging, target, SPLIT_BINARY_DATASET, "output_dir", overwrite=True)
    assert (target / "notes.txt").read_text() == "written meanwhile\n" and os.path.isdir(staging)


@pytest.mark.parametrize("name", ["../escape.yaml", "/tmp/escape.yaml", "train"])
def test_transcode_writes_its_spec_in_its_output_beside_the_splits(inputs, tmp_path, name):
    """--feature_spec_out is a file name in --output: never a path out of it, nor a split's folder."""
    before = tree(tmp_path)
    proc = finish(run(["-m", "dlrm.scripts.transcode", "--train", str(inputs / "train.tsv"), "--num_numerical", "1",
                       "--num_categorical", "1", "--output", str(tmp_path / "out"), "--feature_spec_out", name]))
    one_line(proc, f"--feature_spec_out {name!r}")
    assert tree(tmp_path) == before
