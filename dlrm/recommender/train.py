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
from typing import Callable, Iterator

import numpy as np
import torch

from dlrm.engine import checkpoint_store as store
from dlrm.engine.checkpoint_store import CheckpointLock
from dlrm.engine.config_check import check_types
from dlrm.engine.logger import RunLogger, format_eta
from dlrm.engine.loop import LoopParts, LoopSettings, Meter, Window, run_loop
from dlrm.recommender import checkpoint
from dlrm.recommender.checkpoint import AutoencoderState
from dlrm.recommender.csr_dataset import CsrDataset
from dlrm.recommender.csr_rows import Csr, take_rows
from dlrm.recommender.loss import batch_loss, kl_weight_at
from dlrm.recommender.metrics import RankingMetrics
from dlrm.recommender.model import SparseAutoencoder
from dlrm.recommender.network import Optimizer


@dataclass
class TrainConfig:
    batch_size: int = 256
    epochs: int = 1
    seed: int = 0
    shuffle: bool = True
    negatives: int | None = None  # sampled negatives per step (an approximation); None scores every item
    amp_dtype: torch.dtype | None = None  # autocast dtype (bf16 on CPU, bf16/fp16 on GPU), None for fp32
    log_every_steps: int = 100
    save_checkpoint_path: str | None = None
    checkpoint_every_steps: int = 0  # 0: at the end of every epoch only
    max_steps: int | None = None  # stop early (benchmarks, tests); the checkpoint still resumes
    best_checkpoint_path: str | None = None  # where the best validation's checkpoint goes
    patience: int | None = None  # validations without a better NDCG@K before the run stops; None: never
    # ... and at least this many steps since the best: on a few hundred users an epoch is a few
    # steps, and patience counted in epochs alone stops a run that is still improving.
    patience_steps: int = 0
    eval_every_steps: int = 0  # validate every this many steps; 0: at the end of every epoch

    def __post_init__(self) -> None:
        check_types(self)  # built from a checked RecommenderConfig; typed again for direct callers

    @property
    def loop(self) -> LoopSettings:
        """The run loop's schedule: a line every ``log_every_steps``, validation and checkpoints
        every so many steps or at the end of each epoch."""
        return LoopSettings(log_every=self.log_every_steps, eval_every=self.eval_every_steps,
                            checkpoint_every=self.checkpoint_every_steps,
                            checkpoint_each_epoch=not self.checkpoint_every_steps)


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


