"""The run loop both products train with: one place for what happens around a step.

``run_loop`` owns the meter, the progress / evaluation / checkpoint schedule, stopping between
steps when ``should_stop()`` turns true on any process (saved, ending "interrupted"), the stop
on a non-finite loss, the save after an error, and the ``summary`` record. A product (DLRM's
``dlrm.training.train``, the autoencoder's ``dlrm.recommender.train``) brings ``LoopParts``: its
step, its batches from where its state stands, its evaluation, its save, and its words for
progress and the summary.

A non-finite loss (nan or inf: the run diverged) stops the run with ``NonFiniteLoss``, whose one
line names the step and the settings to change (the entry points exit with its
``exit_code``, 3); the summary's ``stop_reason`` is "non_finite_loss". Nothing non-finite is ever
saved: every save, and every evaluation (which may save a best checkpoint), is preceded by a
check of the losses since the last check and of the state itself (weights, optimizer state), so
the checkpoint at the save path stays the last finite one. ``StepLosses`` says when a non-finite loss is a stop (fp16
loss scaling skips some on purpose) and why the check costs no device sync of its own.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch

from dlrm.engine.storage import StorageError
from dlrm.engine.collectives import Collectives
from dlrm.engine.errors import DatasetError
from dlrm.engine.logger import RunLogger


def synchronize(device: torch.device) -> None:
    """Waits for the work queued on ``device`` (a no-op on the CPU), so wall-clock times count it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Window:
    """The steps since the last progress line: ``loss`` is the sum of what the steps returned,
    over all processes (the product divides it by steps or samples)."""

    steps: int
    samples: int
    seconds: float
    loss: float
    # True for the run's early line (``LoopSettings.first_line_after``): a look at the window
    # so far, which goes on; a product prints it and records nothing, so the log keeps its schedule.
    partial: bool = False

    @property
    def step_time(self) -> float:
        return self.seconds / self.steps

    @property
    def throughput(self) -> float:
        return self.samples / self.seconds


class Meter:
    """Step time and throughput: wall time between laps, synchronised with the device so queued
    work is counted. The progress line's window holds every step since the last line; the run's
    average leaves out the first ``warmup_steps`` steps, and both leave out testing and saving.
    (The steps' losses are ``StepLosses``'.)"""

    def __init__(self, device: torch.device, warmup_steps: int = 0):
        self.device = device
        self.warmup_steps = warmup_steps
        self.steps = 0  # steps taken by this run
        self.seconds, self.samples = 0.0, 0  # after warm-up
        self.test_seconds, self.test_samples = 0.0, 0
        self._window_seconds, self._window_steps, self._window_samples = 0.0, 0, 0
        self._restart()

    def _restart(self) -> None:
        synchronize(self.device)
        self._t = time.perf_counter()

    def _lap(self) -> None:
        synchronize(self.device)
        now = time.perf_counter()
        elapsed, self._t = now - self._t, now
        self._window_seconds += elapsed
        if self.steps > self.warmup_steps:
            self.seconds += elapsed

    def step(self, samples: int) -> None:
        self.steps += 1
        self._window_steps += 1
        self._window_samples += samples
        if self.steps > self.warmup_steps:
            self.samples += samples
        elif self.steps == self.warmup_steps:
            self._lap()  # warm-up ends: its time goes to the printed step time only

    def window(self, loss: float) -> Window:
        """The steps since the last call, with ``loss``, their losses' sum over all processes."""
        self._lap()
        window = Window(self._window_steps, self._window_samples, self._window_seconds, loss)
        self._window_seconds, self._window_steps, self._window_samples = 0.0, 0, 0
        return window

    def peek(self, loss: float) -> Window:
        """The window so far (``partial``), which goes on: its steps stay in the next ``window``."""
        self._lap()
        return Window(self._window_steps, self._window_samples, self._window_seconds, loss, partial=True)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside (testing, saving) counts in neither figure."""
        self._lap()
        try:
            yield
        finally:
            self._restart()

    def finish(self) -> None:
        self._lap()

    def figures(self) -> dict[str, float]:
        nan = float("nan")
        return {
            "average_train_throughput": self.samples / self.seconds if self.seconds > 0 else nan,
            "average_test_throughput": self.test_samples / self.test_seconds if self.test_seconds > 0 else nan,
            "train_seconds": self.seconds,
        }


NON_FINITE_EXIT = 3  # the exit code of a run stopped by a non-finite loss (0: done, 1: a bug, 2: the user's input)
NON_FINITE_STOP = "non_finite_loss"  # its summary's stop_reason
PERSISTENT_NON_FINITE = 10  # consecutive non-finite losses that stop a run even when loss scaling skipped each
READ_EVERY = 1024  # steps at most between two reads of the losses (one device->host copy each)


class NonFiniteLoss(RuntimeError):
    """The run stopped because its loss (or the state it would save) turned non-finite; the
    message is one line naming the step and the settings to change. The entry points print it
    as their one line of error and exit with ``exit_code``; ``summary`` is the run's summary."""

    exit_code = NON_FINITE_EXIT

    def __init__(self, message: str, step: int, summary: dict[str, Any] | None = None):
        super().__init__(message)
        self.step, self.summary = step, summary


