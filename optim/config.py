"""Typed optimiser configuration: the Hydra schema of the `optim` config group.

OmegaConf 2.3 has no Literal support: closed sets are `str` fields checked in `__post_init__`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def _choice(name: str, value: str, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ValueError(f"optim.{name} must be one of {list(options)}, got {value!r}")


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw
    """the optimiser; Muon and Sinkhorn-Nesterov (SPEC 1.7) come in a later issue"""
    lr: float = 3e-4
    """peak learning rate, reached at the end of warmup"""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW's decay rates of the first and second moment"""
    eps: float = 1e-8
    """added to the second moment's square root"""
    weight_decay: float = 0.1
    """decoupled decay on matrices only; norms, biases and every other 1-D parameter get none"""
    schedule: str = "cosine"  # constant, cosine, wsd
    """cosine: linear warmup then cosine to min_lr; wsd: warmup, stable at lr, then a final decay to min_lr"""
    warmup_steps: int = 100
    """linear warmup: step s (1-based) uses lr * s / warmup_steps"""
    min_lr_ratio: float = 0.1
    """floor of the decay, as a fraction of lr"""
    decay_fraction: float = 0.2
    """wsd only: share of the total steps spent in the final decay"""
    decay_shape: str = "linear"  # linear, cosine, sqrt
    """wsd only: shape of the final decay (sqrt = 1 - sqrt(progress))"""

    def __post_init__(self) -> None:
        _choice("name", self.name, ("adamw",))
        _choice("schedule", self.schedule, ("constant", "cosine", "wsd"))
        _choice("decay_shape", self.decay_shape, ("linear", "cosine", "sqrt"))
        if not self.lr > 0:
            raise ValueError(f"optim.lr must be > 0, got {self.lr!r}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"optim.betas must be two values in [0, 1), got {list(self.betas)!r}")
        if not self.eps > 0:
            raise ValueError(f"optim.eps must be > 0, got {self.eps!r}")
        if self.weight_decay < 0:
            raise ValueError(f"optim.weight_decay must be >= 0, got {self.weight_decay!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if not 0.0 <= self.decay_fraction <= 1.0:
            raise ValueError(f"optim.decay_fraction must be in [0, 1], got {self.decay_fraction!r}")
