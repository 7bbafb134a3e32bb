"""The run loop both products train with: one place for what happens around a step.

``run_loop`` owns the meter, the progress / evaluation / checkpoint schedule, stopping between
steps when ``should_stop()`` turns true on any process (saved, ending "interrupted"), the save
after an error, and the ``summary`` record. A product (DLRM's ``dlrm.training.train``, the
autoencoder's ``dlrm.recommender.train``) brings ``LoopParts``: its step, its batches from where
its state stands, its evaluation, its save, and its words for progress and the summary.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch

from dlrm.data.atomic import StorageError
from dlrm.data.errors import DatasetError
from dlrm.distributed.collectives import Collectives
from dlrm.training.logger import RunLogger


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
    The window's loss stays on the device until a line needs it: no host sync per step."""

    def __init__(self, device: torch.device, warmup_steps: int = 0, loss_dtype: torch.dtype | None = None):
        self.device = device
        self.warmup_steps = warmup_steps
        self.steps = 0  # steps taken by this run
        self.seconds, self.samples = 0.0, 0  # after warm-up
        self.test_seconds, self.test_samples = 0.0, 0
        self._window_seconds, self._window_steps, self._window_samples = 0.0, 0, 0
        self._window_loss = torch.zeros((), dtype=loss_dtype, device=device)
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

    def step(self, samples: int, loss: torch.Tensor) -> None:
        self.steps += 1
        self._window_loss += loss
        self._window_steps += 1
        self._window_samples += samples
        if self.steps > self.warmup_steps:
            self.samples += samples
        elif self.steps == self.warmup_steps:
            self._lap()  # warm-up ends: its time goes to the printed step time only

    def window(self, collectives: Collectives) -> Window:
        """The steps since the last call, their loss summed over all processes."""
        self._lap()
        window = Window(self._window_steps, self._window_samples, self._window_seconds,
                        float(collectives.sum(self._window_loss)))
        self._window_seconds, self._window_steps, self._window_samples = 0.0, 0, 0
        self._window_loss.zero_()
        return window

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


@dataclass(frozen=True)
class LoopSettings:
    """When things happen between steps (0: never, or at the end of each epoch where said)."""

    log_every: int = 0  # steps between progress lines
    eval_every: int = 0  # steps between evaluations; 0: at the end of each epoch
    checkpoint_every: int = 0  # steps between checkpoints (besides the final one)
    checkpoint_each_epoch: bool = False  # also a checkpoint at the end of each epoch
    report_last_step: bool = False  # the run's last step also gets a progress line and an evaluation
    warmup_steps: int = 0  # steps left out of the throughput figures


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
    evaluate: Callable[[Meter], str | None] | None = None  # returns a stop reason, or None
    save: Callable[[], None] | None = None  # every process calls it at the same step
    save_path: str | None = None
    finish_line: Callable[[dict[str, Any]], str] | None = None  # printed when the run ends without an error
    loss_dtype: torch.dtype | None = None  # of the window's loss sum (None: the default dtype)


class _Saves:
    """Saves to the run's checkpoint path unless this step is saved already or the file system
    refused a save (trying again would only fail again)."""

    def __init__(self, parts: LoopParts, meter: Meter, logger: RunLogger):
        self.parts, self.meter, self.logger = parts, meter, logger
        self.saved_step = parts.state.step  # the state we start from is saved already (or is the initial one)
        self.refused = False

    def __call__(self) -> None:
        step, path = self.parts.state.step, self.parts.save_path
        if not path or self.parts.save is None or self.saved_step == step or self.refused:
            return
        with self.meter.paused():
            try:
                self.parts.save()
            except StorageError:
                self.refused = True
                raise
        self.saved_step = step
        self.logger.print(f"Saved checkpoint at step {step} to {path}")
        self.logger.record("checkpoint", step=step, path=path)


def _after_step(parts: LoopParts, settings: LoopSettings, meter: Meter, saves: _Saves, epoch_done: bool,
                collectives: Collectives) -> str | None:
    """Runs what is due after a step; returns a stop reason when the run should end."""
    step = parts.state.step
    last = settings.report_last_step and parts.steps_left() == 0
    if (settings.log_every and step % settings.log_every == 0) or last:
        parts.progress(meter.window(collectives), epoch_done)
    reason = None
    eval_due = step % settings.eval_every == 0 if settings.eval_every else epoch_done
    if parts.evaluate is not None and (eval_due or last):
        with meter.paused():
            reason = parts.evaluate(meter)
    if (settings.checkpoint_every and step % settings.checkpoint_every == 0) or (
            settings.checkpoint_each_epoch and epoch_done):
        saves()
    return reason


def _steps(parts: LoopParts, settings: LoopSettings, meter: Meter, saves: _Saves, collectives: Collectives,
           should_stop: Callable[[], bool]) -> str:
    """Steps until the product says the run is over or something stops it; returns why."""
    while (ended := parts.ended()) is None:
        stepped = False
        batches = parts.batches()
        try:
            for batch in batches:
                stepped = True
                loss, samples, epoch_done = parts.step(batch)
                meter.step(samples, loss)
                reason = _after_step(parts, settings, meter, saves, epoch_done, collectives)
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
    checkpoint first (unless the error is the file system refusing a save: the last good
    checkpoint stays as it was). Returns the summary."""
    if parts.samples_per_epoch == 0:
        raise DatasetError(parts.empty)
    meter = Meter(device, settings.warmup_steps, parts.loss_dtype)
    saves = _Saves(parts, meter, logger)
    stop_reason, error = "completed", None
    try:
        stop_reason = _steps(parts, settings, meter, saves, collectives, should_stop)
        meter.finish()
        saves()
    except BaseException as e:
        stop_reason, error = ("error", e) if isinstance(e, Exception) else ("aborted", e)
        # One process only: peers of a failed process may be blocked in a collective, and a
        # save needs all of them. The state is that of the last whole step.
        if isinstance(e, Exception) and not isinstance(e, StorageError) and collectives.world_size == 1:
            try:
                saves()
            except Exception as save_error:  # noqa: BLE001 - the original error is what the user needs
                logger.print(f"Could not save a checkpoint after the error: {save_error}")
        raise
    finally:
        summary = {"stop_reason": stop_reason, **parts.summary(meter)}
        if error is not None:
            summary["error"] = f"{type(error).__name__}: {error}"
        logger.record("summary", **summary)
        if error is None and parts.finish_line is not None:
            logger.print(parts.finish_line(summary))
    return summary
