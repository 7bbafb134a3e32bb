import math

import pytest
import torch

from dlrm.training.lr_schedule import LRSchedule


def closed_form(step, lr, warm, wf, start, steps, power, end_lr):
    """The schedule written out case by case, as NVIDIA's README describes it."""
    if step <= warm:
        return lr * (1 - (warm - step) / (warm * 2**wf))
    if steps == 0 or step <= start:
        return lr
    if step <= start + steps:
        return lr * max(((start + steps - step) / steps) ** power, end_lr / lr)
    return end_lr


@pytest.mark.parametrize("wf", [0, 1, 3])
@pytest.mark.parametrize("power,end_lr", [(2, 0.0), (1, 0.5), (3, 2.0)])
def test_schedule_matches_closed_form(wf, power, end_lr):
    args = dict(lr=24.0, warm=100, wf=wf, start=300, steps=200, power=power, end_lr=end_lr)
    sched = LRSchedule(24.0, 100, wf, 300, 200, power, end_lr)
    for step in [1, 2, 50, 99, 100, 101, 299, 300, 301, 350, 399, 400, 499, 500, 501, 10_000]:
        assert sched.lr_at(step) == pytest.approx(closed_form(step, **args), rel=1e-12, abs=1e-12)


def test_landmarks():
    sched = LRSchedule(lr=10.0, warmup_steps=10, decay_start_step=20, decay_steps=10, decay_power=2)
    assert sched.lr_at(1) == pytest.approx(1.0)  # 1/10 of the way
    assert sched.lr_at(10) == pytest.approx(10.0)
    assert sched.lr_at(20) == pytest.approx(10.0)
    assert sched.lr_at(25) == pytest.approx(10.0 * 0.25)  # ((30-25)/10)^2
    assert sched.lr_at(30) == 0.0
    assert sched.lr_at(31) == 0.0


def test_no_warmup_no_decay_is_constant():
    sched = LRSchedule(lr=3.0)
    assert all(sched.lr_at(s) == 3.0 for s in range(1, 50))


def test_decay_steps_zero_means_no_decay():
    sched = LRSchedule(lr=2.0, warmup_steps=5, decay_start_step=0, decay_steps=0)
    assert sched.lr_at(1000) == 2.0


def test_decay_before_warmup_end_is_refused():
    with pytest.raises(ValueError, match="decay_start_step"):
        LRSchedule(lr=1.0, warmup_steps=10, decay_start_step=5, decay_steps=10)


def test_apply_sets_every_group():
    params = [torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))]
    opt = torch.optim.SGD([{"params": params[:1]}, {"params": params[1:]}], lr=0.0)
    lr = LRSchedule(lr=4.0, warmup_steps=4).apply(opt, 2)
    assert lr == pytest.approx(2.0)
    assert [g["lr"] for g in opt.param_groups] == [pytest.approx(2.0)] * 2
    assert not math.isnan(lr)
