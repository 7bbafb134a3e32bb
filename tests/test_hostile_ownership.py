"""This program's own output is recognised by exact names, never by a loose pattern: a file or
folder of the user's inside a checkpoint (notes in a subfolder, a ``report.tmp``, a
``backup/table_0.pt``, an empty folder) makes the folder not ours, so ``--resume`` and
``--overwrite`` refuse it in one line, exit 2, with the whole tree as it was (R1). A log is
recognised by the mark of its first record, so a JSON-lines file of anyone else's (a GeoJSON
sequence, an event log) is never appended to (R10). Last, a table of every output kind: its own
output is recognised, and the same output with one foreign entry added is not.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Callable

import pytest
from conftest import REPO, run_cli, tree, run_entry_points
from test_hostile_outputs import NETWORK

from dlrm.engine.outputs import LOG, OutputError, claim_output

DLRM_SMALL = ["--embedding_dim", "4", "--bottom_mlp_sizes", "8,4",
              "--top_mlp_sizes", "8,1", "--batch_size", "256", "--test_batch_size", "256", "--base_device", "cpu",
              "--print_freq", "1"]


def _add_user_dir_tmp(d: Path) -> None:
    (d / "my_notes").mkdir()
    (d / "my_notes" / "analysis.tmp").write_text("work\n")


def _add_report_tmp(d: Path) -> None:
    (d / "report.tmp").write_text("my report\n")


def _add_backup(d: Path) -> None:
    (d / "backup").mkdir()
    shutil.copyfile(next(p for p in sorted(d.iterdir()) if p.suffix == ".pt"), d / "backup" / "table_0.pt")


def _add_empty_dir(d: Path) -> None:
    (d / "my_empty").mkdir()


def _add_user_pt(d: Path) -> None:
    """A tensor file of the user's beside the checkpoint's own: a name its save did not write."""
    shutil.copyfile(next(p for p in sorted(d.iterdir()) if p.suffix == ".pt"), d / "my_table.pt")


_TRAIN = ["torch", "dlrm.training.build", "dlrm.training.train", "dlrm.scripts.cli"]
_RECOMMENDER = ["torch", "dlrm.recommender.train", "dlrm.recommender.checkpoint", "dlrm.scripts.cli"]
FOREIGN: dict[str, Callable[[Path], None]] = {"user_dir_tmp": _add_user_dir_tmp, "report_tmp": _add_report_tmp,
                                              "backup_pt": _add_backup, "empty_dir": _add_empty_dir,
                                              "user_pt": _add_user_pt}


@pytest.fixture(scope="module")
def made(tmp_path_factory, synthetic_dataset) -> dict[str, Path]:
    """A split-binary dataset, a DLRM checkpoint and its log, a recommender dataset and its
    checkpoint, each written by this program's own writers."""
    root = tmp_path_factory.mktemp("ownership")
    shutil.copytree(synthetic_dataset(4, [50, 60], {"train": 512, "test": 256}, batch_size=256, seed=0),
                    root / "dataset")
    run_cli("dlrm.scripts.main", "--dataset", str(root / "dataset"), *DLRM_SMALL, "--max_steps", "2",
            "--save_checkpoint_path", str(root / "ck"), "--log_path", str(root / "log.json"))
    run_cli("dlrm.scripts.recommender_generate", "--synthetic", "--users", "40", "--items", "50",
            "--interactions", "500", "--output", str(root / "csr"))
    (root / "network.json").write_text(json.dumps(NETWORK))
    run_cli("dlrm.scripts.recommender_train", *_recommender_args(root, root / "rck", root / "rlog.json"))
    return {"root": root, "dataset": root / "dataset", "ck": root / "ck", "csr": root / "csr", "rck": root / "rck",
            "log": root / "log.json"}


def _recommender_args(root: Path, ck: Path, log: Path) -> list[str]:
    return ["--network", str(root / "network.json"), "--input", str(root / "csr" / "all"), "--epochs", "1",
            "--batch_size", "16", "--validation_users", "0", "--base_device", "cpu",
            "--save_checkpoint_path", str(ck), "--log_path", str(log)]


def _run_cases(module: str, preload: list[str], cases: list[list[str]], tmp_path: Path) -> list[dict]:
    """Runs each command line of ``module`` as ``python -m`` would, as forks of one process that
    imported ``preload`` (tests/entry_point_runner.py): their exit codes and output."""
    return run_entry_points(module, cases, tmp_path, preload=preload)


