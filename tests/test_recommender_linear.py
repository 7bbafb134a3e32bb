"""The linear item-item model (dlrm.recommender.linear): its closed form against scipy's EASE
(baselines.EASE, float64 LAPACK) and a plain numpy float64 EDLAE, its scores against a dense
product, the choice of its settings on validation, and the command line from training to
predict and evaluate (the same ranking path as the autoencoder and the baselines)."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch

from dlrm.recommender import checkpoint, linear, linear_catalogue, linear_search
from dlrm.recommender.baselines import EASE
from dlrm.recommender.csr_dataset import CsrDataset, CsrRows, write_csr
from dlrm.recommender.item_parallel import ItemParallel
from dlrm.recommender.metrics import RankingMetrics
from dlrm.recommender.validation import ValidationConfig, make_split, validate_scores


def _rows(seed: int = 0, users: int = 120, items: int = 40, skew: float = 0.8, lengths=(3, 15)) -> CsrRows:
    """Random histories with a popularity skew and repeated items (which count once)."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, items + 1) ** skew
    lengths = rng.integers(*lengths, users)
    indices = np.concatenate([rng.choice(items, n, p=p / p.sum()) for n in lengths]).astype(np.int32)
    return CsrRows(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64), indices, None, items)


@pytest.fixture
def dataset(tmp_path) -> CsrDataset:
    write_csr(str(tmp_path / "d"), _rows())
    return CsrDataset(str(tmp_path / "d"))


def _dense(dataset: CsrDataset, keep: np.ndarray | None = None) -> np.ndarray:
    offsets, indices = np.asarray(dataset.offsets), np.asarray(dataset.indices)
    rows = np.repeat(np.arange(len(dataset)), np.diff(offsets))
    keep = np.ones(len(indices), bool) if keep is None else keep
    x = np.zeros((len(dataset), dataset.n_features))
    x[rows[keep], indices[keep]] = 1.0
    return x


def test_gram_is_the_binary_matrix_product_without_the_left_out_entries(dataset):
    keep = np.random.default_rng(1).random(dataset.nnz) < 0.7
    for mask in (None, keep):
        x = _dense(dataset, mask)
        np.testing.assert_array_equal(linear.gram(dataset, mask).numpy(), x.T @ x)


def test_without_dropout_the_weights_are_eases(dataset):
    ours = linear.solve(linear.gram(dataset), linear.LinearSettings(25.0))
    reference = EASE().fit(dataset.rows(), regularization=25.0).weights
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("regularization, dropout", [(5.0, 0.25), (40.0, 0.6)])
def test_dropout_weights_are_edlaes_closed_form(dataset, regularization, dropout):
    x = _dense(dataset)
    g = x.T @ x
    penalty = regularization + dropout / (1 - dropout) * np.diag(g)
    p = np.linalg.inv(g + np.diag(penalty))
    expected = np.eye(len(g)) - p / np.diag(p)  # B = I - P diag(1 / diag(P)): diag(B) = 0
    ours = linear.solve(linear.gram(dataset), linear.LinearSettings(regularization, dropout))
    np.testing.assert_allclose(ours.numpy(), expected, rtol=1e-4, atol=1e-6)
    assert not ours.diagonal().any()


def test_scores_are_the_binary_history_times_the_weights_on_any_column_slice(dataset):
    settings = linear.LinearSettings(10.0, 0.25)
    model = linear.LinearModel(linear.solve(linear.gram(dataset), settings), settings)
    history = dataset.batch(0, len(dataset))
    expected = _dense(dataset) @ model.weights.double().numpy()
    np.testing.assert_allclose(model.scores(history).numpy(), expected, rtol=1e-5, atol=1e-5)
    part = model.column_slice(13, 29)
    assert part.item_start == 13
    np.testing.assert_allclose(part.scores(history).numpy(), expected[:, 13:29], rtol=1e-5, atol=1e-5)


