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
from typing import Callable

import numpy as np
import torch

from dlrm.data.atomic import StorageError
from dlrm.data.csr_dataset import CsrDataset
from dlrm.data.errors import DatasetError
from dlrm.recommender import checkpoint
from dlrm.recommender.checkpoint import AutoencoderState
from dlrm.recommender.loss import batch_loss, kl_weight_at
from dlrm.recommender.metrics import RankingMetrics
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
    best_checkpoint_path: str | None = None  # where the best validation's checkpoint goes
    patience: int | None = None  # validations without a better NDCG@K before the run stops; None: never
    validate_every_steps: int = 0  # 0: validate at the end of every epoch


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


def take_rows(dataset: CsrDataset, samples: np.ndarray, keep: np.ndarray | None = None) -> Csr:
    """The CSR of the given samples, in the given order (ids of the memory-mapped dataset);
    ``keep`` (bool per stored entry) leaves out the entries where it is False (a validation split)."""
    starts = np.asarray(dataset.offsets[samples], dtype=np.int64)
    lengths = np.asarray(dataset.offsets[samples + 1], dtype=np.int64) - starts
    offsets = np.zeros(len(samples) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    positions = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1], dtype=np.int64)
    if keep is not None:
        kept = keep[positions]
        rows = np.repeat(np.arange(len(samples), dtype=np.int64), lengths)
        np.cumsum(np.bincount(rows[kept], minlength=len(samples)), out=offsets[1:])
        positions = positions[kept]
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
          run_config: dict | None = None, should_stop: Callable[[], bool] = lambda: False,
          validate: Callable[[], RankingMetrics] | None = None, train_mask: np.ndarray | None = None) -> dict:
    """Trains from ``state`` (a fresh run or a loaded checkpoint) and returns the summary.

    ``should_stop()`` is asked between steps (a signal: the run saves and ends "interrupted").
    ``validate()`` ranks a validation split (``dlrm.recommender.validation``) after every epoch
    (or every ``validate_every_steps``); the best NDCG@K's checkpoint goes to
    ``best_checkpoint_path`` and ``patience`` validations without a better one end the run
    ("early_stopped"). ``train_mask`` (bool per stored entry) leaves the validation entries out
    of every batch. Whatever ends the run, the log gets a ``summary`` record with the reason; an
    error after a step of a one-process run saves a checkpoint first."""
    check_datasets(inputs, targets, model)
    if cfg.amp_dtype == torch.float16:
        raise ValueError("`amp_dtype` float16 needs loss scaling, which the recommender's training loop does not do "
                         "(fp16 gradients underflow): use bfloat16")
    if cfg.batch_size < 1:
        raise ValueError(f"`batch_size` must be >= 1, got {cfg.batch_size}")
    if len(inputs) == 0:
        raise DatasetError(f"the input dataset {inputs.path} has no users: add data to it")
    state = state or AutoencoderState()
    parallel, network = model.parallel, model.config
    collectives = parallel.collectives(device)
    n = len(inputs)
    batches = math.ceil(n / cfg.batch_size)
    lock = CheckpointLock(cfg.checkpoint_path) if cfg.checkpoint_path and parallel.rank == 0 else None
    autocast = (torch.autocast(device.type, dtype=cfg.amp_dtype) if cfg.amp_dtype is not None
                else contextlib.nullcontext())
    start_step, start_samples, start_time = state.step, state.samples, time.perf_counter()
    # The window's loss stays on the device until a log line needs it: no sync, no all-reduce per step.
    window_loss, window_users, window_time = torch.zeros((), dtype=torch.float64, device=device), 0, time.perf_counter()
    total_steps = batches * cfg.epochs
    stop_reason, error, saved_step = "completed", None, state.step

    def save(path: str | None = cfg.checkpoint_path) -> None:
        nonlocal saved_step
        checkpoint.save(path, model, optimizer, state, run_config)
        logger.record("checkpoint", path=path, step=state.step)
        if path == cfg.checkpoint_path:
            saved_step = state.step

    def run_validation() -> bool:
        """Validates, keeps the best checkpoint; True when patience has run out."""
        metrics = validate()
        model.train()
        better = state.best_metric is None or metrics.ndcg > state.best_metric
        if better:
            state.best_metric, state.best_step, state.best_epoch, state.stale = metrics.ndcg, state.step, state.epoch, 0
        else:
            state.stale += 1
        logger.print(f"validation at step {state.step} (epoch {state.epoch}): NDCG@{metrics.k} {metrics.ndcg:.4f}  "
                     f"P@{metrics.k} {metrics.precision:.4f}  R@{metrics.k} {metrics.recall:.4f}  over "
                     f"{metrics.users:,} users" + ("  (best)" if better else f"  (best {state.best_metric:.4f} at "
                                                   f"epoch {state.best_epoch}, {state.stale} since)"))
        logger.record("validation", step=state.step, epoch=state.epoch, k=metrics.k, ndcg=metrics.ndcg,
                      precision=metrics.precision, recall=metrics.recall, users=metrics.users, best=better)
        if better and cfg.best_checkpoint_path:
            save(cfg.best_checkpoint_path)
        return cfg.patience is not None and state.stale >= cfg.patience

    try:
        with lock if lock is not None else contextlib.nullcontext():
            if lock is not None:
                check_can_save(cfg.checkpoint_path, model)  # before the first step, not at the first save
            model.train()
            while state.epoch < cfg.epochs and stop_reason == "completed":
                order = epoch_order(n, cfg.seed, state.epoch, cfg.shuffle)
                while state.batch < batches:
                    if cfg.max_steps is not None and state.step - start_step >= cfg.max_steps:
                        stop_reason = "max_steps"
                        break
                    ids = order[state.batch * cfg.batch_size:(state.batch + 1) * cfg.batch_size]
                    rows = take_rows(inputs, ids, train_mask)
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
                    if validate is not None and cfg.validate_every_steps and state.step % cfg.validate_every_steps == 0:
                        if run_validation():
                            stop_reason = "early_stopped"
                    if cfg.checkpoint_path and cfg.checkpoint_every_steps and state.step % cfg.checkpoint_every_steps == 0:
                        save()
                    if stop_reason == "completed" and collectives.any(should_stop()):
                        stop_reason = "interrupted"
                    if stop_reason != "completed":
                        break
                if stop_reason != "completed":
                    break
                state.epoch += 1
                state.batch = 0
                if validate is not None and not cfg.validate_every_steps and run_validation():
                    stop_reason = "early_stopped"
                if cfg.checkpoint_path and not cfg.checkpoint_every_steps:
                    save()
                if stop_reason == "completed" and collectives.any(should_stop()):
                    stop_reason = "interrupted"
            if cfg.checkpoint_path and state.step > saved_step:
                save()  # where it stopped, unless that step was just saved
    except BaseException as e:
        stop_reason, error = ("error", e) if isinstance(e, Exception) else ("aborted", e)
        # One process only: peers of a failed process may be blocked in a collective, and a save
        # needs all of them. A save the file system refused is not tried again.
        if (isinstance(e, Exception) and not isinstance(e, StorageError) and parallel.world_size == 1
                and cfg.checkpoint_path and state.step > saved_step):
            try:
                save()
            except Exception as save_error:  # noqa: BLE001 - the original error is what the user needs
                logger.print(f"Could not save a checkpoint after the error: {save_error}")
        raise
    finally:
        seconds = time.perf_counter() - start_time
        summary = {"stop_reason": stop_reason, "steps": state.step, "epochs": state.epoch, "seconds": seconds,
                   "users_per_s": (state.samples - start_samples) / max(seconds, 1e-9)}
        if state.best_metric is not None:
            summary.update(best_validation_ndcg=state.best_metric, best_epoch=state.best_epoch,
                           best_step=state.best_step)
        if error is not None:
            summary["error"] = f"{type(error).__name__}: {error}"
        logger.record("summary", **summary)
    return summary
