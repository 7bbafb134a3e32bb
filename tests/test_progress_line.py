"""The progress line of a run with a long ``log_every`` (NVIDIA's --print_freq 200: minutes of CPU
steps) comes early too, and its ETA counts the tests still to run, not the steps alone."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
import torch

from dlrm.engine.logger import RunLogger
from dlrm.engine.loop import LoopParts, LoopSettings, Window, run_loop
from dlrm.training.train import _DlrmRun


def _run(steps: int, settings: LoopSettings, start: int = 0) -> list[Window]:
    """A run whose step ``s`` has loss ``s``: the windows its progress lines were given."""
    state = SimpleNamespace(step=start)
    windows: list[Window] = []

    def step(_):
        state.step += 1
        return torch.tensor(float(state.step)), 4, False

    parts = LoopParts(state=state, samples_per_epoch=4, empty="",
                      ended=lambda: "completed" if state.step >= start + steps else None,
                      batches=lambda: range(start + steps - state.step), step=step,
                      progress=lambda w, e: windows.append(w), steps_left=lambda: start + steps - state.step,
                      summary=lambda meter: {"steps": state.step})
    run_loop(parts, settings, torch.device("cpu"), RunLogger(stream=io.StringIO()))
    return windows


def test_an_early_line_looks_at_the_window_and_leaves_it_to_the_regular_line():
    windows = _run(25, LoopSettings(log_every=50, report_last_step=True, first_line_after=10))
    assert [(w.partial, w.steps, w.samples, w.loss) for w in windows] == [
        (True, 10, 40, float(sum(range(1, 11)))), (False, 25, 100, float(sum(range(1, 26))))]


@pytest.mark.parametrize("start, log_every, early", [(0, 5, False), (0, 10, False), (0, 39, False), (0, 40, True),
                                                     (195, 200, False), (100, 200, True), (0, 0, True)])
def test_the_early_line_comes_only_when_no_regular_line_came_first(start, log_every, early):
    windows = _run(30, LoopSettings(log_every=log_every, first_line_after=10), start=start)  # a line only where 4x apart
    assert any(w.partial for w in windows) == early
    assert all(w.steps == 10 for w in windows if w.partial)


def _tests_in(now: int, end: int, every: int) -> int:
    """Plainly: the steps after ``now`` up to ``end`` that test (every ``every``-th, and the last)."""
    return sum(1 for s in range(now + 1, end + 1) if s % every == 0 or s == end)


@pytest.mark.parametrize("now, end, every, per_epoch", [(0, 1024, 256, 1024), (0, 1000, 256, 1000),
                                                        (300, 1000, 256, 1000), (1000, 1000, 256, 1000),
                                                        (0, 237, None, 79), (100, 237, None, 79), (5, 90, None, 79)])
def test_the_eta_counts_the_tests_left(now, end, every, per_epoch):
    run = SimpleNamespace(test_source=SimpleNamespace(num_samples=2000), state=SimpleNamespace(step=now),
                          final_step=end, cfg=SimpleNamespace(eval_every_steps=every), steps_per_epoch=per_epoch,
                          batch_size=100, test_seconds=[])
    left = _tests_in(now, end, every or per_epoch)
    assert _DlrmRun.tests_left(run) == left
    run.tests_left = lambda: _DlrmRun.tests_left(run)
    assert _DlrmRun.eta(run, 0.2) == pytest.approx(0.2 * (end - now) + left * 0.5 * 0.2 / 100 * 2000)
    run.test_seconds = [3.0, 5.0]  # measured: their mean
    assert _DlrmRun.eta(run, 0.2) == pytest.approx(0.2 * (end - now) + left * 4.0)
    run.test_source = None
    assert _DlrmRun.eta(run, 0.2) == pytest.approx(0.2 * (end - now))
