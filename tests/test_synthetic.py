"""Synthetic data: determinism, ranges, a learnable signal, and the on-disk round trip."""

import math
import os
import random

import numpy as np
import pytest
import scipy.sparse
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.preprocessing import OneHotEncoder

from dlrm.data.batch import Batch
from dlrm.data.hidden_model import HiddenModel, hash_ids
from dlrm.data.synthetic import FL15_CARDINALITIES, SyntheticDataset, write_synthetic_dataset
from dlrm.engine.outputs import OutputError
import warm_python

SIZES = [3, 10, 50, 200, 1000, 100_000]
ZIPF = 1.2  # the documented id law: P(id < k) = (1 - (k+1)^-0.2) / (1 - (size+1)^-0.2)


def rows(ds: SyntheticDataset) -> Batch:
    """Every row of a dataset as one batch."""
    bs = [ds.read_batch(i) for i in range(len(ds))]
    return Batch(*(torch.cat([getattr(b, k) for b in bs]) for k in ("numerical", "categorical", "label")))


def assert_batches_equal(a: Batch, b: Batch) -> None:
    assert torch.equal(a.numerical, b.numerical)
    assert torch.equal(a.categorical.long(), b.categorical.long())
    assert torch.equal(a.label, b.label)


def zipf_cdf(k: float, size: int) -> float:
    return (1 - (k + 1) ** (1 - ZIPF)) / (1 - (size + 1) ** (1 - ZIPF))


# ------------------------------------------------------------------------------ determinism


def test_same_batch_every_time_in_any_order():
    a = SyntheticDataset(13, SIZES, 10_000, 1000, seed=1)
    b = SyntheticDataset(13, SIZES, 10_000, 1000, seed=1)
    forward = [a.read_batch(i) for i in range(len(a))]
    order = list(range(len(b)))
    random.Random(0).shuffle(order)
    shuffled = {i: b.read_batch(i) for i in order}
    for i in range(len(a)):
        assert_batches_equal(forward[i], shuffled[i])
        assert_batches_equal(forward[i], a.read_batch(i))


def test_index_split_and_seed_change_the_samples():
    base = SyntheticDataset(13, SIZES, 4000, 1000, seed=1, split="train")
    b0 = base.read_batch(0)
    others = [
        base.read_batch(1),
        SyntheticDataset(13, SIZES, 4000, 1000, seed=1, split="test").read_batch(0),
        SyntheticDataset(13, SIZES, 4000, 1000, seed=1, split="validation").read_batch(0),
        SyntheticDataset(13, SIZES, 4000, 1000, seed=2, split="train").read_batch(0),
    ]
    for other in others:
        assert not torch.equal(b0.numerical, other.numerical)
        assert not torch.equal(b0.categorical, other.categorical)
        assert not torch.equal(b0.label, other.label)


def test_hidden_model_is_shared_by_splits_and_changes_with_seed():
    train = SyntheticDataset(13, SIZES, 4000, 4000, seed=1, split="train")
    test = SyntheticDataset(13, SIZES, 4000, 4000, seed=1, split="test")
    other = SyntheticDataset(13, SIZES, 4000, 4000, seed=2, split="test")
    batch = test.read_batch(0)
    assert torch.equal(train.logits(batch), test.logits(batch))
    assert (train.logits(batch) - other.logits(batch)).abs().mean() > 0.1


# ------------------------------------------------------------------------------ shapes, dtypes, ranges


def test_length_partial_last_batch_and_dtypes():
    ds = SyntheticDataset(5, [7, 9], num_samples=1000, batch_size=300)
    assert len(ds) == 4 and ds.num_samples == 1000
    sizes = [len(ds.read_batch(i)) for i in range(len(ds))]
    assert sizes == [300, 300, 300, 100]
    last = ds.read_batch(3)
    assert last.numerical.shape == (100, 5) and last.categorical.shape == (100, 2) and last.label.shape == (100,)
    assert last.numerical.dtype == torch.float16
    assert last.categorical.dtype == torch.int32
    assert last.label.dtype == torch.bool
    with pytest.raises(IndexError):
        ds.read_batch(4)
    assert_batches_equal(ds.read_batch(np.int64(2)), ds.read_batch(2))  # a shuffled order is numpy
    assert len(SyntheticDataset(5, [7], num_samples=900, batch_size=300)) == 3


