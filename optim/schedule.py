"""Learning-rate schedules: linear warmup, then constant, cosine, or WSD (warmup-stable-decay).

Steps are 1-based optimiser steps: step s is the s-th call of `optimizer.step()`. Warmup reaches the peak
at s = warmup_steps (step 1 already trains, at lr / warmup_steps); cosine and WSD land on the floor
(min_lr_ratio * lr) exactly at s = total_steps and stay there if training runs past it.
"""

from __future__ import annotations

import math

import torch

from optim.config import OptimConfig


def lr_factor(cfg: OptimConfig, step: int, total_steps: int) -> float:
    """Multiplier of the peak lr for the 1-based optimiser step `step` of a run of `total_steps`."""
    if step < 1:
        raise ValueError(f"lr_factor: step is 1-based, got {step}")
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return step / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "cosine":
        decay_start = cfg.warmup_steps
    else:  # wsd: the decay occupies the last decay_fraction of the run, never the warmup
        decay_start = max(cfg.warmup_steps, total_steps - round(cfg.decay_fraction * total_steps))
    if step <= decay_start or total_steps <= decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start) / (total_steps - decay_start))
    if cfg.schedule == "cosine" or cfg.decay_shape == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif cfg.decay_shape == "sqrt":
        shape = 1.0 - math.sqrt(progress)
    else:
        shape = 1.0 - progress
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


class LRScheduler:
    """Sets every param group's lr to `initial_lr * lr_factor(next step)`.

    Its only state is the number of optimiser steps taken, so a resumed run follows the schedule of the
    config it was resumed with (torch's LambdaLR would restore the old schedule's parameters instead).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int) -> None:
        self.optimizer = optimizer
        self.cfg = cfg
        self.total_steps = total_steps
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
        self.steps_done = 0
        self._apply()

    def _apply(self) -> None:
        factor = lr_factor(self.cfg, self.steps_done + 1, self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * factor

    def step(self) -> None:
        """Call after `optimizer.step()`: moves the lr to the next step's value."""
        self.steps_done += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"steps_done": self.steps_done}

    def load_state_dict(self, state: dict) -> None:
        self.steps_done = int(state["steps_done"])
        self._apply()
