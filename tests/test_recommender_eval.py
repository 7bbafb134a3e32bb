"""Top-K selection, ranking metrics and baselines of the recommender, each against a plain,
independent reference (Python loops, dense numpy)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dlrm.recommender.csr_dataset import CsrRows, holdout_mask
from dlrm.recommender.user_histories import HistoryConfig, generate_user_histories
from dlrm.recommender import baselines as baselines_module
from dlrm.recommender import topk as topk_module
from dlrm.recommender.baselines import EASE, ImplicitMF, ItemKNN, Popularity, ease_memory_bytes, fit_baseline
from dlrm.recommender.metrics import MetricsAccumulator, RankingMetrics, ranking_metrics
from dlrm.recommender.topk import exclude_, format_recommendations, merge_top_k, top_k

NEG = float("-inf")


def random_histories(rng: np.random.Generator, batch: int, n_items: int, max_len: int,
                     full_rows: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    rows = []
    for b in range(batch):
        if b in full_rows:
            rows.append(list(rng.permutation(n_items)))
        else:
            rows.append(list(rng.choice(n_items, int(rng.integers(0, max_len + 1)), replace=False)))
    offsets = torch.tensor(np.concatenate([[0], np.cumsum([len(r) for r in rows])]), dtype=torch.int64)
    indices = torch.tensor([i for r in rows for i in r], dtype=torch.int64)
    return offsets, indices, rows


def reference_top_k(scores: torch.Tensor, history: list[list[int]], k: int, item_start: int):
    """Sorted by (-score, id), seen items removed, padded with (-inf, -1) to min(k, n_local)."""
    n_local = scores.shape[1]
    width = min(k, n_local)
    values, ids = [], []
    for b, row in enumerate(scores.tolist()):
        seen = set(history[b])
        kept = sorted(((-s, item_start + j) for j, s in enumerate(row) if item_start + j not in seen))[:width]
        kept += [(math.inf, -1)] * (width - len(kept))
        values.append([-s for s, _ in kept])
        ids.append([i for _, i in kept])
    return torch.tensor(values, dtype=scores.dtype).view(-1, width), torch.tensor(ids, dtype=torch.int64).view(-1, width)


# ---------------------------------------------------------------------------- top-k


@pytest.mark.parametrize("chunk", [None, 40])  # 40 elements: top_k's row chunking at work
def test_exclude_top_k_against_reference(monkeypatch, chunk):
    if chunk is not None:
        monkeypatch.setattr(topk_module, "_CHUNK_ELEMENTS", chunk)
    rng = np.random.default_rng(0)
    for trial in range(12):
        batch, n_local = int(rng.integers(1, 9)), int(rng.integers(1, 30))
        item_start = int(rng.integers(0, 20)) if trial % 2 else 0
        n_items = item_start + n_local + int(rng.integers(0, 10))  # ids beyond the slice: ignored
        offsets, indices, history = random_histories(rng, batch, n_items, max_len=n_items // 2,
                                                      full_rows=(0,) if trial % 3 == 0 else ())
        # Few distinct values: ties everywhere, also straddling the k-th place.
        scores = torch.tensor(rng.integers(0, 4, (batch, n_local)), dtype=torch.float32)
        if trial % 4 == 1:
            scores = torch.tensor(rng.standard_normal((batch, n_local)), dtype=torch.float32)
        if trial % 4 == 3:  # rows with and without ties at the k-th place in one batch
            scores[::2] = torch.tensor(rng.standard_normal((len(scores[::2]), n_local)), dtype=torch.float32)
        for k in (1, 3, n_local, n_local + 5):
            excluded = exclude_(scores.clone(), offsets, indices, item_start)
            values, ids = top_k(excluded, k, item_start)
            want_values, want_ids = reference_top_k(scores, history, k, item_start)
            assert torch.equal(ids, want_ids), (trial, k)
            assert torch.equal(values, want_values), (trial, k)


def test_exclude_sets_exactly_the_seen_local_items():
    scores = torch.zeros(2, 4)
    out = exclude_(scores, torch.tensor([0, 3, 4]), torch.tensor([10, 12, 99, 13]), item_start=10)
    assert out is scores
    assert scores.tolist() == [[NEG, 0.0, NEG, 0.0], [0.0, 0.0, 0.0, NEG]]


def test_top_k_all_seen_and_edge_cases():
    scores = exclude_(torch.ones(2, 3), torch.tensor([0, 3, 4]), torch.tensor([0, 1, 2, 1]))
    values, ids = top_k(scores, 5, item_start=7)
    assert ids.tolist() == [[-1, -1, -1], [7, 9, -1]]
    assert values.tolist() == [[NEG] * 3, [1.0, 1.0, NEG]]
    values, ids = top_k(torch.ones(2, 3), 0)
    assert values.shape == ids.shape == (2, 0)
    with pytest.raises(ValueError, match="`k`"):
        top_k(torch.ones(2, 3), -1)
    with pytest.raises(ValueError, match="`scores` contain NaN"):
        top_k(torch.tensor([[1.0, float("nan")]]), 1)
    with pytest.raises(ValueError, match="`offsets`"):
        exclude_(torch.ones(2, 3), torch.tensor([0, 1]), torch.tensor([0]))


def test_merge_top_k_of_splits_equals_full_top_k():
    rng = np.random.default_rng(1)
    for trial in range(10):
        batch, n = int(rng.integers(1, 8)), int(rng.integers(5, 60))
        offsets, indices, _ = random_histories(rng, batch, n, max_len=n // 2, full_rows=(0,) if trial == 0 else ())
        scores = torch.tensor(rng.integers(0, 5, (batch, n)), dtype=torch.float32)
        for k in (1, 4, 10, n + 3):
            want = top_k(exclude_(scores.clone(), offsets, indices), k)
            for shards in (2, 3, 5):
                cuts = np.sort(rng.integers(0, n + 1, shards - 1))  # uneven, possibly empty shards
                bounds = [0, *cuts.tolist(), n]
                parts = [top_k(exclude_(scores[:, lo:hi].clone(), offsets, indices, lo), k, lo)
                         for lo, hi in zip(bounds[:-1], bounds[1:])]
                values, ids = merge_top_k([v for v, _ in parts], [i for _, i in parts], k)
                assert torch.equal(ids, want[1]), (trial, k, bounds)
                assert torch.equal(values, want[0]), (trial, k, bounds)


def test_recommendations_never_include_history():
    rng = np.random.default_rng(2)
    offsets, indices, history = random_histories(rng, 64, 200, max_len=150)
    scores = torch.tensor(rng.standard_normal((64, 200)), dtype=torch.float32)
    _, ids = top_k(exclude_(scores, offsets, indices), 60)
    for b, row in enumerate(ids.tolist()):
        real = [i for i in row if i >= 0]
        assert not set(real) & set(history[b])
        assert len(real) == min(60, 200 - len(history[b]))
        assert len(set(real)) == len(real)


def test_format_recommendations():
    values = torch.tensor([[0.5, 0.25], [1.0, NEG]])
    items = torch.tensor([[2, 0], [1, -1]])
    names = ["a", "b", "c"]
    assert format_recommendations(["u1", "u2"], values, items, names) == ["u1\tc,0.5:a,0.25\n", "u2\tb,1\n"]
    for dsstne in ("%4.3f", "4.3f"):  # DSSTNE's predict -p takes the format without its %
        assert format_recommendations(["u1", "u2"], values, items, names, dsstne) == \
            ["u1\tc,0.500:a,0.250\n", "u2\tb,1.000\n"]
    with pytest.raises(ValueError, match="`sample_names`"):
        format_recommendations(["u1"], values, items, names)
    for bad in ("%d", "%s", "%.3f,", "x%f", "%f%f", "", "%"):
        with pytest.raises(ValueError, match="`score_format`"):
            format_recommendations(["u1", "u2"], values, items, names, bad)


def test_default_score_format_keeps_apart_what_three_decimals_tie():
    # A softmax's top scores over a large catalogue: a few thousandths, apart in the 4th digit.
    values = torch.tensor([[0.0041837, 0.0041226, 0.0040511, 0.0035]], dtype=torch.float32)
    items = torch.arange(4).unsqueeze(0)
    names = ["a", "b", "c", "d"]

    def scores(score_format):
        line = format_recommendations(["u"], values, items, names, score_format)[0]
        return [field.split(",")[1] for field in line.rstrip("\n").split("\t")[1].split(":")]

    assert scores("%4.3f") == ["0.004", "0.004", "0.004", "0.004"]  # DSSTNE's: every place tied
    default = scores(topk_module.DEFAULT_SCORE_FORMAT)
    assert default == ["0.0041837", "0.0041226", "0.0040511", "0.0035"]
    assert len(set(default)) == 4
    np.testing.assert_allclose([float(s) for s in default], values[0].numpy(), rtol=1e-6)


# ---------------------------------------------------------------------------- metrics


def test_metrics_hand_computed():
    recommended = np.array([[1, 2, 3], [4, -1, -1], [7, 8, 9]])
    offsets = np.array([0, 2, 3, 3])  # user 0 holds out {2, 5}, user 1 {4}, user 2 nothing
    indices = np.array([5, 2, 4])
    m = ranking_metrics(recommended, offsets, indices, k=3, n_items=10)
    # user 0: one hit at rank 2 of 3, 2 held out; user 1: one hit at rank 1, 1 held out.
    assert m.k == 3 and m.users == 2
    assert m.precision == pytest.approx((1 / 3 + 1 / 3) / 2)
    assert m.recall == pytest.approx((1 / 2 + 1 / 1) / 2)
    ndcg0 = (1 / math.log2(3)) / (1 + 1 / math.log2(3))
    assert m.ndcg == pytest.approx((ndcg0 + 1.0) / 2)
    assert m.coverage == pytest.approx(7 / 10)  # 1, 2, 3, 4, 7, 8, 9
    empty = ranking_metrics(recommended, np.zeros(4, np.int64), np.zeros(0, np.int64), k=3, n_items=10)
    assert (empty.users, empty.precision, empty.recall, empty.ndcg) == (0, 0.0, 0.0, 0.0)


def reference_metrics(recommended: np.ndarray, offsets: np.ndarray, indices: np.ndarray, k: int,
                      n_items: int) -> RankingMetrics:
    precision = recall = ndcg = 0.0
    users, covered = 0, set()
    for u in range(recommended.shape[0]):
        top = [int(i) for i in recommended[u, :k]]
        covered.update(i for i in top if i >= 0)
        held = set(int(i) for i in indices[offsets[u]:offsets[u + 1]])
        if not held:
            continue
        users += 1
        hits = [i >= 0 and i in held for i in top]
        precision += sum(hits) / k
        recall += sum(hits) / min(k, len(held))
        dcg = sum(1.0 / math.log2(r + 2) for r, h in enumerate(hits) if h)
        ideal = sum(1.0 / math.log2(r + 2) for r in range(min(k, len(held))))
        ndcg += dcg / ideal
    d = max(users, 1)
    return RankingMetrics(k, precision / d, recall / d, ndcg / d, len(covered) / n_items, users)


def test_metrics_against_loop_reference_and_accumulator():
    rng = np.random.default_rng(3)
    n_items, users = 40, 300
    recommended = np.stack([rng.permutation(n_items)[:12] for _ in range(users)])
    recommended[rng.random(recommended.shape) < 0.1] = -1  # some "none" entries
    lengths = rng.integers(0, 15, users)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    indices = np.concatenate([rng.choice(n_items, n, replace=False) for n in lengths])
    ks = [1, 5, 10]
    accumulator = MetricsAccumulator(ks, n_items)
    cuts = [0, 17, 18, 150, users]
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        accumulator.add(torch.from_numpy(recommended[lo:hi]), offsets[lo:hi + 1] - offsets[lo],
                        indices[offsets[lo]:offsets[hi]])
    for k, accumulated in zip(ks, accumulator.result()):
        one_shot = ranking_metrics(recommended, offsets, indices, k, n_items)
        assert accumulated == one_shot  # exactly
        want = reference_metrics(recommended, offsets, indices, k, n_items)
        assert one_shot.users == want.users and one_shot.k == k
        for field in ("precision", "recall", "ndcg", "coverage"):
            assert getattr(one_shot, field) == pytest.approx(getattr(want, field), rel=1e-12), (k, field)


def test_metrics_errors():
    with pytest.raises(ValueError, match="`k`"):
        ranking_metrics(np.zeros((1, 3), np.int64), np.array([0, 1]), np.array([0]), k=0, n_items=5)
    with pytest.raises(ValueError, match="`recommended`"):
        ranking_metrics(np.array([[7]]), np.array([0, 1]), np.array([0]), k=1, n_items=5)
    with pytest.raises(ValueError, match="`heldout_offsets`"):
        ranking_metrics(np.array([[1]]), np.array([0, 1, 1]), np.array([0]), k=1, n_items=5)


# ---------------------------------------------------------------------------- baselines


@pytest.fixture(scope="module")
def split():
    h = generate_user_histories(HistoryConfig(n_users=2000, n_items=500, n_interactions=60_000), seed=0)
    rows = h.rows
    mask = holdout_mask(rows.offsets, fraction=0.2, seed=0)
    user = np.repeat(np.arange(rows.n_samples), np.diff(rows.offsets))

    def part(select: np.ndarray) -> CsrRows:
        counts = np.bincount(user[select], minlength=rows.n_samples)
        return CsrRows(np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), rows.indices[select], None,
                       rows.n_features)

    return part(~mask), part(mask)


def precision_at_10(model, train: CsrRows, heldout: CsrRows) -> float:
    offsets, indices = torch.from_numpy(train.offsets), torch.from_numpy(train.indices.astype(np.int64))
    _, ids = top_k(exclude_(model.scores(offsets, indices), offsets, indices), 10)
    return ranking_metrics(ids, heldout.offsets, heldout.indices, 10, train.n_features).precision


def test_popularity_equals_bincount(split):
    train, _ = split
    model = fit_baseline("popularity", train)
    assert isinstance(model, Popularity)
    scores = model.scores(train.offsets[:6], train.indices[:train.offsets[5]])
    want = np.bincount(train.indices, minlength=train.n_features).astype(np.float32)
    assert scores.shape == (5, train.n_features)
    assert all(np.array_equal(row, want) for row in scores.numpy())


def test_itemknn_against_dense_reference():
    rng = np.random.default_rng(4)
    n_users, n_items, neighbours, shrink = 30, 12, 3, 2.0
    dense = (rng.random((n_users, n_items)) < 0.3).astype(np.float64)
    dense[:, 11] = 0  # an item nobody saw
    offsets = np.concatenate([[0], np.cumsum(dense.sum(1))]).astype(np.int64)
    indices = np.nonzero(dense)[1].astype(np.int64)
    model = fit_baseline("itemknn", CsrRows(offsets, indices, None, n_items), neighbours=neighbours, shrink=shrink)
    assert isinstance(model, ItemKNN)
    counts = dense.sum(0)
    similarity = (dense.T @ dense) / (np.sqrt(counts)[:, None] * np.sqrt(counts)[None, :] + shrink)
    weights = np.zeros((n_items, n_items))
    for j in range(n_items):
        candidates = sorted((-similarity[i, j], i) for i in range(n_items) if i != j and similarity[i, j] > 0)
        for s, i in candidates[:neighbours]:
            weights[i, j] = -s
    np.testing.assert_allclose(model.weights.toarray(), weights, rtol=1e-6)
    np.testing.assert_allclose(model.scores(offsets, indices).numpy(), dense @ weights, rtol=1e-5, atol=1e-6)


def als_objective(model: ImplicitMF, train: CsrRows, alpha: float, regularization: float) -> float:
    preference = np.zeros((train.n_samples, train.n_features))
    preference[np.repeat(np.arange(train.n_samples), np.diff(train.offsets)), train.indices] = 1.0
    x, y = model.user_factors.double().numpy(), model.item_factors.double().numpy()
    loss = ((1.0 + alpha * preference) * (preference - x @ y.T) ** 2).sum()
    return float(loss + regularization * ((x ** 2).sum() + (y ** 2).sum()))


def test_mf_objective_decreases(split):
    train, _ = split
    objective = [als_objective(ImplicitMF().fit(train, factors=8, iterations=t, alpha=10.0, regularization=0.05),
                               train, 10.0, 0.05) for t in (1, 2, 3, 4)]
    assert all(b <= a * (1 + 1e-6) for a, b in zip(objective, objective[1:])), objective
    assert objective[-1] < objective[0]


def test_baselines_beat_popularity(split):
    train, heldout = split
    popularity = precision_at_10(fit_baseline("popularity", train), train, heldout)
    knn = precision_at_10(fit_baseline("itemknn", train, neighbours=50), train, heldout)
    mf = precision_at_10(fit_baseline("mf", train, factors=32, iterations=6), train, heldout)
    ease = precision_at_10(fit_baseline("ease", train), train, heldout)  # the default lambda
    assert knn > popularity * 1.2, (knn, popularity)
    assert mf > popularity * 1.2, (mf, popularity)
    assert ease > popularity * 1.2, (ease, popularity)


def reference_ease(dense: np.ndarray, regularization: float) -> np.ndarray:
    """Steck's closed form in plain float64 numpy: B = -P / diag(P) with a zero diagonal."""
    p = np.linalg.inv(dense.T @ dense + regularization * np.eye(dense.shape[1]))
    b = -p / np.diag(p)[None, :]
    np.fill_diagonal(b, 0.0)
    return b