def test_tiny_tables_use_every_id_with_zipf_frequencies():
    sizes = [1, 2, 4]
    cat = SyntheticDataset(2, sizes, 65536, 65536).read_batch(0).categorical.long()
    assert cat.min() >= 0
    assert (cat[:, 0] == 0).all()
    for j, size in enumerate(sizes[1:], start=1):
        counts = torch.bincount(cat[:, j], minlength=size)
        assert counts.numel() == size and (counts > 0).all()
        for k in range(size):  # frequencies match the stated law (binomial std < 0.002 here)
            expected = zipf_cdf(k + 1, size) - zipf_cdf(k, size)
            assert abs(counts[k].item() / 65536 - expected) < 0.01, (size, k)


def test_fl15_ids_stay_in_range_and_reach_the_tail():
    ds = SyntheticDataset(13, FL15_CARDINALITIES, 65536, 65536, seed=3)
    cat = ds.read_batch(0).categorical
    assert cat.dtype == torch.int32
    sizes = torch.tensor(FL15_CARDINALITIES)
    assert (cat >= 0).all() and (cat.long() < sizes).all()
    big = sizes > 1_000_000
    # The top 10% of a big table's ids get ~0.08% of the rows (~50 here): the tail is reached.
    assert (cat.long().max(0).values[big] > 0.9 * sizes[big]).all()
    # id 0 is the most frequent, at the analytic rate.
    for j in torch.nonzero(big).flatten().tolist():
        rate = (cat[:, j] == 0).float().mean().item()
        assert abs(rate - zipf_cdf(1, FL15_CARDINALITIES[j])) < 0.01


def test_largest_uniform_draw_stays_in_range(monkeypatch):
    """torch.rand's largest value would map to id == size after float64 rounding for some sizes."""
    def largest(*size, generator=None, device=None, dtype=None):
        dtype = dtype or torch.float32
        return torch.full(size, 1 - torch.finfo(dtype).eps / 2, dtype=dtype, device=device)

    sizes = [1, 3, 4, 7, 2**25]  # the big table makes the id law run in float64
    ds = SyntheticDataset(2, sizes, 16, 16)
    monkeypatch.setattr(torch, "rand", largest)
    cat = ds.read_batch(0).categorical.long()
    monkeypatch.undo()
    assert (cat == torch.tensor(sizes) - 1).all()


def test_ids_beyond_int32_use_int64():
    size = 2**40
    cat = SyntheticDataset(1, [size, 5], 65536, 65536).read_batch(0).categorical
    assert cat.dtype == torch.int64
    assert cat.min() >= 0 and cat[:, 0].max() < size and cat[:, 1].max() < 5
    assert (cat[:, 0] >= 2**32).sum() > 100  # so the labels went through the 64-bit id hash


def test_numerical_features_look_like_log_counts():
    x = SyntheticDataset(13, SIZES, 65536, 65536).read_batch(0).numerical.float()
    assert torch.isfinite(x).all() and (x >= 0).all()
    zeros = (x == 0).float().mean(0)
    assert (zeros > 0.03).all() and (zeros < 0.8).all()  # missing values and zero counts
    assert x.max() > 5  # a tail of large counts
    # Non-zero values are log1p of integers: expm1 gives whole numbers (float16 rounding aside).
    small = x[(x > 0) & (x < 2)]
    counts = torch.expm1(small)
    assert ((counts - counts.round()).abs() < 0.01).all()


def test_no_numerical_features():
    b = SyntheticDataset(0, [10, 20], 100, 64).read_batch(1)
    assert b.numerical.shape == (36, 0) and b.categorical.shape == (36, 2)


# ------------------------------------------------------------------------------ hashing


def _mix32_reference(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x45D9F3B) & 0xFFFFFFFF
    h ^= h >> 16
    h = (h * 0x45D9F3B) & 0xFFFFFFFF
    return h ^ (h >> 16)


def test_hash_matches_a_pure_python_reference():
    rng = random.Random(0)
    ids = [0, 1, 2, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40 + 17, 2**62 + 5] + [rng.randrange(2**63) for _ in range(200)]
    salts = [rng.randrange(2**32) for _ in ids]
    got = hash_ids(torch.tensor(ids), torch.tensor(salts), wide=True).tolist()
    expected = [_mix32_reference(_mix32_reference((i & 0xFFFFFFFF) ^ s) ^ (i >> 32)) for i, s in zip(ids, salts)]
    assert got == expected
    narrow = [i for i in ids if i < 2**32]
    got = hash_ids(torch.tensor(narrow), torch.tensor(salts[: len(narrow)]), wide=False).tolist()
    assert got == [_mix32_reference(i ^ s) for i, s in zip(narrow, salts)]