def test_a_float32_gram_gives_the_weights_of_a_float64_one(dataset):
    """G's counts are exact in float32, so keeping it there changes no weight."""
    g = linear.gram(dataset)
    assert g.dtype == torch.float32
    settings = linear.LinearSettings(7.0, 0.4)
    torch.testing.assert_close(linear.solve(g, settings), linear.solve(g.double(), settings), rtol=0, atol=0)


_PEAK_SCRIPT = """
import resource, sys, torch
from dlrm.recommender import linear
n, ill = int(sys.argv[1]), sys.argv[2] == "ill"
torch.manual_seed(0)
g = torch.empty(n, n).uniform_().mul_(0.01)  # one triangle is read: no need to symmetrise
g.diagonal().add_(n)
if ill:  # every entry near 1e6: float32 cannot invert G + 0.01 I, float64 can
    g.add_(1e6)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
weights = linear.solve(g, linear.LinearSettings(0.01 if ill else 10.0))
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before)
"""


@pytest.mark.parametrize("ill", [False, True], ids=["float32", "float64_redo"])
def test_a_fit_takes_the_memory_it_promises(ill):
    """The peak ``memory_bytes`` promises: beside G, the float32 matrix factorised and inverted in
    place, which becomes B (4 bytes per entry); when float32's inverse is off, the float64 redo's
    matrix and B in float32 (12). A copy of the matrix would add 4 or 8 more. Measured as the
    process's peak resident memory in a fresh interpreter."""
    import subprocess
    import sys
    n = 2500
    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(n), "ill" if ill else "well"], capture_output=True,
                         text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    grown = int(out.stdout.split()[-1])
    dtype = torch.float64 if ill else torch.float32
    promised = linear.memory_bytes(n, 10, dtype) - 4 * n * n  # less G, made before the measure
    assert grown < promised + 16 * 2**20, f"the fit grew the peak by {grown / n / n:.1f} bytes per entry"
    assert linear.memory_bytes(n, 10) == 8 * n * n
    assert linear.memory_bytes(n, 10, torch.float64) == 16 * n * n
    assert linear.memory_bytes(n, 1 << 24) == 12 * n * n


def _duplicated_items() -> torch.Tensor:
    """G of histories where items 1 and 2 copy item 0: singular, so G + lambda I at a small
    lambda is ill-conditioned (its float32 inverse is off by 0.05 at lambda 0.01)."""
    x = (np.random.default_rng(0).random((3000, 200)) < 0.3).astype(np.float64)
    x[:, 1] = x[:, 2] = x[:, 0]
    return torch.from_numpy(x.T @ x).float()


def test_an_ill_conditioned_fit_is_redone_in_float64_or_refused_in_one_line():
    g = _duplicated_items()
    settings = linear.LinearSettings(0.01)
    gd = g.double().numpy()
    p = np.linalg.inv(gd + 0.01 * np.eye(len(gd)))
    expected = np.eye(len(gd)) - p / np.diag(p)
    np.testing.assert_allclose(linear.solve(g, settings).numpy(), expected, rtol=1e-5, atol=1e-6)
    # float32's own answer is far off: the residual check is what saved the weights above.
    p32 = linear._inverse(g, settings, torch.float32).double().numpy()
    assert np.abs((np.eye(len(gd)) - p32 / np.diag(p32)) - expected).max() > 1e-3
    with pytest.raises(linear.LinearFitError, match=r"float32 inverse .* is off by .* float64 does not fit the "
                                                    r"memory budget: raise `regularization`"):
        linear.solve(g, settings, allow_float64=False)


def test_a_matrix_that_is_not_positive_definite_is_one_line_not_a_crash():
    with pytest.raises(linear.LinearFitError, match="not positive definite.*raise `regularization`"):
        linear.solve(-torch.eye(4, dtype=torch.float64) * 100, linear.LinearSettings(1.0))