def _one_line_exit_2(result: dict, *needles: str) -> None:
    lines = result["stderr"].strip().splitlines()
    assert result["returncode"] == 2 and len(lines) == 1, (result["returncode"], result["stderr"][-2000:])
    assert all(n in lines[0] for n in needles), lines[0]


def _hostile_copies(source: Path, home: Path) -> dict[str, Path]:
    """A copy of checkpoint ``source`` per kind of user file (FOREIGN), with that file added."""
    copies = {}
    for name, add in FOREIGN.items():
        copies[name] = home / name
        shutil.copytree(source, copies[name])
        add(copies[name])
    return copies


GEOJSON = ('{"type": "Feature", "geometry": {"type": "Point", "coordinates": [2.35, 48.85]}, "properties": {}}\n'
           '{"type": "Feature", "geometry": {"type": "Point", "coordinates": [13.4, 52.5]}, "properties": {}}\n')
EVENTS = '{"type": "click", "time": 1700000000.5, "user": 3}\n{"type": "view", "time": 1700000001.0, "user": 4}\n'


def test_r1_r10_main_refuses_user_files_in_its_checkpoint_and_foreign_logs(made, tmp_path):
    """R1: ``--resume`` and ``--overwrite`` at a copy of the run's checkpoint with a user's file
    added; R10: ``--log_path`` at a GeoJSON sequence and at an event log. Each: exit 2, one line,
    the whole tree as it was."""
    home = tmp_path / "home"
    copies = _hostile_copies(made["ck"], home)
    logs = {"places.geojsonl": GEOJSON, "events.jsonl": EVENTS}
    for name, text in logs.items():
        (home / name).write_text(text)
    base = ["--dataset", str(made["dataset"]), *DLRM_SMALL, "--max_steps", "4"]
    cases = [[*base, "--save_checkpoint_path", str(ck), flag, "--log_path", str(tmp_path / "log.json")]
             for ck in copies.values() for flag in ("--resume", "--overwrite")]
    cases += [[*base, "--save_checkpoint_path", str(tmp_path / "fresh"), "--log_path", str(home / name)]
              for name in logs]
    before = tree(home)
    results = _run_cases("dlrm.scripts.main", _TRAIN, cases, tmp_path)
    assert tree(home) == before, "the user's tree changed"
    for result in results[:-len(logs)]:
        _one_line_exit_2(result, "save_checkpoint_path", "not a")
    for result in results[-len(logs):]:
        _one_line_exit_2(result, "log_path", "not a run log")


def test_r1_recommender_resume_refuses_user_files_in_its_checkpoint(made, tmp_path):
    home = tmp_path / "home"
    copies = _hostile_copies(made["rck"], home)
    cases = [[*_recommender_args(made["root"], ck, tmp_path / "log.json"), "--resume"] for ck in copies.values()]
    before = tree(home)
    results = _run_cases("dlrm.scripts.recommender_train", _RECOMMENDER, cases, tmp_path)
    assert tree(home) == before, "the user's tree changed"
    for result in results:
        _one_line_exit_2(result, "save_checkpoint_path", "not a")


def test_r10_logs_are_told_by_their_first_record(made, tmp_path):
    """In process, both forms: this run's log (its header), logs written before the mark (their
    first record as this program always wrote it), and files that only look like one."""
    from dlrm.engine.logger import DLLOGGER_LOG, RunLogger

    assert json.loads(made["log"].read_text().splitlines()[0])["program"] == "dlrm-engine"
    claim_output(made["log"], LOG, "log_path", keep=True)
    dl = tmp_path / "dl.log"
    with RunLogger(str(dl), stream=io.StringIO(), log_format="dllogger") as logger:
        logger.record("flags", batch_size=1)
    claim_output(dl, DLLOGGER_LOG, "log_path", keep=True)
    legacy = {"json.log": (LOG, '{"type": "flags", "time": 1700000000.25, "batch_size": 256}\n'),
              "failed.log": (LOG, '{"type": "summary", "time": 1700000000.25, "stop_reason": "error"}\n'),
              "client.log": (LOG, '{"type": "score", "split": "test", "batch_size": 64, "auc": 0.5}\n'),
              "dl_legacy.log": (DLLOGGER_LOG, 'DLLL {"timestamp": "1.0", "datetime": "2024-01-01 00:00:00", '
                                '"elapsedtime": "0.0", "type": "METADATA", "metric": "best_auc", '
                                '"metadata": {"unit": null}}\n')}
    for name, (kind, text) in legacy.items():
        (tmp_path / name).write_text(text)
        claim_output(tmp_path / name, kind, "log_path", keep=True)
    foreign = {"geo": (LOG, GEOJSON), "events": (LOG, EVENTS), "flags_only": (LOG, '{"type": "flags"}\n'),
               "dl_events": (DLLOGGER_LOG, "DLLL " + EVENTS.splitlines()[0] + "\n")}
    for name, (kind, text) in foreign.items():
        (tmp_path / name).write_text(text)
        before = tree(tmp_path)
        with pytest.raises(OutputError, match="not a run log") as e:
            claim_output(tmp_path / name, kind, "log_path", keep=True)
        assert "\n" not in str(e.value) and tree(tmp_path) == before


