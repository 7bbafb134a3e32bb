"""The checkpoint store on a real file system, against plain references: rows read back from
pieces written at any split equal slices of the original tensor (torch.cat of the pieces), a
flipped byte is caught by the checksum that zlib computes independently, and a save that dies
(kill -9) or fails before its commit leaves the previous checkpoint as it was."""

import json
import os
import signal
import subprocess
import sys
import zlib

import numpy as np
import pytest
import torch

from conftest import REPO
from dlrm.engine import checkpoint_store as store
from dlrm.engine.collectives import Collectives
from test_checkpoint import _Exploit, _flip_byte
import warm_python

FORMAT = store.Format("test checkpoint", ("version", 3), {"step": int}, marks={"kind": "test"},
                      foreign="written by another program")
ROWS = 23


def _tree(seed: int = 0) -> dict:
    """A tensor of ROWS rows and its per-row and scalar companions, as optimizer state is kept."""
    g = torch.Generator().manual_seed(seed)
    return {"weight": torch.randn(ROWS, 3, generator=g, dtype=torch.float64),
            "state": {"sum": torch.rand(ROWS, generator=g), "step": torch.tensor(7.0)}}


def _cuts(parts: int) -> list[int]:
    """Uneven cuts of [0, ROWS) into ``parts`` pieces."""
    return [0] + sorted(np.random.default_rng(parts).choice(np.arange(1, ROWS), parts - 1, replace=False).tolist()) \
        + [ROWS]


def _piece(tree, start: int, stop: int):
    return {k: _piece(v, start, stop) for k, v in tree.items()} if isinstance(tree, dict) else \
        (tree[start:stop].clone() if tree.dim() else tree)


def _save(path: str, parts: list[tuple[str, object]], step: int = 1, fail_after: int | None = None) -> None:
    """One checkpoint of FORMAT holding ``parts`` (file name, object); with ``fail_after``, the
    save raises after writing that many files."""

    def write(files: store.StagedFiles) -> None:
        for n, (name, obj) in enumerate(parts):
            if n == fail_after:
                raise RuntimeError("the run failed while saving")
            files.save(name, obj)

    store.save_directory(path, Collectives(), 1, write, lambda files: {"kind": "test", "version": 3, "step": step})


@pytest.mark.parametrize("writers", [1, 2, 3, 4])
def test_rows_read_from_pieces_written_at_any_split_equal_the_original(tmp_path, writers):
    original = _tree()
    cuts = _cuts(writers)
    pieces = [(store.piece_name("layer", (a, b)), _piece(original, a, b)) for a, b in zip(cuts, cuts[1:])]
    path = str(tmp_path / "ck")
    _save(path, pieces)
    meta = FORMAT.read_meta(path)
    # Reference: the files read back with plain torch.load and joined with torch.cat.
    joined = torch.cat([torch.load(os.path.join(path, name), weights_only=True)["weight"] for name, _ in pieces])
    assert torch.equal(joined, original["weight"])
    for readers in (1, 2, 3, 4):
        bounds = np.cumsum([0] + [len(part) for part in np.array_split(np.arange(ROWS), readers)])
        for start, stop in zip(bounds, bounds[1:]):
            rows = (int(start), int(stop))
            got = store.read_rows(path, store.pieces_for(path, meta, "layer", ROWS, rows, "the layer"), rows)
            assert torch.equal(got["weight"], joined[start:stop])
            assert torch.equal(got["state"]["sum"], original["state"]["sum"][start:stop])
            assert torch.equal(got["state"]["step"], torch.tensor(7.0))
    every_range = [(a, b) for a in range(ROWS) for b in range(a + 1, ROWS + 1)]
    for a, b in every_range:
        got = store.read_rows(path, store.pieces_for(path, meta, "layer", ROWS, (a, b), "the layer"), (a, b))
        assert torch.equal(got["weight"], original["weight"][a:b])


def test_a_whole_file_and_blocks_of_other_names_are_told_apart(tmp_path):
    weight = torch.arange(20.0).view(10, 2)
    path = str(tmp_path / "ck")
    _save(path, [("table_1.pt", weight), ("table_1_optimizer.pt", weight * 2), ("table_11_rows_0_4.pt", weight[:4]),
                 ("table_11_rows_4_10.pt", weight[4:])])
    meta = FORMAT.read_meta(path)
    assert store.find_pieces(meta["files"], "table_1", 10) == [(0, 10, "table_1.pt")]
    assert store.find_pieces(meta["files"], "table_1", 10, "_optimizer") == [(0, 10, "table_1_optimizer.pt")]
    assert [name for *_, name in store.find_pieces(meta["files"], "table_11", 10)] == [
        "table_11_rows_0_4.pt", "table_11_rows_4_10.pt"]
    pieces = store.pieces_for(path, meta, "table_1", 10, (3, 8), "table 1", "_optimizer")
    assert torch.equal(store.read_rows(path, pieces, (3, 8)), weight[3:8] * 2)