# ------------------------------------------------------------------------------ the signal


@pytest.fixture(scope="module")
def test_split():
    ds = SyntheticDataset(13, [100_000] * 26, 131072, 65536, seed=12345, split="test")
    batch = rows(ds)
    return batch, ds.logits(batch)


def test_bayes_auc_and_positive_rate(test_split):
    batch, logits = test_split
    y = batch.label.numpy()
    assert 0.25 <= y.mean() <= 0.35
    auc = roc_auc_score(y, logits.numpy())
    assert 0.75 < auc < 0.86  # "around 0.8": clearly learnable, far from separable


def test_labels_are_bernoulli_of_the_logit(test_split):
    batch, logits = test_split
    p = torch.sigmoid(logits.double())
    y = batch.label.double()
    edges = torch.quantile(p, torch.linspace(0, 1, 11, dtype=torch.float64))
    for lo, hi in zip(edges[:-1], edges[1:]):
        inside = (p >= lo) & (p <= hi)
        n = inside.sum().item()
        expected = p[inside].mean().item()
        tolerance = 4 * math.sqrt(expected * (1 - expected) / n) + 1e-3
        assert abs(y[inside].mean().item() - expected) < tolerance


def test_signal_is_learnable_from_observable_features():
    """A linear model on numerical features and one-hot ids, fitted on 'train', scores on 'test'."""
    sizes = [3, 10, 30, 100, 200]

    def features(split, n):
        b = SyntheticDataset(13, sizes, n, n, seed=5, split=split).read_batch(0)
        return b.numerical.float().numpy(), b.categorical.numpy(), b.label.numpy()

    x_train, c_train, y_train = features("train", 30_000)
    x_test, c_test, y_test = features("test", 15_000)
    mean, std = x_train.mean(0), x_train.std(0)
    onehot = OneHotEncoder(categories=[list(range(s)) for s in sizes]).fit(c_train)

    def design(x, c, with_ids):
        x = (x - mean) / std
        return scipy.sparse.hstack([x, onehot.transform(c)]).tocsr() if with_ids else x

    aucs = {}
    for with_ids in (False, True):
        model = LogisticRegression(C=0.1, max_iter=500).fit(design(x_train, c_train, with_ids), y_train)
        aucs[with_ids] = roc_auc_score(y_test, model.decision_function(design(x_test, c_test, with_ids)))
    assert aucs[False] > 0.6
    assert aucs[True] > 0.72 and aucs[True] > aucs[False] + 0.05  # the ids carry learnable signal


def test_logit_has_pairwise_interactions_exactly_where_the_layout_says():
    """Mixed differences of the logit are zero for an additive pair of features, not otherwise."""
    sizes = [50] * 6
    model = HiddenModel(4, sizes, seed=3)
    b = SyntheticDataset(4, sizes, 512, 512, seed=3).read_batch(0)
    cat, num = b.categorical.long(), b.numerical
    other = (cat + 1 + torch.randint(0, 48, cat.shape, generator=torch.Generator().manual_seed(0))) % 50
    logit = model.logit

    def with_ids(cols):
        c = cat.clone()
        c[:, cols] = other[:, cols]
        return c

    table_pairs = {(a, b) for a, b, _ in model.layout.table_pairs}
    assert 0 < len(table_pairs) < 15  # some pairs interact and some do not
    for a in range(6):
        for b in range(a + 1, 6):
            mixed = logit(num, with_ids([a, b])) - logit(num, with_ids([a])) - logit(num, with_ids([b])) + logit(num, cat)
            if (a, b) in table_pairs or (b, a) in table_pairs:
                assert mixed.abs().mean() > 0.05, (a, b)
            else:
                assert mixed.abs().max() < 1e-4, (a, b)

    shifted = num.clone()
    shifted[:, 0] += 1.0
    numerical_pairs = set(model.layout.numerical_pairs)
    assert 0 < len(numerical_pairs) < 6
    for t in range(6):
        mixed = logit(shifted, with_ids([t])) - logit(shifted, cat) - logit(num, with_ids([t])) + logit(num, cat)
        if t in numerical_pairs:
            assert mixed.abs().mean() > 0.01, t
        else:
            assert mixed.abs().max() < 1e-4, t