class _AutoencoderRun:
    """The autoencoder's parts of the run loop: batches of users in the epoch's seeded order
    (``epoch_order``, ``take_rows``), the step, NDCG validation with patience and the best
    checkpoint, the checkpoint, and its progress line and summary."""

    def __init__(self, model: SparseAutoencoder, optimizer: torch.optim.Optimizer, inputs: CsrDataset,
                 targets: CsrDataset, cfg: TrainConfig, logger: RunLogger, device: torch.device,
                 state: AutoencoderState, run_config: dict | None, validate: Callable[[], RankingMetrics] | None,
                 train_mask: np.ndarray | None):
        self.model, self.optimizer, self.inputs, self.targets, self.cfg = model, optimizer, inputs, targets, cfg
        self.logger, self.device, self.state, self.run_config = logger, device, state, run_config
        self.validate, self.train_mask = validate, train_mask
        self.n_batches = math.ceil(len(inputs) / cfg.batch_size)
        self.total_steps = self.n_batches * cfg.epochs
        self.start_step, self.start_samples, self.start_time = state.step, state.samples, time.perf_counter()
        self.autocast = (torch.autocast(device.type, dtype=cfg.amp_dtype) if cfg.amp_dtype is not None
                         else contextlib.nullcontext())

    def parts(self) -> LoopParts:
        return LoopParts(
            state=self.state, samples_per_epoch=len(self.inputs),
            empty=f"the input dataset {self.inputs.path} has no users: add data to it", ended=self.ended,
            batches=self.batches, step=self.step, progress=self.progress,
            steps_left=lambda: self.total_steps - self.state.step, summary=self.summary,
            evaluate=self.evaluate if self.validate is not None else None, save=self.save,
            save_path=self.cfg.save_checkpoint_path, loss_dtype=torch.float64, state_tensors=self.state_tensors,
            non_finite_hint="lower `alpha`" + (", or train without `amp`" if self.cfg.amp_dtype is not None else ""))

    def ended(self) -> str | None:
        if self.state.epoch >= self.cfg.epochs:
            return "completed"
        if self.cfg.max_steps is not None and self.state.step - self.start_step >= self.cfg.max_steps:
            return "max_steps"
        return None

    def batches(self) -> Iterator[tuple[int, Csr, Csr]]:
        """The rest of the epoch, up to ``max_steps``, each batch read just before its step (the
        denoising draws from the step it is for)."""
        state, cfg = self.state, self.cfg
        if state.batch >= self.n_batches:  # a checkpoint taken after the epoch's last step
            state.epoch, state.batch = state.epoch + 1, 0
            return
        order = epoch_order(len(self.inputs), cfg.seed, state.epoch, cfg.shuffle)
        last = self.n_batches
        if cfg.max_steps is not None:
            last = min(last, state.batch + cfg.max_steps - (state.step - self.start_step))
        for batch in range(state.batch, last):
            ids = order[batch * cfg.batch_size:(batch + 1) * cfg.batch_size]
            rows = take_rows(self.inputs, ids, self.train_mask)
            y = rows if self.targets is self.inputs else take_rows(self.targets, ids)  # an autoencoder reads once
            x = denoise(rows, self.model.config.denoising_p, cfg.seed, state.step)
            yield len(ids), _to(x, self.device), _to(y, self.device)

    def step(self, batch: tuple[int, Csr, Csr]) -> tuple[torch.Tensor, int, bool]:
        users, x, y = batch
        state, cfg, model = self.state, self.cfg, self.model
        with self.autocast:
            loss = batch_loss(model, x, y, dropout_seed=cfg.seed * 1_000_003 + state.step, negatives=cfg.negatives,
                              sample_seed=cfg.seed * 1_000_003 + state.step,
                              kl_weight=kl_weight_at(model.config.variational, state.step))
        loss.backward()
        model.parallel.sync_gradients(model.replicated_parameters())
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        state.batch, state.step, state.samples = state.batch + 1, state.step + 1, state.samples + users
        epoch_done = state.batch >= self.n_batches
        if epoch_done:
            state.epoch, state.batch = state.epoch + 1, 0
        return loss.detach().double() * users, users, epoch_done

    def progress(self, window: Window, epoch_done: bool) -> None:
        state = self.state
        epoch = state.epoch - epoch_done
        rate = window.samples / max(window.seconds, 1e-9)
        loss = window.loss / window.samples
        left = (self.total_steps - state.step) * self.cfg.batch_size / max(rate, 1e-9)
        self.logger.print(f"epoch {epoch} step {state.step}/{self.total_steps} loss {loss:.5f} {rate:,.0f} users/s "
                          f"eta {format_eta(left)}")
        self.logger.record("train", epoch=epoch, step=state.step, loss=loss, users_per_s=rate)

    def evaluate(self, meter: Meter) -> str | None:
        """Validates and keeps the best checkpoint; "early_stopped" once patience has run out."""
        state, cfg = self.state, self.cfg
        metrics = self.validate()
        self.model.train()
        better = state.best_metric is None or metrics.ndcg > state.best_metric
        if better:
            state.best_metric, state.best_step, state.best_epoch, state.stale = metrics.ndcg, state.step, state.epoch, 0
        else:
            state.stale += 1
        self.logger.print(f"validation at step {state.step} (epoch {state.epoch}): NDCG@{metrics.k} {metrics.ndcg:.4f}  "
                          f"P@{metrics.k} {metrics.precision:.4f}  R@{metrics.k} {metrics.recall:.4f}  over "
                          f"{metrics.users:,} users" + ("  (best)" if better else f"  (best {state.best_metric:.4f} at "
                                                        f"epoch {state.best_epoch}, {state.stale} since)"))
        self.logger.record("validation", step=state.step, epoch=state.epoch, k=metrics.k, ndcg=metrics.ndcg,
                           precision=metrics.precision, recall=metrics.recall, users=metrics.users, best=better)
        if better and cfg.best_checkpoint_path:
            checkpoint.save(cfg.best_checkpoint_path, self.model, self.optimizer, state, self.run_config)
            self.logger.record("checkpoint", path=cfg.best_checkpoint_path, step=state.step)
        patient = (cfg.patience is None or state.stale < cfg.patience
                   or state.step - state.best_step < cfg.patience_steps)
        return None if patient else "early_stopped"

    def state_tensors(self) -> list[torch.Tensor]:
        """What a checkpoint saves: the weights and the optimizer's state."""
        return [*self.model.parameters(), *(value for state in self.optimizer.state.values()
                                            for value in state.values() if torch.is_tensor(value))]

    def save(self) -> None:
        checkpoint.save(self.cfg.save_checkpoint_path, self.model, self.optimizer, self.state, self.run_config)

    def summary(self, meter: Meter) -> dict:
        state = self.state
        seconds = time.perf_counter() - self.start_time
        summary = {"steps": state.step, "epochs": state.epoch, "seconds": seconds,
                   "users_per_s": (state.samples - self.start_samples) / max(seconds, 1e-9)}
        if state.best_metric is not None:
            summary.update(best_validation_ndcg=state.best_metric, best_epoch=state.best_epoch,
                           best_step=state.best_step)
        return summary


