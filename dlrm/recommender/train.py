"""The autoencoder's training loop: batches of users from CSR datasets, one optimizer step per
batch, checkpoints that resume exactly, progress in the run log.

Every random choice (the epoch's user order, denoising, dropout masks, sampled negatives) comes
from a generator seeded by the run seed and the step or epoch, never from a running stream, so a
resumed run draws what the uninterrupted one would have, and every process draws the same.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from dlrm.data.csr_dataset import CsrDataset
from dlrm.recommender import checkpoint
from dlrm.recommender.checkpoint import AutoencoderState
from dlrm.recommender.loss import batch_loss, kl_weight_at
from dlrm.recommender.model import SparseAutoencoder
from dlrm.recommender.network import Optimizer
from dlrm.training.checkpoint import CheckpointLock, check_can_save
from dlrm.training.logger import RunLogger, format_eta

Csr = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


@dataclass
class TrainConfig:
    batch_size: int = 256
    epochs: int = 1
    seed: int = 0
    shuffle: bool = True
    negatives: int | None = None  # sampled negatives per step (an approximation); None scores every item
    amp_dtype: torch.dtype | None = None  # autocast dtype (bf16 on CPU, bf16/fp16 on GPU), None for fp32
    log_every_steps: int = 100
    checkpoint_path: str | None = None
    checkpoint_every_steps: int = 0  # 0: at the end of every epoch only
    max_steps: int | None = None  # stop early (benchmarks, tests); the checkpoint still resumes


def make_optimizer(model: SparseAutoencoder, config: Optimizer) -> torch.optim.Optimizer:
    """DSSTNE's training modes on torch.optim; ``Lambda`` (L2 weight decay) applies to weights,
    not biases, as in DSSTNE."""
    weights = [model.input_weight, model.output_weight, *(layer.weight for layer in model.hidden)]
    biases = [model.input_bias, model.output_bias, *(layer.bias for layer in model.hidden)]
    groups = [{"params": weights, "weight_decay": config.lambda_}, {"params": biases, "weight_decay": 0.0}]
    kind, lr = config.kind, config.alpha
    # torch's fused kernels update every row in one pass: 5x faster than the per-tensor loop on
    # CPU for the item layers, whose every row is updated every step (docs/benchmarks.md).
    fused = {"fused": True}
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=lr, **fused)
    if kind in ("momentum", "nesterov"):
        return torch.optim.SGD(groups, lr=lr, momentum=config.mu, nesterov=kind == "nesterov", **fused)
    if kind == "adagrad":
        return torch.optim.Adagrad(groups, lr=lr, eps=config.epsilon, **fused)
    if kind == "rmsprop":  # no fused kernel in torch
        return torch.optim.RMSprop(groups, lr=lr, alpha=config.mu, eps=config.epsilon, foreach=True)
    if kind == "adam":
        return torch.optim.Adam(groups, lr=lr, betas=(config.beta1, config.beta2), eps=config.epsilon, **fused)
    raise ValueError(f"optimizer {kind!r} is not known")


def take_rows(dataset: CsrDataset, samples: np.ndarray) -> Csr:
    """The CSR of the given samples, in the given order (ids of the memory-mapped dataset)."""
    starts = np.asarray(dataset.offsets[samples], dtype=np.int64)
    lengths = np.asarray(dataset.offsets[samples + 1], dtype=np.int64) - starts
    offsets = np.zeros(len(samples) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    positions = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1], dtype=np.int64)
    indices = torch.from_numpy(np.asarray(dataset.indices[positions], dtype=np.int64))
    values = None if dataset.values is None else torch.from_numpy(np.asarray(dataset.values[positions], np.float32))
    return torch.from_numpy(offsets), indices, values


def _generator(seed: int, stream: int, step: int) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed((seed * 1_000_003 + stream * 7_919 + step) % (2**63 - 1))
    return generator


def epoch_order(n_samples: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    if not shuffle:
        return np.arange(n_samples, dtype=np.int64)
    return torch.randperm(n_samples, generator=_generator(seed, 1, epoch)).numpy()


def denoise(inputs: Csr, p: float, seed: int, step: int) -> Csr:
    """Drops each input feature with probability ``p`` (DSSTNE's ``Denoising``), the same
    features on every process."""
    offsets, indices, values = inputs
    if p <= 0 or indices.numel() == 0:
        return inputs
    keep = torch.rand(indices.numel(), generator=_generator(seed, 2, step)) >= p
    rows = torch.repeat_interleave(torch.arange(offsets.numel() - 1), offsets.diff())
    counts = torch.bincount(rows[keep], minlength=offsets.numel() - 1)
    return (torch.cat([offsets.new_zeros(1), counts.cumsum(0)]), indices[keep],
            None if values is None else values[keep])


def _to(csr: Csr, device: torch.device) -> Csr:
    return tuple(None if t is None else t.to(device, non_blocking=True) for t in csr)  # type: ignore[return-value]


def check_datasets(inputs: CsrDataset, targets: CsrDataset, model: SparseAutoencoder) -> None:
    if len(inputs) != len(targets):
        raise ValueError(f"the input dataset {inputs.path} has {len(inputs)} samples and the output dataset "
                         f"{targets.path} {len(targets)}: they must hold the same samples in the same order")
    for what, dataset, n in (("input", inputs, model.n_input), ("output", targets, model.n_output)):
        if dataset.n_features != n:
            raise ValueError(f"the {what} dataset {dataset.path} has {dataset.n_features} features, the network's "
                             f"{what} layer {n}: use the dataset it was built for, or `N` \"auto\"")


def train(model: SparseAutoencoder, optimizer: torch.optim.Optimizer, inputs: CsrDataset, targets: CsrDataset,
          cfg: TrainConfig, logger: RunLogger, device: torch.device, state: AutoencoderState | None = None,
          run_config: dict | None = None) -> dict:
    """Trains from ``state`` (a fresh run or a loaded checkpoint) and returns the summary."""
    check_datasets(inputs, targets, model)
    if cfg.amp_dtype == torch.float16:
        raise ValueError("`amp_dtype` float16 needs loss scaling, which the recommender's training loop does not do "
                         "(fp16 gradients underflow): use bfloat16")
    if cfg.batch_size < 1:
        raise ValueError(f"`batch_size` must be >= 1, got {cfg.batch_size}")
    state = state or AutoencoderState()
    parallel, network = model.parallel, model.config
    n = len(inputs)
    batches = math.ceil(n / cfg.batch_size)
    lock = CheckpointLock(cfg.checkpoint_path) if cfg.checkpoint_path and parallel.rank == 0 else None
    autocast = (torch.autocast(device.type, dtype=cfg.amp_dtype) if cfg.amp_dtype is not None
                else contextlib.nullcontext())
    start_step, start_samples, start_time = state.step, state.samples, time.perf_counter()
    # The window's loss stays on the device until a log line needs it: no sync, no all-reduce per step.
    window_loss, window_users, window_time = torch.zeros((), dtype=torch.float64, device=device), 0, time.perf_counter()
    total_steps = batches * cfg.epochs
    stop_reason = "completed"

    def save() -> None:
        checkpoint.save(cfg.checkpoint_path, model, optimizer, state, run_config)
        logger.record("checkpoint", path=cfg.checkpoint_path, step=state.step)

    with lock if lock is not None else contextlib.nullcontext():
        if lock is not None:
            check_can_save(cfg.checkpoint_path, model)  # before the first step, not at the first save
        model.train()
        while state.epoch < cfg.epochs:
            order = epoch_order(n, cfg.seed, state.epoch, cfg.shuffle)
            while state.batch < batches:
                if cfg.max_steps is not None and state.step - start_step >= cfg.max_steps:
                    stop_reason = "max_steps"
                    break
                ids = order[state.batch * cfg.batch_size:(state.batch + 1) * cfg.batch_size]
                rows = take_rows(inputs, ids)
                y = rows if targets is inputs else take_rows(targets, ids)  # an autoencoder reads its rows once
                x = denoise(rows, network.denoising_p, cfg.seed, state.step)
                with autocast:
                    loss = batch_loss(model, _to(x, device), _to(y, device),
                                      dropout_seed=cfg.seed * 1_000_003 + state.step, negatives=cfg.negatives,
                                      sample_seed=cfg.seed * 1_000_003 + state.step,
                                      kl_weight=kl_weight_at(network.variational, state.step))
                loss.backward()
                parallel.sync_gradients(model.replicated_parameters())
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                state.batch += 1
                state.step += 1
                state.samples += len(ids)
                window_loss += loss.detach().double() * len(ids)
                window_users += len(ids)
                if cfg.log_every_steps and state.step % cfg.log_every_steps == 0:
                    now = time.perf_counter()
                    rate = window_users / max(now - window_time, 1e-9)
                    mean_loss = float(parallel.sum(window_loss)) / window_users
                    left = (total_steps - state.step) * cfg.batch_size / max(rate, 1e-9)
                    logger.print(f"epoch {state.epoch} step {state.step}/{total_steps} loss "
                                 f"{mean_loss:.5f} {rate:,.0f} users/s eta {format_eta(left)}")
                    logger.record("train", epoch=state.epoch, step=state.step, loss=mean_loss, users_per_s=rate)
                    window_loss, window_users, window_time = torch.zeros_like(window_loss), 0, now
                if cfg.checkpoint_path and cfg.checkpoint_every_steps and state.step % cfg.checkpoint_every_steps == 0:
                    save()
            if stop_reason != "completed":
                break
            state.epoch += 1
            state.batch = 0
            if cfg.checkpoint_path and not cfg.checkpoint_every_steps:
                save()
        if cfg.checkpoint_path and state.step > start_step and (
                stop_reason != "completed" or (cfg.checkpoint_every_steps and state.step % cfg.checkpoint_every_steps)):
            save()  # where it stopped, unless that step was just saved
    seconds = time.perf_counter() - start_time
    summary = {"stop_reason": stop_reason, "steps": state.step, "epochs": state.epoch, "seconds": seconds,
               "users_per_s": (state.samples - start_samples) / max(seconds, 1e-9)}
    logger.record("summary", **summary)
    return summary
