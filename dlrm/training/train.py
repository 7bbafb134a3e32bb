"""The training loop: one batch from the loader to the loss to the update, plus evaluation.

A reader follows a step here top to bottom: ``train_step`` is the whole update, ``evaluate`` the
whole test pass, and ``train`` hands them to the run loop both products share
(``dlrm.engine.loop``: printing, testing, checkpointing, stopping) as DLRM's loop parts.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F

from dlrm.data.batch import Batch
from dlrm.data.loader import PrefetchLoader, remaining_batches
from dlrm.data.metrics import roc_auc
from dlrm.engine.collectives import Collectives
from dlrm.engine.config_check import check_float32, check_types
from dlrm.engine.logger import RunLogger, format_eta
from dlrm.engine.loop import LoopParts, LoopSettings, Meter, Window, run_loop, synchronize
from dlrm.model.precision import Precision
from dlrm.nn.cached_embedding import prefetching
from dlrm.training import nvidia_checkpoint
from dlrm.training.checkpoint import CheckpointError, TrainState, check_can_save, save_checkpoint
from dlrm.training.cuda_graphs import GraphedInference, GraphedTrainStep, check_cuda_graphs_supported
from dlrm.training.grad_scaler import DeviceScalerState
from dlrm.training.lr_schedule import LRSchedule
from dlrm.training.optimizers import device_dense_step_


# Steps after which a run shows its first progress line when ``log_every_steps`` (NVIDIA's
# --print_freq, 200 by default) would make it wait longer: a CPU run's 200 steps take minutes.
FIRST_LINE_AFTER = 5


@dataclass
class TrainConfig:
    schedule: LRSchedule
    epochs: int = 1
    max_steps: int | None = None
    eval_every_steps: int | None = None  # steps between tests; None tests at the end of each epoch
    test_after: float = 0.0  # no test before this many epochs are done
    log_every_steps: int = 200  # steps between progress lines
    benchmark_warmup_steps: int = 0  # steps left out of the throughput figures
    auc_threshold: float | None = None  # stop once a test reaches this AUC
    shuffle_batch_order: bool = False  # a seeded order each epoch (``train``'s ``seed``)
    save_checkpoint_path: str | None = None
    checkpoint_every_steps: int | None = None  # steps between checkpoints (besides the final one)
    prefetch: int = 2
    cuda_graphs: bool = False  # capture the training step and the test forward (CUDA, joint_fused)
    auc_device: str | None = None  # where tests compute the AUC (None: the device holding the scores)
    # "dlrm": this program's checkpoint; "nvidia": NVIDIA's layout (dlrm.training.nvidia_checkpoint), weights only
    checkpoint_format: str = "dlrm"

    def __post_init__(self) -> None:
        check_types(self)  # its other bounds: RunConfig's (dlrm.training.run_config), with the other parts'
        check_float32(lr=self.schedule.lr, decay_end_lr=self.schedule.decay_end_lr)  # the step's arithmetic

    @property
    def loop(self) -> LoopSettings:
        """The run loop's schedule: a line every ``log_every_steps``, tests every
        ``eval_every_steps`` (or at each epoch's end), checkpoints every ``checkpoint_every_steps``,
        and the last step reported and tested."""
        return LoopSettings(log_every=self.log_every_steps, eval_every=self.eval_every_steps or 0,
                            checkpoint_every=self.checkpoint_every_steps or 0, report_last_step=True,
                            warmup_steps=self.benchmark_warmup_steps, first_line_after=FIRST_LINE_AFTER)


@dataclass
class EvalResult:
    auc: float
    loss: float
    samples: int
    seconds: float

    @property
    def throughput(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else float("nan")


def bce_loss(logits: torch.Tensor, label: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Binary cross-entropy on logits, in at least float32 whatever the autocast dtype."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.binary_cross_entropy_with_logits(logits, label.to(logits.dtype), reduction=reduction)


def global_batch_loss(model: torch.nn.Module, batch: Batch, precision: Precision, autocast_cache: bool = True) -> torch.Tensor:
    """The forward pass and this process's share of the mean loss over the global batch
    (``batch.categorical`` has one row per sample of the global batch, ``label`` only ours)."""
    with precision.autocast(cache_enabled=autocast_cache):
        logits = model(batch.numerical, batch.categorical)
    return bce_loss(logits, batch.label, reduction="sum") / batch.categorical_rows


def _backward(model: torch.nn.Module, batch: Batch, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
              precision: Precision, collectives: Collectives, autocast_cache: bool = True) -> torch.Tensor:
    """The loss and its (scaled) gradients, summed over processes: the first half of both steps."""
    loss = global_batch_loss(model, batch, precision, autocast_cache)
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    collectives.sync_gradients(model)
    return loss


def train_step(
    model: torch.nn.Module,
    batch: Batch,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    precision: Precision,
    collectives: Collectives = Collectives(),
) -> torch.Tensor:
    """Forward, backward and update on one batch; returns this process's share of the mean loss.

    The loss is the mean over the global batch (``batch.categorical`` has one row per sample of
    the global batch; ``label`` only this process's rows), so with gradients summed across
    processes a distributed step equals a single-device step on the same batch.
    """
    loss = _backward(model, batch, optimizer, scaler, precision, collectives)
    scaler.step(optimizer)  # skipped as a whole when fp16 gradients overflowed
    scaler.update()
    return loss.detach()


def fused_train_step(
    model: torch.nn.Module,
    batch: Batch,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    precision: Precision,
    collectives: Collectives = Collectives(),
    lr: torch.Tensor | None = None,
    autocast_cache: bool = True,
    rounding_step: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same update as ``train_step`` for models with ``joint_fused`` embeddings, with no host
    synchronisation and no data-dependent shape: what ``--cuda_graphs`` captures.

    The embeddings update their own rows (fused kernels, no sparse gradient): SGD, or row-wise
    Adagrad on the accumulator the optimizer holds for them (``fused_rowwise_state``, the state
    checkpoints save per table). The dense SGD or Adagrad update is written out with device-side
    tensors on the torch optimizer's own state (``device_dense_step_``). With fp16 loss scaling the
    overflow check, the skip of every update and the scale update happen on the device too, with
    the GradScaler's own state, so checkpoints and the ``train_step`` path stay interchangeable.
    ``optimizer`` is ``make_optimizer``'s; ``lr`` is a 0-dim float32 device tensor (defaults to
    the dense group's current lr); ``autocast_cache=False`` while a CUDA graph captures the step;
    ``rounding_step`` (0-dim int64 device tensor, or None: to nearest) keys the stochastic rounding
    of bf16 tables (``CombinedOptimizer.take_rounding_step``). A part the optimizer's config
    freezes (``freeze_dense``, ``freeze_embeddings``) is left as it is.
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    device = params[0].device
    if lr is None:
        lr = torch.tensor(optimizer.param_groups[0]["lr"], dtype=torch.float32, device=device)
    fused = model.fused_embeddings()
    loss = _backward(model, batch, optimizer, scaler, precision, collectives, autocast_cache)
    with torch.no_grad():  # the updates below are in place on leaf weights
        grads = [p.grad for p in params if p.grad is not None]
        skip, grad_scale, scaler_state = None, 1.0, None
        if scaler.is_enabled():
            scaler_state = DeviceScalerState(scaler)
            found_inf = torch.zeros(1, dtype=torch.float32, device=device)
            grad_scale = scaler_state.unscale_and_check_(grads, found_inf).reshape(())
            for embedding in fused:
                found_inf += embedding.pending_nonfinite().to(device).float()  # host tables: a CPU flag
            found_inf = collectives.sum(found_inf)  # each process holds other tables: all skip together
            skip = found_inf.reshape(()) > 0
        config = getattr(optimizer, "config", None)
        if not getattr(config, "freeze_dense", False):
            device_dense_step_(optimizer, lr, skip)
        for embedding in fused:
            if getattr(config, "freeze_embeddings", False):
                embedding.discard_pending_()  # frozen: the gradients are computed, never applied
                continue
            state, eps = optimizer.fused_rowwise_state(embedding.weight)
            embedding.apply_update_(lr, grad_scale, skip, rowwise_state=state, eps=eps, rounding_step=rounding_step)
        if scaler_state is not None:
            scaler_state.update_(found_inf)
    return loss.detach()


def make_train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    precision: Precision,
    collectives: Collectives = Collectives(),
    cuda_graphs: bool = False,
    max_bag_values: int | None = None,
) -> Callable[[Batch], torch.Tensor]:
    """``step(batch) -> loss``: ``train_step`` for sparse-gradient embeddings, ``fused_train_step``
    for ``joint_fused`` ones, captured in a CUDA graph with ``cuda_graphs`` (``max_bag_values``:
    the most multi-hot ids a batch can hold, ``fixed_bag_limit``, so that full bags are not
    padded; the step's ``graphed`` attribute is its ``GraphedTrainStep``)."""
    device = next(model.parameters()).device
    if cuda_graphs:
        check_cuda_graphs_supported(model, device, collectives.world_size)
    if not model.fused_embeddings():
        return lambda batch: train_step(model, batch, optimizer, scaler, precision, collectives)
    lr = torch.zeros((), dtype=torch.float32, device=device)
    stochastic = getattr(getattr(optimizer, "config", None), "stochastic_rounding", False)
    rounding_step = torch.zeros((), dtype=torch.int64, device=device) if stochastic else None

    def fused(batch: Batch, capturing: bool = False) -> torch.Tensor:
        return fused_train_step(model, batch, optimizer, scaler, precision, collectives, lr, not capturing,
                                rounding_step)

    run = GraphedTrainStep(fused, max_bag_values=max_bag_values) if cuda_graphs else fused

    def step(batch: Batch) -> torch.Tensor:
        # outside any graph: the schedule moves the lr, and the rounding key changes, every step
        lr.fill_(optimizer.param_groups[0]["lr"])
        if rounding_step is not None:
            rounding_step.fill_(optimizer.take_rounding_step())
        return run(batch)

    step.graphed = run if cuda_graphs else None
    return step


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    source: Any,
    device: torch.device,
    precision: Precision,
    prefetch: int = 2,
    collectives: Collectives = Collectives(),
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    auc_device: torch.device | str | None = None,
) -> EvalResult:
    """AUC and mean log loss over a whole split; scores stay on the device until the AUC, which
    every process computes over all processes' samples, on ``auc_device`` (None: where the scores
    are; "cpu" spares the device's memory the sort of a large split, same value). ``forward``
    replaces ``model``'s own (e.g. a ``GraphedInference`` of it); autocast is then up to it."""
    was_training = model.training
    model.eval()
    synchronize(device)
    start = time.perf_counter()
    scores, labels = [], []
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    loader = PrefetchLoader(source, range(len(source)), device, prefetch)
    try:
        for batch in loader:
            if forward is not None:
                logits = forward(batch.numerical, batch.categorical)
            else:
                with precision.autocast():
                    logits = model(batch.numerical, batch.categorical)
            loss_sum += bce_loss(logits, batch.label, reduction="sum").double()
            scores.append(logits.float().reshape(-1))
            labels.append(batch.label.reshape(-1))
    finally:
        loader.close()
    scores = collectives.gather(torch.cat(scores) if scores else torch.zeros(0, device=device))
    labels = collectives.gather(torch.cat(labels).float() if labels else torch.zeros(0, device=device))
    samples = scores.numel()
    if auc_device is not None:
        scores, labels = scores.to(auc_device), labels.to(auc_device)
    auc = roc_auc(labels, scores) if samples else float("nan")
    loss = float(collectives.sum(loss_sum)) / samples if samples else float("nan")
    synchronize(device)
    model.train(was_training)
    return EvalResult(auc=auc, loss=loss, samples=samples, seconds=time.perf_counter() - start)


def _check_resumable(state: TrainState, batch_size: int, cfg: TrainConfig) -> None:
    """A shuffled epoch is an order of batches of one size: another size cannot continue it."""
    if cfg.shuffle_batch_order and state.sample_in_epoch and state.batch_size != batch_size:
        raise CheckpointError(
            f"the checkpoint stopped {state.sample_in_epoch} samples into epoch {state.epoch}, whose shuffled batch "
            f"order is of batches of {state.batch_size} samples: resume with `batch_size={state.batch_size}` "
            "(a different batch size can continue in unshuffled order, or from the start of an epoch)"
        )


def _throughput_text(summary: dict[str, Any], warmup_steps: int) -> str:
    """The summary's figures in words; a figure with nothing timed behind it says so instead of nan."""
    train = summary["average_train_throughput"]
    test = summary["average_test_throughput"]
    train_text = (f"average train throughput {train:,.0f} samples/s" if not math.isnan(train) else
                  f"no train step timed (the first {warmup_steps} steps are warm-up, left out of the figure)"
                  if warmup_steps else "no train step run")
    test_text = f"average test throughput {test:,.0f} samples/s" if not math.isnan(test) else "no test run"
    return f"{train_text}  {test_text}"




class _DlrmRun:
    """DLRM's parts of the run loop: batches from a sample position (``remaining_batches``, read
    ahead by a ``PrefetchLoader``), the learning-rate schedule and the step, the AUC test, the
    checkpoint, and its progress line and summary."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                 precision: Precision, train_source: Any, test_source: Any | None, cfg: TrainConfig,
                 device: torch.device, logger: RunLogger, state: TrainState, run_config: dict[str, Any] | None,
                 collectives: Collectives, seed: int):
        self.model, self.optimizer, self.scaler, self.precision = model, optimizer, scaler, precision
        self.train_source, self.test_source, self.cfg, self.device = train_source, test_source, cfg, device
        self.logger, self.state, self.run_config, self.collectives = logger, state, run_config, collectives
        self.seed = seed
        self.batch_size, self.num_samples = train_source.batch_size, train_source.num_samples
        self.steps_per_epoch = len(train_source)
        self.max_steps = cfg.max_steps if cfg.max_steps is not None else math.inf
        self.final_step: float = 0
        self.lr = cfg.schedule.lr_at(state.step + 1)
        self.step_fn: Callable[[Batch], torch.Tensor] | None = None  # set by ``train`` once the checks pass
        self.eval_forward = GraphedInference(model, precision) if cfg.cuda_graphs else None
        self.test_seconds: list[float] = []  # each test's time, for the ETA
        self.scaler_state = DeviceScalerState(scaler) if scaler.is_enabled() else None

    def parts(self) -> LoopParts:
        return LoopParts(
            state=self.state, samples_per_epoch=self.steps_per_epoch,
            empty="the training split has no samples: add data to it", ended=self.ended, batches=self.batches,
            step=self.step, progress=self.progress, steps_left=lambda: self.final_step - self.state.step,
            summary=self.summary, evaluate=self.evaluate if self.test_source is not None else None,
            save=self.save, save_path=self.cfg.save_checkpoint_path, finish_line=self.finish_line,
            state_tensors=self.state_tensors, loss_scale=self.loss_scale if self.scaler_state is not None else None,
            non_finite_hint=self.non_finite_hint())

    def state_tensors(self) -> list[torch.Tensor]:
        """What a checkpoint saves: the parameters, the floating-point buffers (a host table's
        device cache holds rows newer than the table) and the optimizers' state."""
        optimizers = [getattr(self.optimizer, name, None) for name in ("dense", "embeddings", "fused")]
        states = [state for opt in ([o for o in optimizers if o is not None] or [self.optimizer])
                  for state in opt.state.values()]
        return [*self.model.parameters(), *(b for b in self.model.buffers() if b.is_floating_point()),
                *(value for state in states for value in state.values() if torch.is_tensor(value))]

    def loss_scale(self) -> torch.Tensor | float:
        """fp16 loss scaling's scale: the GradScaler's device tensor once its first step made it."""
        try:
            return self.scaler_state.scale_tensor()
        except RuntimeError:  # no scale yet: the one its first step will use
            return self.scaler.get_scale()

    def non_finite_hint(self) -> str:
        """The settings that make a diverging DLRM run converge, for its stop's one line."""
        hint = "lower `lr` (or lengthen `warmup_steps`)"
        if self.scaler_state is not None:
            return hint + ", or train with `amp_dtype=bfloat16` (the range of float32) or without `amp`"
        return hint + (", or train without `amp`" if self.precision.dtype is not None else "")

    def ended(self) -> str | None:
        return "completed" if self.state.epoch >= self.cfg.epochs or self.state.step >= self.max_steps else None

    def batches(self) -> Iterable[Batch]:
        state, cfg = self.state, self.cfg
        source, order, state.sample_in_epoch = remaining_batches(
            self.train_source, state.epoch, state.sample_in_epoch, self.seed, cfg.shuffle_batch_order)
        order = order[: int(min(len(order), self.max_steps - state.step))]
        if len(order) == 0:
            if state.sample_in_epoch >= self.num_samples:  # nothing was left of the epoch
                state.advance(0, self.batch_size, self.num_samples)
            return []
        self.final_step = min(self.max_steps,
                              state.step + len(order) + (cfg.epochs - state.epoch - 1) * self.steps_per_epoch)
        # A host-table cache fetches each next batch's rows during the step before (no-op without one).
        return prefetching(PrefetchLoader(source, order, self.device, cfg.prefetch), self.model)

    def step(self, batch: Batch) -> tuple[torch.Tensor, int, bool]:
        self.lr = self.cfg.schedule.apply(self.optimizer, self.state.step + 1)
        loss = self.step_fn(batch)
        epoch_done = self.state.advance(batch.categorical_rows, self.batch_size, self.num_samples)  # global batch
        return loss, batch.categorical_rows, epoch_done

    def epochs(self) -> float:
        return self.state.epoch + self.state.sample_in_epoch / self.num_samples

    def tests_left(self) -> int:
        """The tests still to come: every ``eval_every_steps`` (or at each epoch's end) up to the
        run's last step, which is tested too."""
        if self.test_source is None:
            return 0
        now, end = self.state.step, int(self.final_step)
        every = self.cfg.eval_every_steps or self.steps_per_epoch
        return max(0, end // every - now // every + (end % every != 0 and end > now))

    def eta(self, step_time: float) -> float:
        """Seconds to the end: the steps left at ``step_time``, and the tests left at the mean
        time of those done (before the first, at half the step time per sample: a test is a
        forward pass only)."""
        seconds = step_time * (self.final_step - self.state.step)
        if tests := self.tests_left():
            per_test = (sum(self.test_seconds) / len(self.test_seconds) if self.test_seconds
                        else 0.5 * step_time / self.batch_size * self.test_source.num_samples)
            seconds += tests * per_test
        return seconds

    def progress(self, window: Window, epoch_done: bool) -> None:
        state, cfg = self.state, self.cfg
        step_epoch = state.epoch - epoch_done
        in_epoch = self.steps_per_epoch if epoch_done else -(-state.sample_in_epoch // state.batch_size)
        loss, step_time = window.loss / window.steps, window.step_time
        self.logger.print(
            f"Epoch:[{step_epoch}/{cfg.epochs}] [{in_epoch}/{self.steps_per_epoch}]  "
            f"eta: {format_eta(self.eta(step_time))}  loss: {loss:.4f}  "
            f"step_time: {step_time:.6f}  lr: {self.lr:.4f}"
        )
        if window.partial:  # the run's early line: the log's records keep their schedule
            return
        self.logger.record("train", step=state.step, epoch=step_epoch, loss=loss, lr=self.lr, step_time=step_time,
                           throughput=window.throughput)

    def evaluate(self, meter: Meter) -> str | None:
        state, cfg, epochs = self.state, self.cfg, self.epochs()
        if epochs < cfg.test_after:
            return None
        result = evaluate(self.model, self.test_source, self.device, self.precision, cfg.prefetch,
                          self.collectives, self.eval_forward, cfg.auc_device)
        meter.test_samples += result.samples
        meter.test_seconds += result.seconds
        self.test_seconds.append(result.seconds)
        if math.isnan(state.best_auc) or result.auc > state.best_auc:
            state.best_auc = result.auc
        self.logger.print(f"Test at step {state.step} (epoch {epochs:.2f}): auc {result.auc:.6f}  "
                          f"loss {result.loss:.6f}  throughput {result.throughput:,.0f} samples/s")
        self.logger.record("eval", step=state.step, epoch=epochs, auc=result.auc, loss=result.loss,
                           throughput=result.throughput, samples=result.samples)
        if cfg.auc_threshold is not None and state.best_auc >= cfg.auc_threshold:
            return "auc_threshold"
        return None

    def save(self) -> None:
        if self.cfg.checkpoint_format == "nvidia":
            nvidia_checkpoint.save(self.cfg.save_checkpoint_path, self.model, self.state.epoch, self.state.step,
                                   self.run_config, self.collectives)
            return
        save_checkpoint(self.cfg.save_checkpoint_path, self.model, self.optimizer, self.scaler, self.state,
                        self.run_config, self.collectives)

    def summary(self, meter: Meter) -> dict[str, Any]:
        return {"steps": self.state.step, "epochs": self.epochs(), "best_auc": self.state.best_auc,
                **meter.figures(), "last_lr": self.lr}

    def finish_line(self, summary: dict[str, Any]) -> str:
        return (f"Finished ({summary['stop_reason']}) after {self.state.step} steps: best auc {self.state.best_auc:.6f}"
                f"  {_throughput_text(summary, self.cfg.benchmark_warmup_steps)}")


def train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    precision: Precision,
    train_source: Any,
    test_source: Any | None,
    cfg: TrainConfig,
    device: torch.device,
    logger: RunLogger,
    state: TrainState | None = None,
    run_config: dict[str, Any] | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    collectives: Collectives = Collectives(),
    seed: int = 12345,
    max_bag_values: int | None = None,
) -> dict[str, Any]:
    """Trains until ``epochs`` or ``max_steps`` are done, the AUC threshold is reached, or
    ``should_stop()`` turns true (checked between steps, so a stop never splits an update).
    Continues from ``state`` (step, epoch, sample position in the epoch) when resuming, also with
    another batch size. The loop's guarantees (the summary record, the save on a stop or an
    error, ``NonFiniteLoss`` when the loss turns non-finite, with the last finite checkpoint
    kept) are ``run_loop``'s. ``seed``: the shuffled batch order's (``shuffle_batch_order``), a
    run's one seed (``RunConfig.seed``); ``run_config``: what the checkpoints record of the run;
    ``max_bag_values``: ``make_train_step``'s (with ``cuda_graphs`` on multi-hot data)."""
    state = state or TrainState()
    run = _DlrmRun(model, optimizer, scaler, precision, train_source, test_source, cfg, device, logger, state,
                   run_config, collectives, seed)
    if run.steps_per_epoch:  # an empty split: run_loop refuses it
        _check_resumable(state, run.batch_size, cfg)
        if cfg.save_checkpoint_path and cfg.checkpoint_format == "nvidia":
            nvidia_checkpoint.check_can_write(model.config)
        if cfg.save_checkpoint_path and collectives.rank == 0:
            check_can_save(cfg.save_checkpoint_path, model)  # now, not at the first save after hours of training
        run.step_fn = make_train_step(model, optimizer, scaler, precision, collectives, cfg.cuda_graphs,
                                      max_bag_values)
    model.train()
    return run_loop(run.parts(), cfg.loop, device, logger, collectives, should_stop)