def train(model: SparseAutoencoder, optimizer: torch.optim.Optimizer, inputs: CsrDataset, targets: CsrDataset,
          cfg: TrainConfig, logger: RunLogger, device: torch.device, state: AutoencoderState | None = None,
          run_config: dict | None = None, should_stop: Callable[[], bool] = lambda: False,
          validate: Callable[[], RankingMetrics] | None = None, train_mask: np.ndarray | None = None) -> dict:
    """Trains from ``state`` (a fresh run or a loaded checkpoint) and returns the summary.

    ``should_stop()`` is asked between steps (a signal: the run saves and ends "interrupted").
    ``validate()`` ranks a validation split (``dlrm.recommender.validation``) after every epoch
    (or every ``eval_every_steps``); the best NDCG@K's checkpoint goes to
    ``best_checkpoint_path`` and ``patience`` validations without a better one end the run
    ("early_stopped"). ``train_mask`` (bool per stored entry) leaves the validation entries out
    of every batch. The loop's guarantees (the summary record, the save on a stop or an error,
    the refusal of an empty dataset, ``NonFiniteLoss`` when the loss turns non-finite, with the
    last finite checkpoint and best checkpoint kept) are ``run_loop``'s."""
    check_datasets(inputs, targets, model)
    if cfg.amp_dtype == torch.float16:
        raise ValueError("`amp_dtype` float16 needs loss scaling, which the recommender's training loop does not do "
                         "(fp16 gradients underflow): use bfloat16")
    if cfg.batch_size < 1:
        raise ValueError(f"`batch_size` must be >= 1, got {cfg.batch_size}")
    run = _AutoencoderRun(model, optimizer, inputs, targets, cfg, logger, device, state or AutoencoderState(),
                          run_config, validate, train_mask)
    saves = cfg.save_checkpoint_path and model.parallel.rank == 0
    with CheckpointLock(cfg.save_checkpoint_path) if saves else contextlib.nullcontext():
        if saves and len(inputs):
            store.check_can_save(cfg.save_checkpoint_path, store.state_bytes(model))  # before the first step, not at the first save
        model.train()
        return run_loop(run.parts(), cfg.loop, device, logger, model.parallel.collectives(device), should_stop)
