"""The autoencoder as a scorer: a batch's histories in, scores of this process's items out.
Prediction, validation and loading a checkpoint for scoring (``checkpoint.load_scorer``) all
use it; its own module, below them, so that the checkpoint format need not import the
prediction loop."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from dlrm.recommender.csr_rows import Csr
from dlrm.recommender.model import SparseAutoencoder, activation

Scorer = Callable[[Csr], torch.Tensor]  # a batch's history -> scores [B, n_local] of this process's items


def model_scorer(model: SparseAutoencoder, amp_dtype: torch.dtype | None = None) -> Scorer:
    """The model's output activations (what DSSTNE writes) for this process's item slice."""
    device = model.output_weight.device
    autocast = (torch.autocast(device.type, dtype=amp_dtype) if amp_dtype is not None else contextlib.nullcontext())
    act = model.config.output.activation

    def score(inputs: Csr) -> torch.Tensor:
        with torch.no_grad(), autocast:
            z = model(*(None if t is None else t.to(device) for t in inputs)).float()
        if act == "softmax":
            lse = torch.logsumexp(model.parallel.all_gather_same(torch.logsumexp(z, 1)), 0).unsqueeze(1)
            return (z - lse).exp()
        return activation(act)(z)

    model.eval()
    return score

