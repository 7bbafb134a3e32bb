"""Training the wide model through the engine's run loop: the product's part is this file.

``run_loop`` (``dlrm.engine.loop``) owns the schedule, the stop on a signal with a checkpoint,
the check for a non-finite loss and the summary; the model brings its batches, its step, its
progress line and its save, as a ``LoopParts``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from dlrm.engine import checkpoint_store as store
from dlrm.engine.collectives import Collectives
from dlrm.engine.config_check import rechecked
from dlrm.engine.logger import RunLogger
from dlrm.engine.loop import LoopParts, LoopSettings, Window, run_loop
from dlrm.wide import checkpoint
from dlrm.wide.checkpoint import WideState
from dlrm.wide.data import WideData, epoch_order, make_data
from dlrm.wide.model import WideModel


@dataclass
class WideConfig:
    """One training run of the wide model; checks itself on construction."""

    field_sizes: tuple[int, ...] = (1000, 300, 50, 7)
    num_samples: int = 4096
    batch_size: int = 256
    epochs: int = 1
    lr: float = 0.5
    seed: int = 0
    max_steps: int | None = None
    log_every_steps: int = 0
    checkpoint_every_steps: int = 0
    save_checkpoint_path: str | None = None
    resume: bool = False  # continue from the checkpoint at save_checkpoint_path when there is one
    overwrite: bool = False  # start over in place of the checkpoint at save_checkpoint_path

    def __post_init__(self) -> None:
        for name in ("num_samples", "batch_size", "epochs"):
            if not getattr(self, name) >= 1:
                raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}")
        if not self.field_sizes or min(self.field_sizes) < 1:
            raise ValueError(f"`field_sizes` must be positive, got {self.field_sizes}")
        if self.resume and self.overwrite:
            raise ValueError("`resume` continues the checkpoint and `overwrite` replaces it: pass one")
        if self.resume and not self.save_checkpoint_path:
            raise ValueError("`resume` continues the checkpoint at `save_checkpoint_path`: pass it")


class _WideRun:
    """The product's side of ``run_loop``: batches, step, progress, save."""

    def __init__(self, model: WideModel, data: WideData, cfg: WideConfig, logger: RunLogger, state: WideState):
        self.model, self.data, self.cfg, self.logger, self.state = model, data, cfg, logger, state
        self.optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
        self.n_batches = -(-len(data.labels) // cfg.batch_size)
        self.window_samples = 0  # the global batches' samples since the last progress line

    def ended(self) -> str | None:
        state, cfg = self.state, self.cfg
        if state.epoch >= cfg.epochs or (cfg.max_steps is not None and state.step >= cfg.max_steps):
            return "completed"
        return None

    def batches(self) -> Iterator[torch.Tensor]:
        order = epoch_order(len(self.data.labels), self.cfg.seed, self.state.epoch)
        for batch in range(self.state.batch, self.n_batches):
            if self.cfg.max_steps is not None and self.state.step >= self.cfg.max_steps:
                return
            yield order[batch * self.cfg.batch_size:(batch + 1) * self.cfg.batch_size]

    def step(self, samples: torch.Tensor) -> tuple[torch.Tensor, int, bool]:
        model, state = self.model, self.state
        start, stop = model.sample_range(len(samples))
        logits = model(self.data.ids[samples])  # the whole batch's ids; my samples' logits back
        labels = self.data.labels[samples[start:stop]]
        loss_sum = F.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
        (loss_sum / len(samples)).backward()  # this process's share of the global batch's mean
        model.collectives.sync_gradients(model)  # the replicated bias: the engine calls the contract
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        state.step, state.batch = state.step + 1, state.batch + 1
        self.window_samples += len(samples)
        epoch_done = state.batch >= self.n_batches
        if epoch_done:
            state.epoch, state.batch = state.epoch + 1, 0
        return loss_sum.detach().double(), stop - start, epoch_done

    def progress(self, window: Window, epoch_done: bool) -> None:
        # The window's loss is summed over every process, its samples are this process's: divide
        # by the global batches' samples, so that N processes print the loss one process does.
        loss, self.window_samples = window.loss / max(self.window_samples, 1), 0
        self.logger.print(f"step {self.state.step} loss {loss:.5f}")
        self.logger.record("train", step=self.state.step, loss=loss)

    def steps_left(self) -> float:
        left = (self.cfg.epochs - self.state.epoch) * self.n_batches - self.state.batch
        return left if self.cfg.max_steps is None else min(left, self.cfg.max_steps - self.state.step)

    def save(self) -> None:
        checkpoint.save(self.cfg.save_checkpoint_path, self.model, self.state)

    def parts(self) -> LoopParts:
        return LoopParts(
            state=self.state, samples_per_epoch=len(self.data.labels), empty="the wide model's data has no samples",
            ended=self.ended, batches=self.batches, step=self.step, progress=self.progress,
            steps_left=self.steps_left, summary=lambda meter: {"steps": self.state.step, "epochs": self.state.epoch},
            save=self.save if self.cfg.save_checkpoint_path else None, save_path=self.cfg.save_checkpoint_path,
            state_tensors=lambda: list(self.model.parameters()))


def train(cfg: WideConfig, collectives: Collectives = Collectives(), logger: RunLogger | None = None,
          should_stop: Callable[[], bool] = lambda: False) -> tuple[WideModel, dict[str, Any]]:
    """Trains (or, with ``resume``, continues) a wide model on this process's part of
    ``collectives``; returns the model and the run's summary."""
    cfg = rechecked(cfg)  # checked again: a setting may have changed since the config was built
    data = make_data(cfg.num_samples, cfg.field_sizes, cfg.seed)
    model = WideModel(sum(cfg.field_sizes), collectives, cfg.seed)
    state = WideState()
    path = cfg.save_checkpoint_path
    if path is not None:  # before any work: a folder of anything else is refused, never written into
        store.claim_checkpoint_path(path, checkpoint.FORMAT, replace=cfg.overwrite, keep=cfg.resume)
    if cfg.resume and store.latest_checkpoint(path) is not None:
        state = checkpoint.load(store.latest_checkpoint(path), model)
    logger = logger or RunLogger(None)
    run = _WideRun(model, data, cfg, logger, state)
    saves = path is not None and collectives.rank == 0
    with store.CheckpointLock(path) if saves else contextlib.nullcontext():
        settings = LoopSettings(log_every=cfg.log_every_steps, checkpoint_every=cfg.checkpoint_every_steps)
        summary = run_loop(run.parts(), settings, torch.device("cpu"), logger, collectives, should_stop)
    return model, summary
