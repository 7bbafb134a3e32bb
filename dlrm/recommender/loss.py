"""DSSTNE's error functions over sparse targets, for this process's item slice.

Every error function is element-wise, ``f(z, t)`` for a logit ``z`` and a target ``t``, and
almost every target is zero. So the loss of a batch is computed as

    sum over all (user, item) of f(z, 0)  +  sum over the users' target items of f(z, t) - f(z, 0)

a dense term with no targets at all plus a correction at the ``nnz`` targets: no dense target
matrix, and with sampled negatives the dense term becomes an estimate from a sample of items.

Definitions (y = the output activation of z; t = the target value, 1 for plain items):

- ``crossentropy``: -t log y - (1 - t) log(1 - y); with SoftMax output, -t log y: summed over
  the catalogue, -sum_i t_i log softmax(z)_i, the multinomial log-likelihood of Liang et al.'s
  Mult-DAE and Mult-VAE (with raw 0/1 or count targets). Its zero targets cost nothing, so only
  the targets' terms are computed; the normaliser spans every process's items.
- ``scaledmarginalcrossentropy``: targets > 0 cost ``oneScale * -log y`` while y < ``oneTarget``;
  zero targets cost ``zeroScale * -log(1 - y)`` while y > ``zeroTarget``; nothing beyond the
  margins (DSSTNE's ScaledMarginalCrossEntropy).
- ``l2``: (y - t)^2 / 2;  ``l1``: |y - t|.

Losses are summed over items and users; the caller divides by the global batch size.

A ``Variational`` network adds ``kl_weight`` times the KL divergence of the latent's Gaussian
to N(0, I), summed over latent units, averaged over the batch (Liang et al.'s annealed beta).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dlrm.recommender.item_parallel import ItemParallel
from dlrm.recommender.model import SparseAutoencoder, activation
from dlrm.recommender.network import NetworkConfig, Variational

_EPS = 1e-7


def _wide(z: torch.Tensor) -> torch.Tensor:
    """Losses in at least float32 (logits come in bf16/fp16 under autocast)."""
    return z if z.dtype == torch.float64 else z.float()


def _logit(p: float) -> float:
    p = min(max(p, _EPS), 1 - _EPS)
    return math.log(p / (1 - p))


def elementwise_loss(config: NetworkConfig, z: torch.Tensor, t: torch.Tensor | float,
                     lse: torch.Tensor | None = None) -> torch.Tensor:
    """``f(z, t)`` element by element; ``lse`` is the log of softmax's normaliser per user
    (``[B, 1]``, over the whole catalogue) when the output activation is SoftMax."""
    kind, act = config.error_function, config.output.activation
    if act == "softmax":
        log_y = z - lse
        if kind == "crossentropy":
            return -t * log_y
        y = log_y.exp()
        log_1my = torch.log1p(-y.clamp(max=1 - _EPS))
    elif act == "sigmoid":
        y, log_y, log_1my = None, -F.softplus(-z), -F.softplus(z)
    else:
        y = activation(act)(z)
        clamped = y.clamp(_EPS, 1 - _EPS)
        log_y, log_1my = clamped.log(), torch.log1p(-clamped)
    if kind == "crossentropy":
        return -t * log_y - (1 - t) * log_1my
    if kind == "scaledmarginalcrossentropy":
        if act == "sigmoid":  # the margins compared on logits: exact and no sigmoid to evaluate
            one = (z < _logit(config.one_target)).to(z.dtype)
            zero = (z > _logit(config.zero_target)).to(z.dtype)
        else:
            y = log_y.exp() if y is None else y
            one, zero = (y < config.one_target).to(z.dtype), (y > config.zero_target).to(z.dtype)
        positive = torch.as_tensor(t, dtype=z.dtype, device=z.device) > 0
        return torch.where(positive, -config.one_scale * one * log_y, -config.zero_scale * zero * log_1my)
    y = torch.sigmoid(z) if y is None else y
    if kind == "l2":
        return 0.5 * (y - t) ** 2
    if kind == "l1":
        return (y - t).abs()
    raise ValueError(f"error function {kind!r} is not known")


def _log_normaliser(z: torch.Tensor, parallel: ItemParallel) -> torch.Tensor:
    """log sum_i exp(z_i) over every process's items, per user ``[B, 1]``, differentiable."""
    local = torch.logsumexp(z, dim=1)
    return torch.logsumexp(parallel.all_gather_same(local), dim=0).unsqueeze(1)


