"""Typed optimiser configuration: the Hydra schema of the `optim` config group.

OmegaConf 2.3 has no Literal support: closed sets are `choice_field`s (config_checks.py) checked in `__post_init__`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from config_checks import at_least, check_choices, choice_field, in_range, positive
from optim.rules import ParamRule


@dataclass
class MuonConfig:
    momentum: float = 0.95
    """the momentum buffer's decay"""
    nesterov: bool = True
    """orthogonalise g + momentum * buffer (Nesterov) rather than the buffer"""
    rms: float = 0.2
    """each block's update RMS (optim/muon.py: AdamW's typical update RMS, so its learning rates carry over)"""

    def __post_init__(self) -> None:
        in_range("optim.muon.momentum", self.momentum, 0, 1)
        positive("optim.muon.rms", self.rms)


@dataclass
class SinkhornConfig:
    momentum: float = 0.9
    """the momentum buffer's decay"""
    nesterov: bool = True
    """balance g + momentum * buffer (Nesterov) rather than the buffer"""
    rms: float = 0.2
    """the balanced update's row and column RMS"""
    iters: int = 8
    """alternating row / column normalisations per step"""

    def __post_init__(self) -> None:
        in_range("optim.sinkhorn.momentum", self.momentum, 0, 1)
        positive("optim.sinkhorn.rms", self.rms)
        at_least("optim.sinkhorn.iters", self.iters, 1)


@dataclass
class OptimConfig:
    name: str = choice_field("adamw", ("adamw", "muon"))
    """adamw: AdamW for every parameter (decay on matrices only); muon: the report's optimisers (SPEC 1.7) by
    `rules` (conf/optim/muon.yaml: Muon for matrices, head-wise for Q/K, Sinkhorn momentum for the embedding, the
    head and the Engram tables, AdamW for the rest)"""
    rules: list[ParamRule] = field(default_factory=list)
    """name patterns -> optimiser, learning-rate multiplier, weight decay (optim/rules.py); every trainable
    parameter matches exactly one. Empty: optim.name=adamw's one AdamW"""
    muon: MuonConfig = field(default_factory=MuonConfig)
    sinkhorn: SinkhornConfig = field(default_factory=SinkhornConfig)
    lr: float = 3e-4
    """peak learning rate, reached at the end of warmup"""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW's decay rates of the first and second moment"""
    eps: float = 1e-8
    """added to the second moment's square root"""
    impl: str = choice_field("auto", ("auto", "fused", "foreach", "for_loop"))
    """how torch's AdamW runs the update: fused (one kernel per group and device kind), foreach (multi-tensor
    kernels, one per operation), for_loop (per parameter); auto = fused (bench/optim_step.py: BENCHMARKS.md)"""
    clip_in_step: str = choice_field("auto", ("auto", "on", "off"))
    """the gradient clip applied inside the fused AdamW step (torch's `grad_scale`: the kernel divides each gradient
    by 1 / coef as it reads it) instead of a multi-tensor multiply over every gradient before the step: one read and
    write of the gradients fewer. auto = on where the parameters are on a GPU and optim.name=adamw runs fused, off on
    CPU (dividing by 1 / coef rounds differently from multiplying by coef: the reference curve stays bit for bit);
    on needs optim.name=adamw and impl auto or fused"""
    weight_decay: float = 0.1
    """decoupled decay on matrices only; norms, biases and every other 1-D parameter get none"""
    schedule: str = choice_field("cosine", ("constant", "cosine", "wsd"))
    """cosine: linear warmup then cosine to min_lr; wsd: warmup, stable at lr, then a final decay to min_lr"""
    warmup_steps: int = 100
    """linear warmup: step s (1-based) uses lr * s / warmup_steps"""
    min_lr_ratio: float = 0.1
    """floor of the decay, as a fraction of lr"""
    decay_fraction: float = 0.2
    """wsd only: share of the total steps spent in the final decay"""
    decay_shape: str = choice_field("linear", ("linear", "cosine", "sqrt"))
    """wsd only: shape of the final decay (sqrt = 1 - sqrt(progress))"""

    def __post_init__(self) -> None:
        check_choices(self, "optim")
        positive("optim.lr", self.lr)
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"optim.betas must be two values in [0, 1), got {list(self.betas)!r}")
        positive("optim.eps", self.eps)
        at_least("optim.weight_decay", self.weight_decay, 0)
        at_least("optim.warmup_steps", self.warmup_steps, 0)
        in_range("optim.min_lr_ratio", self.min_lr_ratio, 0, 1)
        in_range("optim.decay_fraction", self.decay_fraction, 0, 1)
        if self.clip_in_step == "on" and (self.name != "adamw" or self.rules or self.impl not in ("auto", "fused")):
            raise ValueError(f"optim.clip_in_step=on folds the clip into the fused AdamW step: it needs optim.name=adamw "
                             f"without optim.rules and optim.impl auto or fused (got name={self.name}, "
                             f"impl={self.impl}{', rules' if self.rules else ''}); use clip_in_step=auto or off")
        if self.name == "muon" and not self.rules:
            raise ValueError("optim.name=muon needs optim.rules (conf/optim/muon.yaml has the report's)")
