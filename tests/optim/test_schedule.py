"""LR schedules: warmup, cosine and WSD give the intended values at their key steps, and the scheduler
drives the optimiser's lr from its step count alone (so a resumed scheduler continues the same curve)."""

import math

import pytest
import torch

from optim import LRScheduler, OptimConfig, lr_factor


def test_warmup_is_linear_and_reaches_peak():
    cfg = OptimConfig(schedule="cosine", warmup_steps=10, min_lr_ratio=0.1)
    assert lr_factor(cfg, 1, 100) == pytest.approx(0.1)
    assert lr_factor(cfg, 5, 100) == pytest.approx(0.5)
    assert lr_factor(cfg, 10, 100) == pytest.approx(1.0)


def test_cosine_midpoint_and_floor():
    cfg = OptimConfig(schedule="cosine", warmup_steps=10, min_lr_ratio=0.1)
    # decay runs over steps 11..100; its midpoint (step 55) sits halfway between peak and floor
    assert lr_factor(cfg, 55, 100) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(cfg, 100, 100) == pytest.approx(0.1)
    assert lr_factor(cfg, 150, 100) == pytest.approx(0.1)
    values = [lr_factor(cfg, s, 100) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_cosine_without_warmup_starts_at_peak():
    cfg = OptimConfig(schedule="cosine", warmup_steps=0, min_lr_ratio=0.0)
    assert lr_factor(cfg, 1, 4) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    assert lr_factor(cfg, 4, 4) == pytest.approx(0.0)


@pytest.mark.parametrize("shape,mid", [("linear", 0.5), ("cosine", 0.5), ("sqrt", 1 - math.sqrt(0.5))])
def test_wsd_warmup_stable_decay(shape, mid):
    cfg = OptimConfig(schedule="wsd", warmup_steps=10, decay_fraction=0.2, decay_shape=shape, min_lr_ratio=0.0)
    assert lr_factor(cfg, 5, 100) == pytest.approx(0.5)
    # stable phase: steps 10..80 at the peak; decay over the last 20 steps
    assert all(lr_factor(cfg, s, 100) == 1.0 for s in range(10, 81))
    assert lr_factor(cfg, 90, 100) == pytest.approx(mid)
    assert lr_factor(cfg, 100, 100) == pytest.approx(0.0)


def test_wsd_decay_never_overlaps_warmup():
    cfg = OptimConfig(schedule="wsd", warmup_steps=8, decay_fraction=0.5, min_lr_ratio=0.0)
    assert lr_factor(cfg, 8, 10) == pytest.approx(1.0)
    assert lr_factor(cfg, 9, 10) == pytest.approx(0.5)
    assert lr_factor(cfg, 10, 10) == pytest.approx(0.0)


def test_constant_after_warmup():
    cfg = OptimConfig(schedule="constant", warmup_steps=4)
    assert [lr_factor(cfg, s, 10) for s in (1, 4, 5, 10, 20)] == [0.25, 1.0, 1.0, 1.0, 1.0]


def test_scheduler_sets_lr_and_resumes_from_step_count():
    cfg = OptimConfig(lr=1e-2, schedule="cosine", warmup_steps=3, min_lr_ratio=0.0)
    param = torch.nn.Parameter(torch.zeros(2, 2))
    opt = torch.optim.AdamW([param], lr=cfg.lr)
    sched = LRScheduler(opt, cfg, total_steps=10)
    seen = []
    for _ in range(10):
        seen.append(opt.param_groups[0]["lr"])  # the lr that the upcoming optimizer.step() uses
        sched.step()
    assert seen == pytest.approx([1e-2 * lr_factor(cfg, s, 10) for s in range(1, 11)])

    opt2 = torch.optim.AdamW([param], lr=cfg.lr)
    sched2 = LRScheduler(opt2, cfg, total_steps=10)
    sched2.load_state_dict({"steps_done": 6})
    assert opt2.param_groups[0]["lr"] == pytest.approx(seen[6])


def test_bad_values_name_the_field():
    with pytest.raises(ValueError, match="optim.schedule"):
        OptimConfig(schedule="linear_cosine")
    with pytest.raises(ValueError, match="optim.betas"):
        OptimConfig(betas=[0.9])
    with pytest.raises(ValueError, match="optim.lr"):
        OptimConfig(lr=0.0)
