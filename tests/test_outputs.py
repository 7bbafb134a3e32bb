"""The output rule (dlrm.engine.outputs) on its own: what is refused, what is free, what needs a flag.
Every refusal leaves the tree as it was (compared file by file with checksums)."""

import os

import pytest
from conftest import tree

from dlrm.engine.outputs import LOG, TENSORBOARD, OutputError, OutputKind, claim_output, holds_only, inside

CKPT = OutputKind("checkpoint", True, lambda p: holds_only(p, ["meta.json", "*.pt"], required=["meta.json"]))




@pytest.fixture
def home(tmp_path, monkeypatch):
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "meta.json").write_text("{}")
    (tmp_path / "ckpt" / "dense.pt").write_bytes(b"t")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.bin").write_bytes(b"1")
    (tmp_path / "afile").write_text("f")
    os.symlink(tmp_path / "mine", tmp_path / "link")
    return tmp_path


def refused(home, path, kind=CKPT, **kw):
    before = tree(home)
    with pytest.raises(OutputError) as e:
        claim_output(path, kind, "save_checkpoint_path", **kw)
    assert tree(home) == before
    message = str(e.value)
    assert "\n" not in message and "save_checkpoint_path" in message and "nothing was changed" in message
    return message


def test_free_destinations(home):
    assert claim_output(home / "new" / "deeper", CKPT, "x") == str(home / "new" / "deeper")
    (home / "empty").mkdir()
    claim_output(home / "empty", CKPT, "x")


def test_foreign_folder_is_refused_even_with_overwrite(home):
    assert "notes.txt" in refused(home, home / "mine", replace=True, keep=True)


def test_own_output_needs_a_flag(home):
    message = refused(home, home / "ckpt", keep_setting="resume")
    assert "`resume`" in message and "`overwrite`" in message
    claim_output(home / "ckpt", CKPT, "x", replace=True)
    claim_output(home / "ckpt", CKPT, "x", keep=True)


def test_links_files_working_directory_and_inputs(home):
    assert "symbolic link" in refused(home, home / "link")
    assert "is a file" in refused(home, home / "afile")
    assert "working directory" in refused(home, ".")
    assert "working directory" in refused(home, home)
    assert "is the input" in refused(home, home / "data", inputs={"dataset": str(home / "data")})
    assert "inside the input" in refused(home, home / "data" / "ck", inputs={"dataset": str(home / "data")})
    assert "contains the input" in refused(home, home, inputs={"dataset": str(home / "data" / "train.bin")})
    assert "is a file" in refused(home, home / "afile" / "below")


def test_siblings_follow_the_rule(home):
    (home / "ckpt.old").mkdir()
    (home / "ckpt.old" / "thesis.tex").write_text("x")
    assert "ckpt.old" in refused(home, home / "ckpt", replace=True, siblings={".old": CKPT})


def test_files_logs_and_tensorboard(home):
    log = home / "log.json"
    log.write_text('{"type": "header", "time": 1.5, "program": "dlrm-engine"}\n{"type": "flags", "time": 1.5}\n')
    claim_output(log, LOG, "log_path", keep=True)
    (home / "old.json").write_text('{"type": "flags", "time": 1.5, "batch_size": 8}\n')  # before the header
    claim_output(home / "old.json", LOG, "log_path", keep=True)
    for name, text in (("notes.json", '["not a log"]\n'), ("events.json", '{"type": "click", "time": 1.5}\n')):
        (home / name).write_text(text)
        with pytest.raises(OutputError, match="not a run log"):
            claim_output(home / name, LOG, "log_path", keep=True)
    with pytest.raises(OutputError, match="folder"):
        claim_output(home / "mine", LOG, "log_path", keep=True)
    (home / "tb").mkdir()
    (home / "tb" / "events.out.tfevents.1.host").write_bytes(b"e")
    claim_output(home / "tb", TENSORBOARD, "tensorboard_dir", keep=True)
    with pytest.raises(OutputError, match="not a TensorBoard folder"):
        claim_output(home / "mine", TENSORBOARD, "tensorboard_dir", keep=True)


def test_spec_paths_stay_inside(home):
    assert inside(home / "out", "a/b.csv", "file") == str(home / "out" / "a" / "b.csv")
    for bad in ["/etc/passwd", "../escape.csv", "a/../../escape.csv"]:
        with pytest.raises(OutputError, match="outside the output folder"):
            inside(home / "out", bad, "file")
    os.symlink(home / "mine", home / "work" / "sneaky")
    with pytest.raises(OutputError):
        inside(home / "work", "sneaky/x.csv", "file")