# ----------------------------------------------------------------------------- every output kind


def _nvidia(d: Path, made: dict) -> None:
    for name in ("metadata.pt", "bottom_model.mlp.pt", "top_model.mlp.pt", "top_model.out.pt",
                 "bottom_model.embeddings.0.bin", "embeddings.0.meta.pt"):
        (d / name).write_bytes(b"x")


def _files(*names: str, text: str = "x") -> Callable[[Path, dict], None]:
    def make(d: Path, made: dict) -> None:
        for name in names:
            (d / name).parent.mkdir(parents=True, exist_ok=True)
            (d / name).write_text(text)
    return make


def _copy(key: str, below: str = "") -> Callable[[Path, dict], None]:
    def make(d: Path, made: dict) -> None:
        shutil.rmtree(d)
        shutil.copytree(Path(made[key]) / below, d)
    return make


def _work_dir(d: Path, made: dict) -> None:
    _files("scan/f0.json", "scan/f0/run0.p0.npy", "vocab.json", "vocab/sizes.npy", "rows/f0/train.b3.rec",
           "spark/counts/g0/data/part-0.parquet")(d, made)
    (d / "manifest.json").write_text(json.dumps({"identity": {}, "settings": {}}))


def _triton_repo(d: Path, made: dict) -> None:
    _files("ctr/config.pbtxt", "ctr/1/model.onnx", "ctr/1/model.py")(d, made)


def _criteo_days(d: Path, made: dict) -> None:
    (d / "day_0").write_text("\t".join(["1"] * 40) + "\n")


def _kinds() -> dict[str, tuple[Callable[[], object], Callable]]:
    """Each output kind (its ``OutputKind`` or recognise function, imported late) and how to make
    an output of it that this program writes: a real one where a command made it (``made``)."""
    def kind(module: str, name: str) -> Callable[[], object]:
        return lambda: getattr(__import__(module, fromlist=[name]), name)

    return {
        "checkpoint": (lambda: __import__("dlrm.training.checkpoint", fromlist=["FORMAT"]).FORMAT.kind, _copy("ck")),
        "recommender checkpoint": (kind("dlrm.engine.checkpoint_store", "is_checkpoint_dir"), _copy("rck")),
        "staged checkpoint": (kind("dlrm.engine.checkpoint_store", "STAGING"), _copy("ck")),
        "nvidia checkpoint": (kind("dlrm.training.nvidia_checkpoint", "KIND"), _nvidia),
        "tensorboard": (kind("dlrm.engine.outputs", "TENSORBOARD"), _files("events.out.tfevents.1.host.2.0")),
        "split-binary dataset": (kind("dlrm.data.split_binary_writer", "SPLIT_BINARY_DATASET"), _copy("dataset")),
        "preproc dataset": (kind("preproc.cli", "DATASET"), _copy("dataset")),
        "preproc unfinished": (kind("preproc.cli", "DATASET"),
                               _files(".preproc_work/manifest.json", "train/label.bin", "vocabulary/sizes.npy")),
        "preproc work dir": (kind("preproc.cli", "WORK_DIR"), _work_dir),
        "CSR dataset": (kind("dlrm.recommender.csr_dataset", "CSR_DATASET"), _copy("csr", "all")),
        "recommender dataset": (kind("dlrm.scripts.recommender_generate", "GENERATED"), _copy("csr")),
        "export": (kind("dlrm.scripts.export", "EXPORT"), _files("model.onnx", "model.pt")),
        "triton model": (kind("dlrm.inference.triton_repository", "TRITON_MODEL"),
                         _files("config.pbtxt", "1/model.pt")),
        "triton repository": (kind("dlrm.inference.triton_repository", "TRITON_REPOSITORY"), _triton_repo),
        "spark parquet": (kind("dlrm.spark.job_io", "PARQUET_OUTPUT"),
                          _files("_SUCCESS", "part-00000-a.snappy.parquet", ".part-00000-a.snappy.parquet.crc")),
        "criteo days": (kind("preproc.generate", "CRITEO_DAYS"), _criteo_days),
        "triton server workdir": (kind("dlrm.inference.triton_server", "SERVER_WORKDIR"),
                                  _files("tritonserver.log")),
    }


