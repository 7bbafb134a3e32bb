"""The hostile user: every path flag of every entry point pointed at something the user cares
about. One table (WRITERS) holds every flag a command writes to; each is run for real against
an existing foreign folder, the run's own input, `.` from a project folder, a file, a symbolic
link to elsewhere and a read-only file system, and must end in one line on stderr, exit 2, with
the checksums of the whole tree unchanged. The same command with a fresh path succeeds (so the
refusals are the rule's, not a bad command line). A flag that writes and is not in the table
fails ``test_every_writer_is_in_the_table``.

The cases of one entry point run in one process that forks per command line after the heavy
imports (tests/entry_point_runner.py): each is still the script run as ``__main__`` with its
own argv and working directory. The read-only file system is a tmpfs mounted read-only in a
mount namespace of the runner's own (as ``unshare -m`` makes), as in test_fs_faults.py.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from conftest import REPO, run_cli
import warm_python

CASES = ("foreign", "input", "dot", "file", "symlink", "readonly")
DLRM_SMALL = ["--synthetic_dataset_table_sizes", "50,60", "--embedding_dim", "4", "--bottom_mlp_sizes", "8,4",
              "--top_mlp_sizes", "8,1", "--batch_size", "256", "--test_batch_size", "256", "--max_steps", "2",
              "--base_device", "cpu", "--print_freq", "1"]
NETWORK = {"Kind": "FeedForward", "Layers": [
    {"Name": "Input", "Kind": "Input", "N": "auto", "DataSet": "input", "Sparse": True},
    {"Name": "Hidden", "Kind": "Hidden", "Type": "FullyConnected", "N": 8, "Activation": "Sigmoid",
     "Source": "Input"},
    {"Name": "Output", "Kind": "Output", "Type": "FullyConnected", "N": "auto", "DataSet": "output",
     "Activation": "Sigmoid", "Sparse": True, "Source": "Hidden"}]}


@dataclass
class Writer:
    """One flag of one entry point that writes. ``command(inputs, dest, scratch)``: a command
    line that writes its ``flag`` output at ``dest`` (every other output under ``scratch``);
    ``own_input(inputs)``: a path the command reads; ``directory``: the output is a folder."""

    module: str
    flag: str
    directory: bool
    command: Callable[[dict, str, str], list[str]]
    own_input: Callable[[dict], str]
    preload: list[str] = field(default_factory=list)
    # Whether the command with a fresh destination got past every check of its outputs: by
    # default it succeeds; a server that cannot start here may fail later, for another reason.
    control: Callable[[dict], bool] = lambda result: result["returncode"] == 0


def _dlrm(flag: str) -> Callable[[dict, str, str], list[str]]:
    def command(inputs: dict, dest: str, scratch: str) -> list[str]:
        paths = {"save_checkpoint_path": f"{scratch}/ckpt", "log_path": f"{scratch}/log.json",
                 "tensorboard_dir": f"{scratch}/board"}
        paths[flag] = dest
        return ["--dataset", inputs["dataset"], *DLRM_SMALL, *(f"--{k}={v}" for k, v in paths.items())]
    return command


def _recommender(flag: str) -> Callable[[dict, str, str], list[str]]:
    def command(inputs: dict, dest: str, scratch: str) -> list[str]:
        paths = {"save_checkpoint_path": f"{scratch}/ckpt", "log_path": f"{scratch}/log.json",
                 "tensorboard_dir": f"{scratch}/board"}
        paths[flag] = dest
        return ["--network", inputs["network"], "--input", inputs["csr"], "--epochs", "1", "--batch_size", "16",
                "--validation_users", "0", "--base_device", "cpu", *(f"--{k}={v}" for k, v in paths.items())]
    return command


_TRAIN = ["torch", "dlrm.training.build", "dlrm.training.train", "dlrm.scripts.cli"]
_RECOMMENDER = ["torch", "dlrm.recommender.train", "dlrm.recommender.checkpoint", "dlrm.scripts.cli"]
WRITERS = [
    *(Writer("dlrm.scripts.main", flag, directory, _dlrm(flag), lambda i: i["dataset"], _TRAIN)
      for flag, directory in [("save_checkpoint_path", True), ("log_path", False), ("tensorboard_dir", True)]),
    *(Writer("dlrm.scripts.recommender_train", flag, directory, _recommender(flag), lambda i: i["csr"], _RECOMMENDER)
      for flag, directory in [("save_checkpoint_path", True), ("log_path", False), ("tensorboard_dir", True)]),
    # The wide model reads no input: its "input" case is a dataset folder, foreign to it.
    Writer("dlrm.scripts.wide_train", "save_checkpoint_path", True,
           lambda i, dest, scratch: ["--num_samples", "256", "--batch_size", "64", "--save_checkpoint_path", dest],
           lambda i: i["dataset"], ["torch", "dlrm.wide.train", "dlrm.scripts.cli"]),
    Writer(os.path.join(REPO, "triton", "local_server.py"), "workdir", True,
           lambda i, dest, scratch: ["--model_repository", i["dataset"], "--workdir", dest,
                                     "--server_env", f"{scratch}/no_server_here"],
           lambda i: i["dataset"], ["dlrm.inference.triton_server", "dlrm.scripts.cli"],
           control=lambda result: result["returncode"] != 0 and "--workdir" not in result["stderr"]
           and "no_server_here" in result["stderr"]),
    Writer(os.path.join(REPO, "triton", "client.py"), "log_path", False,
           lambda i, dest, scratch: ["--dataset", i["dataset"], "--url", "localhost:1", "--timeout_s", "5",
                                     "--log_path", dest],
           lambda i: os.path.join(i["dataset"], "feature_spec.yaml"), ["dlrm.inference.triton_client", "dlrm.scripts.cli"],
           control=lambda result: result["returncode"] == 2 and "--log_path" not in result["stderr"]),
    # The Spark jobs check --output on the driver before Spark starts; their control run names a
    # model that is not there, which is checked next: that error shows the command got past --output.
    Writer("dlrm.scripts.spark_score", "output", True,
           lambda i, dest, scratch: ["--model", f"{scratch}/no_model.onnx", "--dataset", i["dataset"], "--split",
                                     "test", "--output", dest],
           lambda i: i["dataset"], ["dlrm.scripts.cli"],
           control=lambda result: result["returncode"] == 2 and "no_model.onnx" in result["stderr"]),
    *(Writer("dlrm.scripts.spark_recommend", "output", fmt == "parquet",
             lambda i, dest, scratch, fmt=fmt: ["--load_checkpoint_path", f"{scratch}/no_ckpt", "--input", i["csr"],
                                                "--output_format", fmt, "--output", dest],
             lambda i: os.path.dirname(i["csr"]), ["torch", "dlrm.recommender.topk", "dlrm.scripts.cli"],
             control=lambda result: result["returncode"] == 2 and "no_ckpt" in result["stderr"])
      for fmt in ("parquet", "text")),
    # Its control run reads a folder that is not a checkpoint, which is checked after --output.
    # The plot reads a run log (a record with a step, so there is a curve) and writes one image.
    Writer("dlrm.scripts.plot", "output", False, lambda i, dest, scratch: [i["log"], "--output", dest],
           lambda i: i["log"], ["dlrm.engine.log_plot", "dlrm.scripts.cli"]),
    *(Writer("dlrm.scripts.convert_checkpoint", "output", True,
             lambda i, dest, scratch, to=to: ["--checkpoint", i["dataset"], "--output", dest, "--to", to],
             lambda i: i["dataset"], ["torch", "dlrm.engine.checkpoint_store", "dlrm.training.checkpoint",
                                      "dlrm.training.nvidia_checkpoint", "dlrm.scripts.cli"],
             control=lambda result: result["returncode"] == 2 and "meta.json" in result["stderr"])
      for to in ("nvidia", "dlrm")),
]

# Path flags that only read, or that name something other than a path to write.
READ_ONLY = {
    "dataset", "feature_spec", "feature_spec_in", "load_checkpoint_path", "input", "input_dir", "network", "text",
    "movielens_ratings", "samples_index", "train", "test", "validation", "url", "synthetic_dataset_table_sizes",
    "keep_work_dir", "allow_files_outside_dataset",  # the last a switch, not a path
}
# (entry point file, flag) pairs that read although the flag's name is a writer's elsewhere.
READ_ONLY_HERE = {("dlrm/scripts/recommender_train.py", "output"),  # the targets dataset
                  ("dlrm/scripts/recommender_predict.py", "features_index"),
                  ("dlrm/scripts/recommender_flags.py", "features_index"),  # predict's and evaluate's: read
                  ("dlrm/scripts/spark_recommend.py", "features_index"),
                  ("triton/local_server.py", "model_repository")}  # the repository it serves
_PATHISH = re.compile(r"(path|dir|output|file|spec|index|repository|workdir|work_dir)")


def _defined_path_flags() -> list[tuple[str, str]]:
    """(entry point file, flag) for every path-like flag the command lines define."""
    found = []
    files = glob.glob(os.path.join(REPO, "dlrm", "scripts", "*.py")) + glob.glob(os.path.join(REPO, "preproc", "*.py")) \
        + glob.glob(os.path.join(REPO, "triton", "*.py"))
    for path in files:
        text = open(path, encoding="utf-8").read()
        names = re.findall(r"DEFINE_(?:string|list|multi_string)\(\s*[\"'](\w+)[\"']", text)
        names += re.findall(r"add_argument\(\s*[\"']--(\w+)[\"']", text)
        names += re.findall(r"Setting\(\s*[\"'](\w+)[\"']", text)  # flags declared from a config's fields
        rel = os.path.relpath(path, REPO)
        found += [(rel, n) for n in names if _PATHISH.search(n) or n in READ_ONLY]
    return found


def test_every_writer_is_in_the_table():
    """A path flag either reads (READ_ONLY) or writes and is in WRITERS (or in a writer table of
    the other hostile suites, listed here by entry point)."""
    tabled = {(w.module, w.flag) for w in WRITERS} | set(OTHER_TABLES)
    missing = []
    for rel, flag in _defined_path_flags():
        if flag in READ_ONLY or (rel, flag) in READ_ONLY_HERE:
            continue
        module = _module_of(rel)
        if not any((m, flag) in tabled for m in module):
            missing.append(f"{rel} --{flag}")
    assert not missing, "writers without a hostile-user case:\n" + "\n".join(sorted(missing))


def _module_of(rel: str) -> list[str]:
    """The entry points a flag-defining file belongs to (shared flag modules: their users)."""
    shared = {"dlrm/scripts/dlrm_flags.py": ["dlrm.scripts.main"],
              "dlrm/scripts/nvidia_flags.py": ["dlrm.scripts.main"],
              "dlrm/scripts/recommender_common.py": ["dlrm.scripts.recommender_train"],
              "dlrm/scripts/recommender_flags.py": ["dlrm.scripts.recommender_train", "dlrm.scripts.recommender_predict",
                                                    "dlrm.scripts.recommender_evaluate"],
              "preproc/cli.py": ["preproc"]}
    if rel in shared:
        return shared[rel]
    if rel.startswith("triton/"):
        return [os.path.join(REPO, rel)]
    return [rel[:-3].replace("/", ".")]


# Writers covered by their own table-driven suites (tests/test_writer_outputs.py,
# tests/test_spark_outputs.py), by entry point and flag.
OTHER_TABLES: list[tuple[str, str]] = [
    ("preproc", "output"), ("preproc", "work_dir"), ("dlrm.scripts.transcode", "output"),
    ("dlrm.scripts.transcode", "feature_spec_out"), ("dlrm.scripts.prepare_synthetic_dataset", "synthetic_dataset_dir"),
    ("dlrm.scripts.gen_csv", "output"), ("dlrm.scripts.recommender_generate", "output"),
    ("dlrm.scripts.recommender_generate", "features_index"), ("dlrm.scripts.recommender_predict", "output"),
    ("dlrm.scripts.recommender_predict", "scores_path"), ("dlrm.scripts.recommender_evaluate", "output"),
    ("dlrm.scripts.export", "output"), ("dlrm.scripts.deploy", "model_repository"), ("preproc.generate", "output"),
]


def _checksums(root: Path, skip: tuple[str, ...] = ()) -> dict[str, str]:
    found = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            full = os.path.join(directory, name)
            rel = os.path.relpath(full, root)
            if rel.split(os.sep)[0] in skip:
                continue
            if os.path.islink(full):
                found[rel] = "link:" + os.readlink(full)
            elif os.path.isfile(full):
                found[rel] = hashlib.sha256(open(full, "rb").read()).hexdigest()
            else:
                found[rel] = f"dir:{oct(os.stat(full).st_mode)}"
    return found


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """What the commands read: a split-binary dataset, a CSR dataset and a network file."""
    root = tmp_path_factory.mktemp("hostile_inputs")
    run_cli("dlrm.scripts.prepare_synthetic_dataset", "--synthetic_dataset_dir", str(root / "dataset"),
            "--synthetic_dataset_num_entries", "2048",
            "--synthetic_dataset_table_sizes", "50,60", "--num_test_entries", "512")
    run_cli("dlrm.scripts.recommender_generate", "--synthetic", "--users", "60", "--items", "80",
            "--interactions", "900", "--output", str(root / "csr"))
    (root / "network.json").write_text(json.dumps(NETWORK))
    (root / "log.json").write_text('{"type": "header", "time": 1.0, "program": "dlrm-engine", "version": "0"}\n'
                                   '{"type": "train", "time": 2.0, "step": 4, "loss": 0.6}\n')
    return {"root": root, "dataset": str(root / "dataset"), "csr": str(root / "csr" / "all"),
            "network": str(root / "network.json"), "log": str(root / "log.json")}


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=4k,ro tmpfs /mnt"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


def _name(writer: Writer) -> str:
    kind = "" if "spark_recommend" not in writer.module else ("-parquet" if writer.directory else "-text")
    if "convert_checkpoint" in writer.module:
        kind = "-" + writer.command({"dataset": ""}, "", "")[-1]
    return f"{os.path.basename(writer.module).removesuffix('.py').rsplit('.', 1)[-1]}--{writer.flag}{kind}"


@pytest.mark.parametrize("writer", WRITERS, ids=_name)
def test_a_hostile_destination_is_refused_in_one_line_and_nothing_changes(tmp_path, inputs, writer):
    home = tmp_path / "home"
    project = home / "project"  # the working directory: a user's project folder
    project.mkdir(parents=True)
    (project / "train.py").write_text("print('my code')\n")
    foreign = home / "thesis"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("years of work\n")
    (home / "notes.txt").write_text("a file of mine\n")
    os.symlink(foreign if writer.directory else home / "notes.txt", home / "link")
    shutil.copytree(inputs["root"], home / "inputs", symlinks=True)
    mine = {k: (v.replace(str(inputs["root"]), str(home / "inputs")) if isinstance(v, str) else v)
            for k, v in inputs.items()}
    read_only = tmp_path / "ro"
    read_only.mkdir()
    scratch = tmp_path / "scratch"
    destinations = {"foreign": foreign, "input": writer.own_input(mine), "dot": ".", "file": home / "notes.txt",
                    "symlink": home / "link", "readonly": read_only / "out"}
    unshare = _can_unshare()
    cases = [{"args": writer.command(mine, str(destinations[c]), str(scratch / c)), "cwd": str(project)}
             for c in CASES if c != "readonly" or unshare]
    cases.append({"args": writer.command(mine, str(home / "fresh"), str(scratch / "fresh")), "cwd": str(project)})
    before = _checksums(home)
    spec, results = tmp_path / "cases.json", tmp_path / "results.json"
    # The runner mounts a read-only tmpfs at ``read_only``, private to it and its cases.
    spec.write_text(json.dumps({"module": writer.module, "preload": writer.preload, "cases": cases,
                                "read_only_mount": str(read_only) if unshare else None}))
    runner = [sys.executable, os.path.join(REPO, "tests", "entry_point_runner.py"), str(spec), str(results)]
    env = {**os.environ, "PYTHONPATH": REPO, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = warm_python.run(runner, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    *refusals, control = json.loads(results.read_text())
    assert writer.control(control), f"the command itself fails:\n{control['stdout']}\n{control['stderr']}"
    assert _checksums(home, skip=("fresh",)) == before, "the user's tree changed"
    for case, result in zip(CASES, refusals):
        lines = result["stderr"].strip().splitlines()
        assert result["returncode"] == 2 and len(lines) == 1, (case, result)
        assert f"--{writer.flag}" in lines[0] or str(destinations[case]) in lines[0], (case, lines[0])
