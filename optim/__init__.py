"""Optimisers and learning-rate schedules."""

from optim.builder import build_optimizer, param_groups
from optim.config import OptimConfig
from optim.schedule import LRScheduler, lr_factor

__all__ = ["OptimConfig", "LRScheduler", "build_optimizer", "lr_factor", "param_groups"]