@dataclass(frozen=True)
class _Found:
    """What the check found: the step and what was non-finite there, in words."""

    step: int
    what: str


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every value of the floating-point ``tensors`` is finite. One reduction per tensor,
    ``torch.aminmax`` (nan propagates to both ends, an infinity is an end), which allocates no
    mask the size of the tensor (a host table may be most of host memory), and one host read per
    device."""
    flags: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        if not tensor.is_floating_point() or tensor.numel() == 0 or tensor.layout != torch.strided:
            continue
        ends = torch.stack(torch.aminmax(tensor.detach().reshape(-1)))
        flags.setdefault(tensor.device, []).append(torch.isfinite(ends).all())
    return all(bool(torch.stack(found).all()) for found in flags.values())


class StepLosses:
    """The loss of every step since the last read, kept on the device (one copy kernel a step,
    as the running sum it replaces was one add), read to the host in one copy, where the check
    decides whether the run must stop.

    When it is read: at each progress line (where the loss is read for the line anyway), before
    every evaluation and every save, at the end of the run, and at least every ``READ_EVERY``
    steps (so the buffer stays small: one sync per thousand steps costs nothing measurable). No
    step pays a device->host sync of its own, so a diverged run may go on up to the next read;
    that is harmless because nothing is saved or evaluated without a read first, and a save
    also checks the state itself (the last step's update may have overflowed it while
    its loss, computed before it, was finite).

    When a non-finite loss stops the run: without fp16 loss scaling (fp32, bf16) at once — the
    update of that step was computed from non-finite gradients, so the weights are ruined. With
    fp16 loss scaling (``loss_scale``: the live scale of the run's ``GradScaler``) a non-finite
    loss on a step the scaler skipped is expected now and then: the scaler found non-finite
    gradients, left every weight as it was and halved its scale (``GradScaler.update``, the
    same arithmetic as ``dlrm.training.grad_scaler``), so the step is known to have been skipped
    from the scale alone: it fell. Two cases still stop: a non-finite loss on a step the scaler
    did not skip (an infinite logit can give finite gradients, and that update was applied),
    and ``PERSISTENT_NON_FINITE`` non-finite losses in a row even though each was skipped: the
    scale multiplies only the backward pass, so it cannot cure a forward pass that overflows
    float16, and every skip halves it again (after 10, the gradients are scaled 1024 times less).

    The losses and skip flags are summed over processes before they are read, so every process
    decides the same at the same step (all must skip for a step to count as skipped).
    """

    def __init__(self, device: torch.device, dtype: torch.dtype | None = None,
                 loss_scale: Callable[[], torch.Tensor | float] | None = None, capacity: int = READ_EVERY):
        self.loss_scale = loss_scale
        self._losses = torch.zeros(capacity, dtype=dtype, device=device)
        self._loss_slots = self._losses.unbind()  # one view per step, made once: a step only copies
        self._scales = torch.zeros(capacity, dtype=torch.float32, device=device) if loss_scale else None
        self._scale_slots = self._scales.unbind() if loss_scale else ()
        self._scale_before = (torch.tensor(float(loss_scale()), dtype=torch.float32, device=device)
                              if loss_scale else None)  # the scale before the first step held
        self._held, self._first_step = 0, 0  # steps held; the step number of the first
        self._window = 0.0  # the sum of the losses read since the last progress line
        self._streak, self._streak_start = 0, 0  # non-finite losses in a row, and the first one's step
        self.found: _Found | None = None

    @property
    def full(self) -> bool:
        return self._held == len(self._loss_slots)

    def add(self, loss: torch.Tensor, step: int) -> None:
        """Holds the loss of step ``step`` (a 0-dim tensor; with loss scaling also the scale after it)."""
        held = self._held
        if held == 0:
            self._first_step = step
        self._loss_slots[held].copy_(loss.detach())
        if self._scale_slots:
            scale = self.loss_scale()
            self._scale_slots[held].copy_(scale) if torch.is_tensor(scale) else self._scale_slots[held].fill_(scale)
        self._held = held + 1

    def read(self, collectives: Collectives) -> _Found | None:
        """Reads the losses held (every process at the same step): adds them to the window and
        returns the first reason to stop found in them (and keeps it in ``found``)."""
        n = self._held
        if n == 0 or self.found is not None:
            return self.found
        rows = [self._losses[:n].double()]
        if self._scales is not None:
            scales = self._scales[:n]
            before = torch.cat([self._scale_before.reshape(1), scales[:-1]])
            rows.append((scales < before).double())  # the scale falls only on a step it skipped
            self._scale_before = scales[-1].clone()
        host = collectives.sum(torch.stack(rows)).cpu().numpy()  # the one device->host copy
        self._held = 0
        losses = host[0]
        skipped = host[1] > collectives.world_size - 0.5 if len(host) > 1 else np.zeros(n, dtype=bool)
        self._window += float(losses.sum())
        bad = ~np.isfinite(losses)
        if not bad.any():
            self._streak = 0
            return None
        for i in range(n):
            step = self._first_step + i
            if not bad[i]:
                self._streak = 0
                continue
            if self._streak == 0:
                self._streak_start = step
            self._streak += 1
            value = "nan" if np.isnan(losses[i]) else "inf"
            if not skipped[i]:
                scaled = " and fp16 loss scaling did not skip it" if self._scales is not None else ""
                self.found = _Found(step, f"the training loss is {value} at step {step}{scaled}")
                break
            if self._streak >= PERSISTENT_NON_FINITE:
                self.found = _Found(
                    step, f"the training loss has been non-finite for {self._streak} steps in a row (steps "
                    f"{self._streak_start}-{step}), each skipped by fp16 loss scaling, which cannot cure a forward "
                    "pass that overflows float16")
                break
        return self.found

    @property
    def window_so_far(self) -> float:
        """The sum of the losses read since the last ``take_window``, which keeps them."""
        return self._window

    def take_window(self) -> float:
        """The sum of the losses read since the last call."""
        window, self._window = self._window, 0.0
        return window


@dataclass(frozen=True)
class LoopSettings:
    """When things happen between steps (0: never, or at the end of each epoch where said)."""

    log_every: int = 0  # steps between progress lines
    eval_every: int = 0  # steps between evaluations; 0: at the end of each epoch
    checkpoint_every: int = 0  # steps between checkpoints (besides the final one)
    checkpoint_each_epoch: bool = False  # also a checkpoint at the end of each epoch
    report_last_step: bool = False  # the run's last step also gets a progress line and an evaluation
    warmup_steps: int = 0  # steps left out of the throughput figures
    # A first line after this many steps of the run when no regular line came yet (0: none), so
    # a run with a long ``log_every`` (at least 4 times this) shows its step time and ETA within
    # seconds of its start.
    first_line_after: int = 0


@dataclass
class LoopParts:
    """What a product brings to ``run_loop``. ``state`` has ``step`` (updates done); the
    callables read and move it."""

    state: Any
    samples_per_epoch: int  # 0 is refused with ``empty`` (a DatasetError)
    empty: str
    ended: Callable[[], str | None]  # before a step: None to go on, or why the run is over
    batches: Callable[[], Iterable[Any]]  # the rest of the epoch from the state (may end an empty one)
    step: Callable[[Any], tuple[torch.Tensor, int, bool]]  # batch -> (loss for the window, samples, epoch done)
    progress: Callable[[Window, bool], None]  # the progress line and "train" record of a window
    steps_left: Callable[[], float]  # steps to the end of the run
    summary: Callable[[Meter], dict[str, Any]]  # the summary's fields after ``stop_reason``
    # Returns a stop reason, or None. Runs only on a finite state (checked first), so a best
    # checkpoint it saves is finite.
    evaluate: Callable[[Meter], str | None] | None = None
    save: Callable[[], None] | None = None  # every process calls it at the same step
    save_path: str | None = None
    finish_line: Callable[[dict[str, Any]], str] | None = None  # printed when the run ends without an error
    loss_dtype: torch.dtype | None = None  # of the step losses held on the device (None: the default dtype)
    # The floating-point tensors a save writes (weights, optimizer state): all finite, or no save.
    state_tensors: Callable[[], Iterable[torch.Tensor]] | None = None
    loss_scale: Callable[[], torch.Tensor | float] | None = None  # fp16 loss scaling's live scale (StepLosses)
    # The settings to change when the loss turns non-finite, as `setting` names (the CLI shows flags).
    non_finite_hint: str = "lower the learning rate"


class _FiniteCheck:
    """The losses since the last check and, where asked, the state a save would write (weights
    and optimizer state: Adam's second moment can overflow while the weights, whose steps it
    bounds, stay finite; a checkpoint holding it would resume a ruined run): what stands between
    a diverged run and a save or an evaluation. ``found`` keeps the first reason to stop."""

    def __init__(self, parts: LoopParts, losses: StepLosses, collectives: Collectives):
        self.parts, self.losses, self.collectives = parts, losses, collectives
        self.state_checked: int | None = None  # the step whose state was found finite

    @property
    def found(self) -> _Found | None:
        return self.losses.found

    def __call__(self, state: bool) -> _Found | None:
        """Reads the losses, and with ``state`` checks the state tensors (once a step); collective."""
        found = self.losses.read(self.collectives)
        step = self.parts.state.step
        if found is None and state and self.parts.state_tensors is not None and self.state_checked != step:
            if self.collectives.any(not all_finite(self.parts.state_tensors())):
                found = self.losses.found = _Found(
                    step, f"the weights or the optimizer state hold nan or inf after step {step}")
            else:
                self.state_checked = step
        return found


class _Saves:
    """Saves to the run's checkpoint path unless this step is saved already, the file system
    refused a save (trying again would only fail again), or the check finds the run non-finite
    (``check.found`` then says why: the last finite checkpoint stays)."""

    def __init__(self, parts: LoopParts, meter: Meter, logger: RunLogger, check: _FiniteCheck):
        self.parts, self.meter, self.logger, self.check = parts, meter, logger, check
        self.saved_step = parts.state.step  # the state we start from is saved already (or is the initial one)
        self.saved_by_run = False
        self.refused = False

    def __call__(self) -> None:
        step, path = self.parts.state.step, self.parts.save_path
        if not path or self.parts.save is None or self.saved_step == step or self.refused:
            return
        if self.check(state=True) is not None:
            return
        with self.meter.paused():
            try:
                self.parts.save()
            except StorageError:
                self.refused = True
                raise
        self.saved_step, self.saved_by_run = step, True
        self.logger.print(f"Saved checkpoint at step {step} to {path}")
        self.logger.record("checkpoint", step=step, path=path)

    def kept(self, finite: bool = False) -> str | None:
        """What the checkpoint path holds now, in words (None: the run saves no checkpoint)."""
        path = self.parts.save_path
        if not path or self.parts.save is None:
            return None
        if self.saved_by_run:
            return f"the last{' finite' if finite else ''} checkpoint, of step {self.saved_step}, is kept at {path}"
        if os.path.exists(path):
            return f"the checkpoint at {path} is as it was before this run"
        return "no checkpoint was saved"


def _logged_since(start: int, step: int, every: int) -> bool:
    """Whether a regular progress line came after step ``start``, up to ``step``."""
    return bool(every) and step // every > start // every


def _after_step(parts: LoopParts, settings: LoopSettings, meter: Meter, losses: StepLosses, check: _FiniteCheck,
                saves: _Saves, epoch_done: bool) -> str | None:
    """Runs what is due after a step; returns a stop reason when the run should end."""
    step = parts.state.step
    last = settings.report_last_step and parts.steps_left() == 0
    log_due = (settings.log_every and step % settings.log_every == 0) or last
    eval_due = parts.evaluate is not None and (
        (step % settings.eval_every == 0 if settings.eval_every else epoch_done) or last)
    save_due = (settings.checkpoint_every and step % settings.checkpoint_every == 0) or (
        settings.checkpoint_each_epoch and epoch_done)
    early_due = (not log_due and settings.first_line_after and meter.steps == settings.first_line_after
                 and (not settings.log_every or settings.log_every >= 4 * settings.first_line_after)
                 and not _logged_since(step - meter.steps, step, settings.log_every))
    # Every process reaches the same decisions at the same steps: the check is collective.
    if (log_due or eval_due or early_due or losses.full) and check(state=eval_due) is not None:
        return NON_FINITE_STOP
    if log_due:
        parts.progress(meter.window(losses.take_window()), epoch_done)
    elif early_due:
        parts.progress(meter.peek(losses.window_so_far), epoch_done)
    reason = None
    if eval_due:
        with meter.paused():
            reason = parts.evaluate(meter)
    if save_due:
        saves()
        if check.found is not None:
            return NON_FINITE_STOP
    return reason


def _steps(parts: LoopParts, settings: LoopSettings, meter: Meter, losses: StepLosses, check: _FiniteCheck,
           saves: _Saves, collectives: Collectives, should_stop: Callable[[], bool]) -> str:
    """Steps until the product says the run is over or something stops it; returns why."""
    while (ended := parts.ended()) is None:
        stepped = False
        batches = parts.batches()
        try:
            for batch in batches:
                stepped = True
                loss, samples, epoch_done = parts.step(batch)
                meter.step(samples)
                losses.add(loss, parts.state.step)
                reason = _after_step(parts, settings, meter, losses, check, saves, epoch_done)
                if reason is None and collectives.any(should_stop()):
                    reason = "interrupted"
                if reason is not None:
                    return reason
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()
        if not stepped and collectives.any(should_stop()):  # an epoch with nothing left in it
            return "interrupted"
    return ended


def run_loop(parts: LoopParts, settings: LoopSettings, device: torch.device, logger: RunLogger,
             collectives: Collectives = Collectives(), should_stop: Callable[[], bool] = lambda: False) -> dict[str, Any]:
    """Trains until the product says the run is over, its evaluation stops it, or
    ``should_stop()`` turns true on any process (checked between steps, so a stop never splits
    an update; the run saves and ends "interrupted"). Whatever ends the run, the log gets a
    ``summary`` record with the reason; an error after a step of a one-process run saves a
    checkpoint first (unless the file system refused the checkpoint itself, or the state is
    non-finite: the last good checkpoint stays as it was). Returns the summary.

    Raises ``NonFiniteLoss`` once the summary is written when the loss or the state turned
    non-finite (module docstring; ``StepLosses`` for when): nothing is saved then."""
    if parts.samples_per_epoch == 0:
        raise DatasetError(parts.empty)
    meter = Meter(device, settings.warmup_steps)
    losses = StepLosses(device, parts.loss_dtype, parts.loss_scale)
    check = _FiniteCheck(parts, losses, collectives)
    saves = _Saves(parts, meter, logger, check)
    stop_reason, error = "completed", None
    try:
        stop_reason = _steps(parts, settings, meter, losses, check, saves, collectives, should_stop)
        meter.finish()
        if stop_reason != NON_FINITE_STOP and check(state=True) is not None:  # also without a save
            stop_reason = NON_FINITE_STOP
        if stop_reason != NON_FINITE_STOP:
            saves()
    except BaseException as e:
        stop_reason, error = ("error", e) if isinstance(e, Exception) else ("aborted", e)
        # One process only: peers of a failed process may be blocked in a collective, and a
        # save needs all of them. The state is that of the last whole step.
        if isinstance(e, Exception) and not saves.refused and collectives.world_size == 1:
            _save_after_error(saves, check, logger)
        raise
    finally:
        summary = {"stop_reason": stop_reason, **parts.summary(meter)}
        found = check.found if stop_reason == NON_FINITE_STOP else None
        message = None
        if found is not None:
            kept = saves.kept(finite=True)
            message = f"{found.what}; training stopped{', and ' + kept if kept else ''}: {parts.non_finite_hint}"
        if error is not None:
            summary["error"] = f"{type(error).__name__}: {error}"
        elif found is not None:
            summary.update(non_finite_step=found.step, error=f"{NonFiniteLoss.__name__}: {message}")
        try:
            logger.record("summary", **summary)
        except StorageError:
            if error is None and found is None:
                raise
            # Another error is on its way (or the stop's line): that is the one line to show.
        if error is None and found is None and parts.finish_line is not None:
            logger.print(parts.finish_line(summary))
    if found is not None:
        raise NonFiniteLoss(message, found.step, summary)
    return summary


def _save_after_error(saves: _Saves, check: _FiniteCheck, logger: RunLogger) -> None:
    """The save after an error, saying what became of it: "Saved checkpoint ..." (by the save),
    nothing when this step is saved already, or why it could not be."""
    try:
        saves()
    except Exception as save_error:  # noqa: BLE001 - the original error is what the user needs
        logger.print(f"Could not save a checkpoint after the error ({save_error}); {saves.kept()}")
        return
    if check.found is not None:
        logger.print(f"No checkpoint saved after the error: {check.found.what}; {saves.kept(finite=True)}")