KINDS = _kinds()
NO_TEMPORARIES = {"criteo days", "triton server workdir"}  # writers that write their files in place


def _recognise(kind: object) -> Callable[[str], bool]:
    return getattr(kind, "recognise", kind)  # an OutputKind, or a recognise function


def _subfolder(d: Path) -> Path | None:
    """The first folder of the writer's own inside ``d`` (to hide a foreign file in), if any."""
    for directory, dirs, _ in os.walk(d):
        if dirs:
            return Path(directory) / sorted(dirs)[0]
    return None


def _forget_command_flags() -> None:
    """In a fork: the flags that command-line modules defined in this worker before (another test
    file run here may have imported one) are removed, and the modules with them, so the kind's
    module defines its own flags on import as in a fresh process."""
    from absl import flags

    commands = ("dlrm.scripts", "preproc", "triton")
    names = {flag.name for module, defined in flags.FLAGS.flags_by_module_dict().items()
             if module.startswith(commands) for flag in defined}  # a copy: deleting edits those lists
    for name in names:
        if name in flags.FLAGS:
            delattr(flags.FLAGS, name)
    for module in [m for m in sys.modules if m.startswith(commands)]:
        del sys.modules[module]


def _in_fork(check: Callable[..., None], *args: object) -> None:
    """Runs ``check(*args)`` in a fork of this process and raises here what it raised there: the
    kinds of command-line modules define absl flags, which two such modules in one process clash on."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without pytest's teardown
        os.close(read)
        try:
            _forget_command_flags()
            check(*args)
            message = b""
        except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
            message = f"{type(e).__name__}: {e}".encode()[:8000] or b"error"
        os.write(write, message)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        message = f.read()
    os.waitpid(pid, 0)
    assert not message, message.decode(errors="replace")


@pytest.mark.parametrize("name", list(KINDS))
def test_every_kind_with_a_foreign_entry_inside_is_not_its_own(made, tmp_path, name):
    _in_fork(_check_kind, made, tmp_path, name)


def _check_kind(made: dict, tmp_path: Path, name: str) -> None:
    get_kind, make = KINDS[name]
    recognise = _recognise(get_kind())
    own = tmp_path / "own"
    own.mkdir()
    make(own, made)
    assert recognise(str(own)), f"{name}: its own output is not recognised"
    files = sorted(p.name for p in own.iterdir() if p.is_file())
    if files and name not in NO_TEMPORARIES:  # a writer's temporary of its file (dlrm.engine.atomic) is its own
        temporary = own / f".{files[0]}.{os.getpid()}@host.example.ab12_x.tmp"
        temporary.write_bytes(b"")
        assert recognise(str(own)), f"{name}: a temporary of the writer's own form is refused"
        temporary.unlink()
    inner = _subfolder(own)
    variants = {"top file": "report.tmp", "foreign folder": "my_notes/analysis.tmp", "empty folder": "my_empty/",
                "someone's temporary": ".notes.txt.1@h.ab12.tmp"}
    if inner is not None:
        variants["inside an own folder"] = f"{inner.relative_to(own)}/notes.txt"
        variants["empty folder inside an own folder"] = f"{inner.relative_to(own)}/my_empty/"
    for label, rel in variants.items():
        case = tmp_path / label.replace(" ", "_").replace("'", "")
        shutil.copytree(own, case)
        target = case / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.mkdir() if rel.endswith("/") else target.write_text("mine\n")
        assert not recognise(str(case)), f"{name}: taken for its own with {rel} inside ({label})"


def test_committed_checkpoint_fixtures_are_still_recognised():
    from dlrm.engine.checkpoint_store import is_checkpoint_dir
    from dlrm.recommender.checkpoint import META_FORMAT as RECOMMENDER
    from dlrm.training.checkpoint import FORMAT as DLRM

    fixtures = Path(REPO) / "tests" / "fixtures" / "checkpoints"
    found = [d for d in fixtures.iterdir() if d.is_dir()]
    assert found and all(is_checkpoint_dir(str(d)) for d in found)
    assert all(DLRM.recognise(str(d)) or RECOMMENDER.recognise(str(d)) for d in found)