def target_pairs(offsets: torch.Tensor, indices: torch.Tensor, values: torch.Tensor | None, start: int,
                 stop: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(user, local item, target) of every target in ``[start, stop)``."""
    users = torch.repeat_interleave(torch.arange(offsets.numel() - 1, device=indices.device), offsets.diff())
    keep = (indices >= start) & (indices < stop)
    targets = torch.ones(int(keep.sum()), device=indices.device) if values is None else values[keep]
    return users[keep], indices[keep] - start, targets


def sparseness_penalty(config: NetworkConfig, hidden: list[torch.Tensor], batch: int,
                       parallel: ItemParallel) -> torch.Tensor | None:
    """``beta * sum_j KL(p || rho_j)`` over the units of hidden layers marked ``Sparse`` or
    ``SparsenessPenalty``, rho_j = unit j's mean activation over the whole batch. Every process
    adds 1/W of it, so the objective (the sum over processes) holds it once."""
    if config.sparseness_beta <= 0:
        return None
    p = config.sparseness_p
    total = None
    for layer, x in zip(config.hidden, hidden):
        if not (layer.sparse or layer.sparseness_penalty):
            continue
        rho = (parallel.all_gather_same(_wide(x).sum(0)).sum(0) / batch).clamp(_EPS, 1 - _EPS)
        kl = (p * torch.log(max(p, _EPS) / rho) + (1 - p) * torch.log(max(1 - p, _EPS) / (1 - rho))).sum()
        total = kl if total is None else total + kl
    if total is None:
        return None
    return config.sparseness_beta * total / parallel.world_size


def kl_weight_at(variational: Variational | None, step: int) -> float:
    """The KL term's weight for training step ``step`` (the count of steps done before it):
    ``Beta`` reached linearly over ``AnnealSteps`` steps, then held; 0 without a latent. A
    function of the step alone, so a resumed run weighs as the uninterrupted one."""
    if variational is None:
        return 0.0
    if variational.anneal_steps == 0:
        return variational.beta
    return variational.beta * min(1.0, step / variational.anneal_steps)


def kl_divergence(mean: torch.Tensor, log_var: torch.Tensor, batch: int) -> torch.Tensor:
    """KL(N(mean, exp(log_var)) || N(0, I)) summed over latent units and this process's users,
    divided by the global batch size: summed over processes, the batch's mean KL."""
    mean, log_var = _wide(mean), _wide(log_var)
    return 0.5 * (mean * mean + log_var.exp() - 1.0 - log_var).sum() / batch


def batch_loss(model: SparseAutoencoder, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
               targets: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None], dropout_seed: int | None = None,
               negatives: int | None = None, sample_seed: int = 0, kl_weight: float = 0.0) -> torch.Tensor:
    """This process's share of the batch objective (sum over its items, divided by the global
    batch size; plus its share of the sparseness penalty and of ``kl_weight`` times the latent's
    KL term). Summed over processes it is the loss of one process on the whole network, so its
    gradients are the global ones. ``dropout_seed`` (training) switches dropout and the latent's
    sampling on; without it the latent passes on its mean.

    ``negatives``: estimate the zero-target term from that many items drawn uniformly per step
    (shared by the batch's users; this process draws its share of them from its own items) and
    scaled up to the catalogue, instead of scoring every item. An approximation, for catalogues
    in the millions: the estimate is unbiased, its variance falls as ``negatives`` grows."""
    config, parallel = model.config, model.parallel
    offsets = inputs[0]
    batch = offsets.numel() - 1
    hidden_kept: list[torch.Tensor] = []
    latent: list[torch.Tensor] = []
    hidden = model.encode(*inputs, dropout_seed=dropout_seed, keep_hidden=hidden_kept, keep_latent=latent)
    start, stop = model.output_range
    users, items, t = target_pairs(*targets, start, stop)
    if negatives is None:
        z = _wide(model.score(hidden))
        lse = _log_normaliser(z, parallel) if config.output.activation == "softmax" else None
        multinomial = lse is not None and config.error_function == "crossentropy"
        dense = 0.0 if multinomial else elementwise_loss(config, z, 0.0, lse).sum()  # zero targets cost 0 there
        z_pos = z[users, items]
        lse_pos = None if lse is None else lse[users, 0]
    else:
        if config.output.activation == "softmax":
            raise ValueError("sampled negatives (`negatives`) need an element-wise output activation, not SoftMax "
                             "(its normaliser spans every item)")
        n_local = stop - start
        share = max(1, round(negatives * n_local / model.n_output)) if n_local else 0
        generator = torch.Generator(device=hidden.device)
        generator.manual_seed((sample_seed * 1_000_003 + parallel.rank) % (2**63 - 1))
        columns = torch.randint(0, max(n_local, 1), (share,), generator=generator, device=hidden.device)
        z = _wide(model.score(hidden, columns))
        dense = elementwise_loss(config, z, 0.0).sum() * (n_local / max(share, 1))
        weight, bias = model.output_weight[items], model.output_bias[items]
        z_pos = _wide((hidden[users] * weight).sum(1) + bias)
        lse_pos = None
    t = t.to(z_pos.dtype)
    correction = (elementwise_loss(config, z_pos, t, lse_pos) - elementwise_loss(config, z_pos, 0.0, lse_pos)).sum()
    loss = (dense + correction) / batch
    penalty = sparseness_penalty(config, hidden_kept, batch, parallel)
    if penalty is not None:
        loss = loss + penalty
    if latent and kl_weight:
        loss = loss + kl_weight * kl_divergence(*latent, batch)
    return loss