@pytest.mark.parametrize("block", [None, 40])  # 40 elements: 3 items per block, the fit's block loops at work
def test_ease_against_dense_reference(monkeypatch, block):
    if block is not None:
        monkeypatch.setattr(baselines_module, "_BLOCK_ELEMENTS", block)
    rng = np.random.default_rng(5)
    n_users, n_items, regularization = 50, 13, 3.0
    dense = (rng.random((n_users, n_items)) < 0.35).astype(np.float64)
    dense[:, 12] = 0  # an item nobody saw
    dense[7] = 0  # a user with no history
    rows = [list(rng.permutation(np.nonzero(d)[0])) for d in dense]
    rows[3] = rows[3] + rows[3][:2]  # a repeated item counts once
    offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64)
    indices = np.array([i for r in rows for i in r], dtype=np.int64)
    model = fit_baseline("ease", CsrRows(offsets, indices, None, n_items), regularization=regularization)
    assert isinstance(model, EASE) and model.weights.dtype == torch.float32
    want = reference_ease(dense, regularization)
    np.testing.assert_allclose(model.weights.numpy(), want, rtol=1e-5, atol=1e-7)
    scores = model.scores(offsets, indices)
    assert scores.dtype == torch.float32 and scores.shape == (n_users, n_items)
    np.testing.assert_allclose(scores.numpy(), dense @ want, rtol=0, atol=1e-6)
    assert not scores[7].any() and not scores[:, 12].any()


