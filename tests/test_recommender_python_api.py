"""The recommender's Python API in memory (dlrm/recommender/handle.py, train_job.TrainResult):
docs/recommender.md's "Python API" blocks run as written, and ``load(ck).recommend(histories, k)``
gives the lists and scores that ``python -m dlrm.scripts.recommender_predict`` writes for the same
users, for the linear default and for the autoencoder."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, run_cli
import warm_python

from dlrm.recommender import api

K = 10


def _python_api_blocks() -> list[str]:
    """The ```python blocks of docs/recommender.md's "Python API" section, in order."""
    text = open(os.path.join(REPO, "docs", "recommender.md"), encoding="utf-8").read()
    section = text.split("### Python API", 1)[1].split("\n### ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A tiny dataset, and the checkpoints the documented blocks train on it (ckpt/rec, ckpt/ae)."""
    root = tmp_path_factory.mktemp("python_api")
    run_cli("dlrm.scripts.recommender_generate", "--synthetic", "--users", "300", "--items", "60", "--interactions",
            "9000", "--output", str(root / "data"), "--heldout_fraction", "0.2")
    (root / "configs").symlink_to(os.path.join(REPO, "configs"))
    blocks = _python_api_blocks()
    assert len(blocks) == 2, "the section's code blocks changed: update this test"
    # run_cli's environment (no kernel interpreter), so the same warm interpreter serves both
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "PYTHONPATH": REPO,
           "PYTHONUNBUFFERED": "1"}
    proc = warm_python.run([sys.executable, "-c", "\n".join(blocks)], cwd=root, capture_output=True, text=True,
                           timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    root.joinpath("blocks.out").write_text(proc.stdout)
    return root


def _predict_file(work, ckpt: str, name: str, *flags: str) -> tuple[list[list[int]], list[list[float]], np.ndarray]:
    """recommender_predict's lists and scores per user (numbers for names, 9 digits per score) and
    its raw scores (--scores_path)."""
    out, raw = work / f"{name}.txt", work / f"{name}.npy"
    run_cli("dlrm.scripts.recommender_predict", "--load_checkpoint_path", str(work / ckpt), "--input",
            str(work / "data" / "input"), "--output", str(out), "--k", str(K), "--features_index=",
            "--samples_index=", "--score_format", "%.9g", "--scores_path", str(raw), *flags)
    ids, scores = [], []
    for user, line in enumerate(out.read_text().splitlines()):
        name_of_user, _, entries = line.partition("\t")
        assert name_of_user == str(user)
        pairs = [entry.split(",") for entry in entries.split(":") if entry]
        ids.append([int(item) for item, _ in pairs])
        scores.append([float(score) for _, score in pairs])
    return ids, scores, np.load(raw)


def _assert_same(ids: np.ndarray, scores: np.ndarray, expected_ids, expected_scores, raw: np.ndarray) -> None:
    assert ids.shape == scores.shape == (len(expected_ids), K)
    assert ids.dtype == np.int64 and scores.dtype == np.float32
    for user, (want_ids, want_scores) in enumerate(zip(expected_ids, expected_scores)):
        kept = ids[user] >= 0
        assert ids[user][kept].tolist() == want_ids, user  # the same items in the same order
        assert (ids[user][~kept] == -1).all() and np.isneginf(scores[user][~kept]).all()
        np.testing.assert_allclose(scores[user][kept], want_scores, rtol=0, atol=1e-6)
        np.testing.assert_allclose(scores[user][kept], raw[user, ids[user][kept]], rtol=0, atol=1e-6)


@pytest.mark.parametrize("ckpt, kind", [("ckpt/rec", "linear"), ("ckpt/ae", "autoencoder")])
def test_load_and_recommend_in_memory_match_the_predict_command(work, ckpt, kind):
    rec = api.load(str(work / ckpt))
    assert rec.kind == kind and rec.n_items == 60
    assert rec.path.endswith(".best") == (kind == "autoencoder")  # the best validation, as predict takes it
    histories, values = api.histories_of(str(work / "data" / "input"))
    assert len(histories) == 300 and values is None
    ids, scores = rec.recommend(histories, K)
    _assert_same(ids, scores, *_predict_file(work, ckpt, kind))
    for user, history in enumerate(histories):
        assert not set(ids[user].tolist()) & set(history.tolist())  # nothing seen is recommended


def test_exclusion_settings_match_the_predict_commands_filter_and_noexclude_inputs(work):
    """exclude_seen=False and ``exclude`` are --noexclude_inputs and --filter."""
    rec = api.load(str(work / "ckpt/rec"))
    histories, _ = api.histories_of(str(work / "data" / "input"))
    heldout, _ = api.histories_of(str(work / "data" / "heldout"))
    ids, scores = rec.recommend(histories, K, exclude_seen=False, exclude=heldout, batch_size=7)
    _assert_same(ids, scores, *_predict_file(work, "ckpt/rec", "filtered", "--noexclude_inputs",
                                             "--filter", str(work / "data" / "heldout")))
    assert any(set(ids[u].tolist()) & set(histories[u].tolist()) for u in range(len(histories)))
    assert all(not set(ids[u].tolist()) & set(heldout[u].tolist()) for u in range(len(histories)))


def test_the_documented_blocks_print_what_they_say(work):
    out = (work / "blocks.out").read_text()
    assert "(2, 10) int64 float32" in out, out
    assert re.search(r"^completed: lambda \S+, checkpoint ckpt/rec$", out, re.M), out


def test_train_returns_a_result_that_reads_as_its_summary_and_loads_its_model(work):
    """A run of the linear model again (``overwrite``): its summary, path, and model in memory."""
    data, ckpt = str(work / "data" / "input"), str(work / "again")
    result = api.train(api.RecommenderConfig(data=api.DataConfig(input=data),
                                             checkpoint=api.CheckpointConfig(save_checkpoint_path=ckpt)))
    assert isinstance(result, api.TrainResult) and result.checkpoint_path == ckpt
    assert result["stop_reason"] == result.summary["stop_reason"] == "completed"
    assert dict(result) == result.summary and "regularization" in result and result.get("signal") is None
    histories, _ = api.histories_of(data)
    ids, scores = result.load().recommend(histories[:20], K)
    same_ids, same_scores = api.load(str(work / "ckpt/rec")).recommend(histories[:20], K)  # the same data and seed
    assert (ids == same_ids).all() and np.array_equal(scores, same_scores)


def test_recommend_refuses_bad_histories_naming_the_setting(work):
    rec = api.load(str(work / "ckpt/rec"))
    for histories, k, says in [([[0, 60]], K, "`histories` row 0 holds item 60, outside the model's 60 items"),
                               ([[1], [-1]], K, "`histories` row 1 holds item -1"),
                               ([["a"]], K, "`histories` row 0 must be a list of integer item ids"),
                               ([[1.5]], K, "`histories` row 0 must be a list of integer item ids"),
                               ([[1]], 0, "`k` must be an integer >= 1")]:
        with pytest.raises(ValueError) as refused:
            rec.recommend(histories, k)
        assert says in str(refused.value), str(refused.value)
    with pytest.raises(ValueError, match="`exclude` has 2 rows for 1 `histories`"):
        rec.recommend([[1]], K, exclude=[[2], [3]])
    ids, scores = rec.recommend([[]], 70)  # more than the catalogue: the rest is -1 and -inf
    assert (ids[0, :60] >= 0).all() and (ids[0, 60:] == -1).all() and np.isneginf(scores[0, 60:]).all()
    assert sorted(ids[0, :60].tolist()) == list(range(60))


def test_import_of_the_package_stays_light_and_offers_load():
    code = ("import sys, dlrm.recommender as r\n"
            "light = 'torch' not in sys.modules\n"
            "from dlrm.recommender import api, load\n"
            "print(light, load is api.load is r.load)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert out.stdout.split() == ["True", "True"], out.stdout + out.stderr