def test_choose_climbs_lambda_then_dropout_and_keeps_the_best_validation(dataset):
    cfg = ValidationConfig(user_fraction=1.0, item_fraction=0.2, k=5)
    split = make_split(dataset, cfg, seed=0)
    users = linear.user_matrix(dataset, split.train_mask)
    seen: list[tuple[float, float, int]] = []

    def validate(model) -> RankingMetrics:
        seen.append((model.settings.regularization, model.settings.dropout, model.settings.min_support))
        return validate_scores(model.scores, dataset, split, cfg)

    grid = (1.0, 10.0, 100.0)
    choice = linear_search.choose(users, validate, regularizations=grid, dropouts=(0.0, 0.3), min_supports=(1,))
    assert seen[:3] == [(10.0, 0.0, 1), (1.0, 0.0, 1), (100.0, 0.0, 1)]  # the middle, then both neighbours
    assert len(seen) == len(set(seen)), "a setting was solved twice"
    assert choice.best.metrics.ndcg == max(t.metrics.ndcg for t in choice.trials)
    # Each trial's figure is the validation of that model, made by the exact closed form (every
    # item has a user here, so min_support 1 is all of them) and recomputed independently here.
    g = linear.gram(dataset, split.train_mask)
    for trial in choice.trials:
        model = linear.LinearModel(linear.solve(g, trial.settings), trial.settings)
        assert validate_scores(model.scores, dataset, split, cfg).ndcg == pytest.approx(trial.metrics.ndcg)


def _surface(peak_lambda: float, peak_dropout: float):
    """A unimodal validation surface over (log lambda, dropout) with its top at the given point."""
    def ndcg(settings: linear.LinearSettings) -> float:
        return -(math.log10(settings.regularization / peak_lambda) ** 2) - 10 * (settings.dropout - peak_dropout) ** 2
    return ndcg


@pytest.mark.parametrize("peak_lambda", linear_search.REGULARIZATIONS)
@pytest.mark.parametrize("peak_dropout", linear_search.DROPOUTS)
def test_on_a_unimodal_surface_the_climb_finds_the_full_grids_best_in_fewer_solves(dataset, peak_lambda,
                                                                                 peak_dropout):
    """The exhaustive sweep over both grids, written plainly, against ``choose``'s coordinate
    ascent, on every placement of the top."""
    ndcg = _surface(peak_lambda, peak_dropout)

    def validate(model) -> RankingMetrics:
        return RankingMetrics(k=10, precision=0.0, recall=0.0, ndcg=ndcg(model.settings), coverage=0.0, users=1)

    grid, ps = linear_search.REGULARIZATIONS, linear_search.DROPOUTS
    sweep = max(((lam, p) for lam in grid for p in ps), key=lambda s: ndcg(linear.LinearSettings(*s)))
    choice = linear_search.choose(linear.user_matrix(dataset), validate, min_supports=(1,))
    assert (choice.best.settings.regularization, choice.best.settings.dropout) == sweep
    assert len(choice.trials) < len(grid) * len(ps) // 2


@pytest.fixture
def long_tail(tmp_path) -> CsrDataset:
    # A catalogue whose last items have one or two users (and a few none).
    write_csr(str(tmp_path / "t"), _rows(users=150, items=90, skew=1.6, lengths=(4, 20)))
    return CsrDataset(str(tmp_path / "t"))