def test_ease_refuses_a_catalogue_above_its_memory_bound(split):
    train, _ = split
    need = ease_memory_bytes(train.n_features)
    assert need == 12 * 500 ** 2
    with pytest.raises(ValueError) as refused:
        fit_baseline("ease", train, max_memory_bytes=need // 2)
    message = str(refused.value)
    assert "500 items needs 2.9 MiB" in message and "limit of 1.4 MiB (`max_memory_bytes`)" in message, message
    assert "leave EASE out" in message and "smaller catalogue" in message, message
    assert EASE().fit(train, max_memory_bytes=need).weights.shape == (500, 500)  # at the bound: fitted
    with pytest.raises(ValueError, match="`regularization`"):
        fit_baseline("ease", train, regularization=0.0)
    with pytest.raises(RuntimeError, match="not fitted"):
        EASE().scores(np.array([0, 1]), np.array([0]))


def test_mf_scores_users_outside_the_fit(split):
    train, _ = split
    model = ImplicitMF().fit(CsrRows(train.offsets[:1001], train.indices[:train.offsets[1000]], None,
                                     train.n_features), factors=8, iterations=2)
    lo, hi = train.offsets[1500], train.offsets[1503]
    scores = model.scores(train.offsets[1500:1504] - lo, train.indices[lo:hi])
    assert scores.shape == (3, train.n_features) and torch.isfinite(scores).all()
    # An empty history gets the zero factor, so zero scores.
    assert torch.equal(model.scores(np.zeros(2, np.int64), np.zeros(0, np.int64)), torch.zeros(1, train.n_features))


def test_baseline_errors(split):
    train, _ = split
    with pytest.raises(ValueError, match="`name`"):
        fit_baseline("svd", train)
    with pytest.raises(ValueError, match="`neighbours`"):
        fit_baseline("itemknn", train, neighbours=0)
    with pytest.raises(ValueError, match="`regularization`"):
        fit_baseline("mf", train, regularization=0.0)
    with pytest.raises(ValueError, match="`indices`"):
        fit_baseline("popularity", train).scores(np.array([0, 1]), np.array([train.n_features]))