def test_calibration_holds_for_other_layouts():
    """Few features or one table: still a learnable signal and a click-like positive rate."""
    for num_numerical, sizes in ((2, [1000]), (0, [50, 50]), (13, [1, 1])):
        model = HiddenModel(num_numerical, sizes, seed=9)
        b = rows(SyntheticDataset(num_numerical, sizes, 65536, 65536, seed=9, split="test"))
        y = b.label.numpy()
        assert 0.25 <= y.mean() <= 0.35
        assert roc_auc_score(y, model.logit(b.numerical, b.categorical).numpy()) > 0.7


# ------------------------------------------------------------------------------ on disk


def test_write_round_trip_and_refusals(tmp_path):
    from dlrm.data.feature_spec import FeatureSpec
    from dlrm.data.split_binary import SplitBinaryReader

    sizes = [1, 4, 300, 70_000]
    out = tmp_path / "ds"
    samples = {"train": 5000, "test": 1234, "validation": 1000}
    write_synthetic_dataset(str(out), 6, sizes, samples, batch_size=2048, seed=4)
    spec = FeatureSpec.from_yaml(str(out))
    assert spec.cardinalities == sizes and spec.num_numerical == 6
    for split, n in samples.items():
        expected = rows(SyntheticDataset(6, sizes, n, 2048, seed=4, split=split))
        reader = SplitBinaryReader(spec, split, 1000)  # another batch size: same rows
        assert reader.num_samples == n
        assert_batches_equal(rows(reader), expected)
        reader.close()

    with pytest.raises(OutputError, match="already holds a dataset; pass `overwrite`"):
        write_synthetic_dataset(str(out), 6, sizes, {"train": 10})
    assert FeatureSpec.from_yaml(str(out)).splits == list(samples)  # untouched
    write_synthetic_dataset(str(out), 2, [5], {"train": 10}, overwrite=True)
    assert FeatureSpec.from_yaml(str(out)).cardinalities == [5]
    assert sorted(os.listdir(tmp_path)) == ["ds"]  # no staging or old copies left behind


def test_interrupted_write_leaves_nothing(tmp_path):
    def fail(split, done, total):
        if split == "test":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_synthetic_dataset(str(tmp_path / "ds"), 2, [5], {"train": 100, "test": 100}, progress=fail)
    assert os.listdir(tmp_path) == []


def test_script_writes_a_readable_dataset(tmp_path, cli):
    from dlrm.data.feature_spec import FeatureSpec
    from dlrm.data.split_binary import SplitBinaryReader

    out = tmp_path / "synthetic"
    proc = cli("dlrm.scripts.prepare_synthetic_dataset", f"--synthetic_dataset_dir={out}",
               "--synthetic_dataset_table_sizes=3,40,500", "--num_numerical_features=4",
               "--synthetic_dataset_num_entries=3000", "--num_test_entries=700",
               "--seed=8", "--batch_size=1024")
    assert "train" in proc.stdout and "3000 rows" in proc.stdout and "bytes" in proc.stdout
    spec = FeatureSpec.from_yaml(str(out))
    assert spec.splits == ["train", "test"] and spec.cardinalities == [3, 40, 500]  # no validation unless asked
    reader = SplitBinaryReader(spec, "test", 4096)
    assert_batches_equal(rows(reader), rows(SyntheticDataset(4, [3, 40, 500], 700, 1024, seed=8, split="test")))
    reader.close()
    assert os.path.getsize(out / "train" / "numerical.bin") == 3000 * 4 * 2


