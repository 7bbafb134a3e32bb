import math

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score

from dlrm.data.metrics import roc_auc


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("levels", [2, 7, 50, None])
def test_auc_matches_sklearn_with_ties(seed, levels):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(10, 5000))
    labels = rng.random(n) < rng.uniform(0.05, 0.6)
    labels[0], labels[1] = True, False
    scores = rng.random(n) + 0.3 * labels
    if levels is not None:  # heavy ties: few distinct score values
        scores = np.round(scores * levels) / levels
    expected = roc_auc_score(labels, scores)
    got = roc_auc(torch.from_numpy(labels), torch.from_numpy(scores).float())
    # float32 rounding of the scores may merge values; compare on the same float32 scores
    expected32 = roc_auc_score(labels, scores.astype(np.float32))
    assert got == pytest.approx(expected32, abs=1e-6)
    assert abs(expected - expected32) < 1e-3


def test_auc_all_tied_is_half():
    labels = torch.tensor([0, 1, 0, 1, 1])
    assert roc_auc(labels, torch.zeros(5)) == pytest.approx(0.5)


def test_auc_single_class_is_nan():
    assert math.isnan(roc_auc(torch.ones(4), torch.rand(4)))


def test_auc_length_mismatch():
    with pytest.raises(ValueError, match="differ in length"):
        roc_auc(torch.ones(4), torch.rand(5))