@pytest.mark.parametrize("ranges", [
    [(0, 4), (5, 10)],  # a gap
    [(0, 6), (4, 10)],  # an overlap
    [(0, 4)],  # short
    [],
])
def test_pieces_that_do_not_tile_the_rows_are_refused(tmp_path, ranges):
    names = [f"t_rows_{a}_{b}.pt" for a, b in ranges]
    path = str(tmp_path / "ck")
    _save(path, [(name, torch.zeros(b - a, 2)) for name, (a, b) in zip(names, ranges)])
    with pytest.raises(store.CheckpointError) as info:
        store.pieces_for(path, FORMAT.read_meta(path), "t", 10, (0, 10), "the t")
    assert str(info.value) == (f"{path}/meta.json: the files of the t ({names or 'none'}) do not cover its 10 rows: "
                               "the checkpoint is damaged")


def test_a_piece_whose_rows_differ_from_its_name_is_refused(tmp_path):
    path = str(tmp_path / "ck")
    _save(path, [("t_rows_0_4.pt", torch.zeros(3, 2)), ("t_rows_4_6.pt", torch.zeros(2, 2))])
    pieces = store.pieces_for(path, FORMAT.read_meta(path), "t", 6, (0, 6), "the t")
    with pytest.raises(store.CheckpointError, match=r"t_rows_0_4.pt: the tensor has shape \[3, 2\], expected 4 rows"):
        store.read_rows(path, pieces, (0, 6))