def test_script_writes_the_skew_it_is_given(tmp_path, cli):
    """``--synthetic_zipf_exponent`` reaches the rows on disk: they are SyntheticDataset's rows
    of that skew (the same ids main's flag of that name generates), not the default's, and the
    spec's metadata says which law drew them; the default's spec stays as it always was (and its
    rows are the default's: test_script_writes_a_readable_dataset)."""
    from dlrm.data.feature_spec import FeatureSpec
    from dlrm.data.split_binary import SplitBinaryReader
    out = tmp_path / "flat"
    cli("dlrm.scripts.prepare_synthetic_dataset", f"--synthetic_dataset_dir={out}", "--synthetic_zipf_exponent=1.01",
        "--synthetic_dataset_table_sizes=50,7000", "--num_numerical_features=2", "--synthetic_dataset_num_entries=600",
        "--num_test_entries=300", "--seed=5", "--batch_size=256")
    spec = FeatureSpec.from_yaml(str(out))
    assert spec.metadata["synthetic"]["zipf_exponent"] == 1.01
    reader = SplitBinaryReader(spec, "train", 600)
    got = rows(reader)
    reader.close()
    assert_batches_equal(got, rows(SyntheticDataset(2, [50, 7000], 600, 256, seed=5, zipf_exponent=1.01)))
    default = rows(SyntheticDataset(2, [50, 7000], 600, 256, seed=5))
    assert not torch.equal(got.categorical.long(), default.categorical.long())  # another law: other ids
    write_synthetic_dataset(str(tmp_path / "default"), 2, [50], {"train": 10})
    assert "zipf_exponent" not in FeatureSpec.from_yaml(str(tmp_path / "default")).metadata["synthetic"]


# ------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_generates_on_the_gpu_with_the_same_hidden_model():
    ds = SyntheticDataset(13, FL15_CARDINALITIES, 100_000, 65536, device="cuda", split="test")
    b = ds.read_batch(1)
    assert b.numerical.is_cuda and b.categorical.is_cuda and b.label.is_cuda
    assert len(b) == 100_000 - 65536
    assert (b.categorical >= 0).all() and (b.categorical.long() < torch.tensor(FL15_CARDINALITIES, device="cuda")).all()
    assert_batches_equal(b, ds.read_batch(1))
    cpu = b.to("cpu")
    torch.testing.assert_close(ds.logits(b).cpu(), ds.logits(cpu), rtol=1e-4, atol=1e-4)
    ids = torch.randint(0, 2**62, (1000, 26))
    salts = torch.randint(0, 2**32, (26,))
    assert torch.equal(hash_ids(ids.cuda(), salts.cuda()).cpu(), hash_ids(ids, salts))


def test_staging_left_by_a_killed_writer_is_removed_by_the_next_write(tmp_path):
    """``kill -9`` mid-write leaves the staging directory; the next write to the same place removes it."""
    import sys

    out = str(tmp_path / "data")
    script = (
        "import os, signal\n"
        "from dlrm.data.synthetic import write_synthetic_dataset\n"
        "def die(split, done, rows):\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        f"write_synthetic_dataset({out!r}, 2, [10, 20], {{'train': 100}}, batch_size=10, progress=die)\n"
    )
    proc = warm_python.run([sys.executable, "-c", script])
    assert proc.returncode == -9
    assert [n for n in os.listdir(tmp_path) if n.startswith(".data.")], "the killed writer left nothing to clean"
    write_synthetic_dataset(out, 2, [10, 20], {"train": 100}, batch_size=10)
    assert os.listdir(tmp_path) == ["data"]


@pytest.mark.parametrize("exponent", [0.9, 1.05, 1.2])
def test_ids_follow_the_power_law_of_zipf_exponent(exponent):
    """A log-log fit of frequency against rank (ranks 1..300 of a 100k-row table, 2M seeded
    draws) has slope -exponent. Ids are a continuous law floored, so id k holds the mass of
    [k + 1, k + 2): its frequency is about (k + 1.5) ** -exponent, the rank used in the fit."""
    import numpy as np

    from dlrm.data.hidden_model import HiddenModel

    model = HiddenModel(1, [100_000], seed=3, zipf_exponent=exponent)
    _, ids = model.sample_features(2_000_000, torch.Generator().manual_seed(11))
    counts = torch.bincount(ids[:, 0], minlength=100_000).double()
    ranks = torch.arange(300, dtype=torch.float64) + 1.5
    slope = np.polyfit(ranks.log().numpy(), counts[:300].log().numpy(), 1)[0]
    assert slope == pytest.approx(-exponent, abs=0.02)
    assert torch.equal(counts.argsort(descending=True, stable=True)[:5], torch.arange(5))


def test_a_non_positive_zipf_exponent_is_refused():
    with pytest.raises(ValueError, match="`zipf_exponent` must be positive, got 0"):
        SyntheticDataset(1, [10], 10, 5, zipf_exponent=0)