def test_min_support_1_is_the_exact_closed_form_without_the_items_of_no_user(long_tail):
    users = linear.user_matrix(long_tail)
    support = linear_catalogue.item_support(users)
    assert (support == 0).any() and (support == 1).any(), "the fixture must have items of no user and of one"
    exact = linear.solve(linear.gram(long_tail), linear.LinearSettings(20.0, 0.25))
    fitted = linear_catalogue.fit(users, linear.LinearSettings(20.0, 0.25, min_support=1))
    torch.testing.assert_close(fitted.weights, exact, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("rest_columns", linear.REST_COLUMNS)
def test_items_under_min_support_get_a_zero_row_and_the_regression_on_the_learned_items(long_tail, rest_columns):
    """Against a float64 numpy fit written plainly: the closed form over the learned items, and
    each rest item's column the ridge regression (same penalty) of it on the learned items."""
    settings = linear.LinearSettings(15.0, 0.4, min_support=4, rest_columns=rest_columns)
    x = _dense(long_tail)
    g = x.T @ x
    learned = np.flatnonzero(np.diag(g) >= 4)
    rest = np.setdiff1d(np.arange(len(g)), learned)
    assert 10 < len(rest) < len(g) - 10
    penalty = settings.regularization + settings.dropout / (1 - settings.dropout) * np.diag(g)[learned]
    p = np.linalg.inv(g[np.ix_(learned, learned)] + np.diag(penalty))
    expected = np.zeros_like(g)
    expected[np.ix_(learned, learned)] = np.eye(len(learned)) - p / np.diag(p)
    if rest_columns == "regression":
        expected[np.ix_(learned, rest)] = p @ g[np.ix_(learned, rest)]
    fitted = linear_catalogue.fit(linear.user_matrix(long_tail), settings)
    np.testing.assert_allclose(fitted.weights.numpy(), expected, rtol=1e-4, atol=1e-6)

    # A trial's model (the learned items' rows only) scores as the full B does.
    cat = linear_catalogue.catalogue(linear_catalogue.item_support(linear.user_matrix(long_tail)), 4)
    users = linear.user_matrix(long_tail)
    trial = linear_catalogue.CatalogueModel(
        linear_catalogue.learned_rows(users, linear.gram(long_tail, items=cat.learned), cat, settings), cat, settings)
    history = long_tail.batch(0, len(long_tail))
    np.testing.assert_allclose(trial.scores(history).numpy(), x @ expected, rtol=1e-4, atol=1e-5)


def test_the_search_learns_fewer_items_first_and_keeps_a_smaller_min_support_only_when_it_pays(long_tail):
    """On a scripted validation surface: min_support's steps down stop at the first that does not
    beat the last by SUPPORT_MARGIN, and the regression columns are measured once at the end."""
    support = linear_catalogue.item_support(linear.user_matrix(long_tail))
    grid = (1, 2, 3, 5, 8)
    start = linear_search.search_support(support, grid, small_catalogue=0)
    assert linear_search.search_support(support, grid) == 1  # a catalogue this small is searched whole
    # The search's catalogue is never under half of small_catalogue items: else the whole one.
    with_a_user = int((support >= 1).sum())
    for small in range(with_a_user):
        chosen = linear_search.search_support(support, grid, small_catalogue=small)
        kept = (support >= chosen).sum()
        assert chosen == 1 or small / 2 <= kept <= with_a_user / 2, (small, chosen)
        assert chosen != 1 or not any(small / 2 <= (support >= t).sum() <= with_a_user / 2 for t in grid), small
    below = [t for t in reversed(grid) if t < start]
    assert len(below) >= 2 and (support >= start).sum() <= (support >= 1).sum() / 2 < (support >= below[0]).sum()
    margin = linear_search.SUPPORT_MARGIN
    gains = {start: 0.5, below[0]: 0.5 * (1 + 2 * margin), below[1]: 0.5 * (1 + 2 * margin) * (1 + margin / 2)}

    def validate(model) -> RankingMetrics:
        s = model.settings
        score = gains.get(s.min_support, 0.0) - abs(math.log10(s.regularization / 100)) - s.dropout
        return RankingMetrics(k=10, precision=0.0, recall=0.0, ndcg=score, coverage=0.0, users=1)

    choice = linear_search.choose(linear.user_matrix(long_tail), validate, min_supports=grid, small_catalogue=0)
    supports = [t.settings.min_support for t in choice.trials]
    assert set(supports[:-3]) == {start}, supports  # lambda and p on the smallest catalogue
    assert supports[-3:] == [below[0], below[1], below[0]], supports  # one step pays its margin, the next not
    # The regression columns validate the same here: a tie keeps the zero columns (no product).
    assert choice.best.settings == linear.LinearSettings(100.0, 0.0, below[0], "zero")
    assert choice.trials[-1].settings.rest_columns == "regression"


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> str:
    from conftest import run_cli

    out = str(tmp_path_factory.mktemp("linear") / "data")
    run_cli("dlrm.scripts.recommender_generate", "--synthetic", "--users", "300", "--items", "60",
            "--interactions", "9000", "--output", out, "--heldout_fraction", "0.2")
    return out


def test_cli_default_fits_the_linear_model_and_predict_and_evaluate_use_it(cli, generated, tmp_path):
    ckpt, log = str(tmp_path / "ck"), str(tmp_path / "log.json")
    proc = cli("dlrm.scripts.recommender_train", "--input", f"{generated}/input", "--save_checkpoint_path", ckpt,
               "--log_path", log)
    assert "linear item-item model" in proc.stdout and "chose lambda" in proc.stdout, proc.stdout
    records = [json.loads(line) for line in open(log)]
    summary = next(r for r in records if r["type"] == "summary")
    trials = [r for r in records if r["type"] == "validation"]
    assert summary["best_validation_ndcg"] == max(r["ndcg"] for r in trials)
    meta = checkpoint.read_meta(ckpt)
    assert meta["model"] == "linear" and meta["settings"]["regularization"] == summary["regularization"]

    # The saved weights are the closed form refitted on all of --input with the chosen settings.
    inputs = CsrDataset(f"{generated}/input")
    settings = linear.LinearSettings(**meta["settings"])
    assert settings.min_support == summary["min_support"]
    expected = linear_catalogue.fit(linear.user_matrix(inputs), settings).weights
    loaded = checkpoint.load_linear(ckpt, ItemParallel())
    torch.testing.assert_close(loaded.weights, expected)

    # evaluate ranks with it as with the baselines: with EASE's settings the figures are EASE's.
    metrics = str(tmp_path / "m.json")
    cli("dlrm.scripts.recommender_evaluate", "--load_checkpoint_path", ckpt, "--input", f"{generated}/input",
        "--heldout", f"{generated}/heldout", "--k", "5", "--baselines", "ease,popularity", "--ease_lambda",
        str(summary["regularization"]), "--output", metrics)
    results = json.load(open(metrics))["results"]
    assert results["model"]["users"] == results["popularity"]["users"] == 300
    if summary["dropout"] == 0:
        assert results["model"]["ndcg@5"] == pytest.approx(results["ease"]["ndcg@5"], abs=1e-6)

    recs = str(tmp_path / "recs.txt")
    out = cli("dlrm.scripts.recommender_predict", "--load_checkpoint_path", ckpt, "--input", f"{generated}/input",
              "--k", "3", "--output", recs, "--features_index", f"{generated}/features_index.txt",
              "--samples_index", f"{generated}/samples_index.txt").stdout
    assert "linear item-item model" in out
    names = dict(line.split("\t") for line in open(f"{generated}/features_index.txt").read().splitlines())
    first = open(recs).readline().rstrip("\n").split("\t")[1].split(":")
    history = set(inputs.rows(0, 1).indices.tolist())
    top = expected.numpy()[sorted(history)].sum(0)
    top[sorted(history)] = -np.inf
    want = [int(i) for i in np.argsort(-top, kind="stable")[:3]]
    assert [names[entry.split(",")[0]] for entry in first] == [str(i) for i in want]


@pytest.mark.parametrize("extra, says", [
    (["--epochs", "3"], "--epochs applies to the autoencoder"),
    (["--model", "autoencoder"], "--model autoencoder needs --network"),
    (["--validation_users", "0"], "--validation_users 0"),
    (["--linear_max_memory_gb", "0.000001"], "raise it if cpu has the memory, or train the item-parallel"),
])
def test_cli_refuses_what_the_linear_model_cannot_do_in_one_line(cli, generated, tmp_path, extra, says):
    proc = cli("dlrm.scripts.recommender_train", "--input", f"{generated}/input", "--save_checkpoint_path",
               str(tmp_path / "ck"), *extra, check=False)
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not os.path.exists(tmp_path / "ck")


def test_a_damaged_linear_checkpoint_is_refused_in_one_line(cli, generated, tmp_path):
    ckpt = str(tmp_path / "ck")
    cli("dlrm.scripts.recommender_train", "--input", f"{generated}/input", "--save_checkpoint_path", ckpt)
    weights = os.path.join(ckpt, checkpoint.LINEAR_FILE)
    data = bytearray(open(weights, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(weights, "wb").write(bytes(data))
    proc = cli("dlrm.scripts.recommender_evaluate", "--load_checkpoint_path", ckpt, "--input", f"{generated}/input",
               "--heldout", f"{generated}/heldout", "--baselines=", check=False)
    assert proc.returncode == 2 and "linear.pt" in proc.stderr and "damaged" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("search_support, refit_support", [(4, 4), (6, 3), (3, 6), (1, 1)])
def test_the_refit_updates_the_searchs_gram_to_the_gram_of_all_the_data(long_tail, search_support, refit_support):
    """refit_gram against the Gram matrix of all the data made from scratch: the search's block
    corrected for the validation users' rows, items it did not learn added, items it did dropped."""
    cfg = ValidationConfig(user_fraction=0.4, item_fraction=0.3, k=5)
    split = make_split(long_tail, cfg, seed=3)
    train = linear.user_matrix(long_tail, split.train_mask)
    users = linear.user_matrix(long_tail)
    searched = linear_catalogue.catalogue(linear_catalogue.item_support(train), search_support).learned
    search = linear_catalogue.SearchGram(linear.gram(None, items=searched, users=train), searched, train, split.users)
    learned = linear_catalogue.catalogue(linear_catalogue.item_support(users), refit_support).learned
    expected = _dense(long_tail)[:, learned]
    got = linear_catalogue.refit_gram(users, learned, search)
    np.testing.assert_array_equal(got.numpy(), expected.T @ expected)


def test_the_cli_refit_equals_a_fit_from_scratch_and_says_how_it_made_g(cli, long_tail, tmp_path):
    ckpt, log = str(tmp_path / "ck"), str(tmp_path / "log.json")
    proc = cli("dlrm.scripts.recommender_train", "--input", long_tail.path, "--save_checkpoint_path", ckpt,
               "--log_path", log)
    assert "G updated from the search's" in proc.stdout, proc.stdout
    records = [json.loads(line) for line in open(log)]
    assert next(r for r in records if r["type"] == "fit_time")["gram_reused"] is True
    settings = linear.LinearSettings(**checkpoint.read_meta(ckpt)["settings"])
    expected = linear_catalogue.fit(linear.user_matrix(long_tail), settings).weights
    torch.testing.assert_close(checkpoint.load_linear(ckpt, ItemParallel()).weights, expected)


@pytest.mark.parametrize("smaller, larger", [(6, 2), (2, 6)])
def test_the_search_extends_one_min_supports_gram_to_anothers(long_tail, smaller, larger):
    """What the search does when min_support steps: G over one catalogue made from another's (no
    user changed), against G made from scratch."""
    users = linear.user_matrix(long_tail)
    support = linear_catalogue.item_support(users)
    was = linear_catalogue.catalogue(support, smaller).learned
    learned = linear_catalogue.catalogue(support, larger).learned
    search = linear_catalogue.SearchGram(linear.gram(None, items=was, users=users), was, users, np.empty(0, np.int64))
    got = linear_catalogue.refit_gram(users, learned, search)
    np.testing.assert_array_equal(got.numpy(), linear.gram(long_tail, items=learned).numpy())