def test_a_flipped_byte_is_caught_by_the_checksum(tmp_path):
    path = str(tmp_path / "ck")
    weight = torch.randn(50, 4, generator=torch.Generator().manual_seed(1))
    _save(path, [("a.pt", weight), ("b.pt", weight + 1)])
    meta = FORMAT.read_meta(path)
    for name in ("a.pt", "b.pt"):  # the listed checksum is the file's CRC-32 as zlib computes it
        data = open(os.path.join(path, name), "rb").read()
        assert meta["files"][name] == {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    store.check_files(path, meta, ["a.pt", "b.pt"])
    file = os.path.join(path, "b.pt")
    _flip_byte(file, open(file, "rb").read().index((weight + 1).numpy().tobytes()) + 9)
    with pytest.raises(store.CheckpointError, match=r"b.pt: checksum [0-9a-f]{8} differs from the [0-9a-f]{8}"):
        store.check_files(path, FORMAT.read_meta(path), ["a.pt", "b.pt"])
    store.check_files(path, meta, ["a.pt"])  # only the files asked for are hashed
    damaged = store.load_tensor_file(path, "b.pt")  # unverified, the bytes load as they are
    assert not torch.equal(damaged, weight + 1)
    with pytest.raises(store.CheckpointError, match=r"meta.json: lists no c.pt"):
        store.check_files(path, meta, ["c.pt"])


def test_a_pickle_of_anything_but_tensors_is_never_loaded(tmp_path):
    path = str(tmp_path / "ck")
    os.makedirs(path)
    torch.save({"x": _Exploit()}, os.path.join(path, "a.pt"))
    with pytest.raises(store.CheckpointError, match="a.pt: holds objects other than tensors"):
        store.load_tensor_file(path, "a.pt")


_KILLED_SAVE = """
import os, sys, time, torch
from dlrm.engine import checkpoint_store as store
from dlrm.engine.collectives import Collectives

def write(files):
    files.save("a.pt", torch.ones(1000, 8))
    print("written", flush=True)
    time.sleep(60)  # killed here, before the commit

store.save_directory(sys.argv[1], Collectives(), 1, write, lambda files: {"kind": "test", "version": 3, "step": 2})
"""


def test_a_save_killed_before_its_commit_leaves_the_previous_checkpoint(tmp_path):
    path = str(tmp_path / "ck")
    _save(path, [("a.pt", torch.zeros(1000, 8))], step=1)
    before = {name: open(os.path.join(path, name), "rb").read() for name in os.listdir(path)}
    proc = warm_python.Popen([sys.executable, "-c", _KILLED_SAVE, path], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "written"
        assert os.path.isfile(os.path.join(f"{path}.tmp", "a.pt"))
    finally:
        proc.send_signal(signal.SIGKILL)  # no cleanup runs
        proc.wait()
    assert store.latest_checkpoint(path) == path
    assert {name: open(os.path.join(path, name), "rb").read() for name in os.listdir(path)} == before
    meta = FORMAT.read_meta(path)
    assert meta["step"] == 1
    store.check_files(path, meta, ["a.pt"])
    _save(path, [("a.pt", torch.full((1000, 8), 2.0))], step=2)  # the next save clears the dead one's staging
    assert FORMAT.read_meta(path)["step"] == 2 and sorted(os.listdir(tmp_path)) == ["ck"]
    assert torch.equal(store.load_tensor_file(path, "a.pt"), torch.full((1000, 8), 2.0))


def test_a_save_that_fails_leaves_the_previous_checkpoint_and_no_staging(tmp_path):
    path = str(tmp_path / "ck")
    _save(path, [("a.pt", torch.zeros(3))], step=1)
    with pytest.raises(RuntimeError, match="failed while saving"):
        _save(path, [("a.pt", torch.ones(3)), ("b.pt", torch.ones(3))], step=2, fail_after=1)
    assert sorted(os.listdir(tmp_path)) == ["ck"] and FORMAT.read_meta(path)["step"] == 1
    assert torch.equal(store.load_tensor_file(path, "a.pt"), torch.zeros(3))


def test_a_save_cut_off_between_its_renames_is_found_at_old(tmp_path):
    path = str(tmp_path / "ck")
    assert store.latest_checkpoint(path) is None
    _save(path, [], step=1)
    os.rename(path, f"{path}.old")  # the first of commit_directory's two renames, and no second
    assert store.latest_checkpoint(path) == f"{path}.old"
    with pytest.raises(store.CheckpointError, match=r"No test checkpoint at .*ck\. A complete earlier .*ck\.old"):
        FORMAT.read_meta(path)
    _save(path, [], step=2)
    assert store.latest_checkpoint(path) == path and not os.path.exists(f"{path}.old")


def _edit_meta(path: str, **entries) -> None:
    meta_path = os.path.join(path, "meta.json")
    meta = json.load(open(meta_path))
    meta.update(entries)
    json.dump(meta, open(meta_path, "w"))


@pytest.mark.parametrize("entries,needle", [
    (dict(kind="dlrm"), "not a test checkpoint \\(written by another program\\)"),
    (dict(version=2), "checkpoint format 2, this version reads 3"),
    (dict(step="1"), "entry 'step' is missing or not a int"),
    (dict(files=[]), "entry 'files' is missing or not a dict"),
    (dict(files={"a.pt": {"bytes": 5, "crc32": "00000000"}}), "a.pt: expected 5 bytes, found None"),
])
def test_meta_of_another_format_or_damaged_is_refused(tmp_path, entries, needle):
    path = str(tmp_path / "ck")
    _save(path, [])
    _edit_meta(path, **entries)
    with pytest.raises(store.CheckpointError, match=needle):
        FORMAT.read_meta(path)


def test_space_check_counts_the_checkpoint_already_there(tmp_path):
    path = str(tmp_path / "ck")
    assert store.bytes_needed(path, 10) == 10
    _save(path, [("a.pt", torch.zeros(5000))])
    on_disk = sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))
    assert store.bytes_needed(path, 10) == on_disk > 20_000
    assert store.bytes_needed(path, 10 ** 9) == 10 ** 9
    store.check_can_save(path, 10)
    with pytest.raises(OSError, match="no space left on device"):
        store.check_can_save(path, 1 << 62)
    open(tmp_path / "file", "w").close()
    with pytest.raises(store.CheckpointError, match="exists and is not a directory"):
        store.check_can_save(str(tmp_path / "file"), 10)


def _failing_read(calls: list):
    def read():
        calls.append(1)
        raise store.CheckpointError("no checkpoint here")
    return read


def test_a_save_cut_off_is_refused_at_once_and_only_a_live_save_is_waited_for(tmp_path):
    """A load of a checkpoint that is missing retries only while a save may be under way: a
    staging directory of a run that holds the lock (or of a writer without one). What a dead run
    left (a moved-aside ``.old``, a staging directory beside a lock nobody holds) fails on the
    first read instead of waiting out the timeout."""
    path = str(tmp_path / "c")
    os.makedirs(path + ".old")
    calls: list = []
    with pytest.raises(store.CheckpointError):
        store.read_consistently(path, _failing_read(calls), timeout=60)
    assert len(calls) == 1  # .old alone: cut off between the renames, nothing to wait for
    os.makedirs(path + ".tmp")
    calls = []
    with pytest.raises(store.CheckpointError):
        store.read_consistently(path, _failing_read(calls), timeout=0.3)
    assert len(calls) > 1  # staging without a lock file: a writer may be at work, so it waits
    with store.CheckpointLock(path):
        calls = []
        with pytest.raises(store.CheckpointError):
            store.read_consistently(path, _failing_read(calls), timeout=0.3)
        assert len(calls) > 1  # a live run holds the lock: its save is waited for
    open(path + ".lock", "w").close()  # what a run killed with -9 leaves: the file, no lock
    calls = []
    with pytest.raises(store.CheckpointError):
        store.read_consistently(path, _failing_read(calls), timeout=60)
    assert len(calls) == 1
