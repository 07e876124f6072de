"""Builds the optimiser from an `OptimConfig` and the parameters that should learn.

Weight decay applies to matrices only: norms' gains, biases and every other 1-D (or 0-D) parameter get
none, since decaying a gain towards 0 fights the normalisation instead of regularising a projection.
Parameters stay fp32 (the master copy); bf16 compute comes from autocast in the trainer, so the
optimiser state is fp32 too. A non-fp32 trainable parameter is refused rather than updated in low
precision.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from optim.config import OptimConfig


def param_groups(params: Iterable[torch.nn.Parameter], weight_decay: float) -> list[dict]:
    """Two groups: decayed (ndim >= 2) and not decayed (ndim < 2); empty groups are dropped."""
    decay, no_decay, seen = [], [], set()
    for p in params:
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if p.dtype != torch.float32:
            raise ValueError(
                f"optimizer: trainable parameters must be fp32 (they are the master weights), got {p.dtype} "
                f"for a parameter of shape {tuple(p.shape)}"
            )
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def _kind(p: torch.Tensor) -> tuple[bool, str]:
    """(a DTensor?, the device type of what this process holds)."""
    local = getattr(p, "to_local", None)
    return local is not None, (local() if local is not None else p).device.type


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.Optimizer:
    groups = param_groups(params, cfg.weight_decay)
    if not groups:
        raise ValueError("optimizer: no trainable parameters")
    # torch's multi-tensor (foreach) step refuses a list mixing DTensors with plain tensors (expert- or Engram-
    # sharded weights beside replicated ones), and its default turns foreach off anyway for a group holding a
    # host tensor (parallel.engram_host_memory): with such a mix, the per-tensor step, explicitly. The param groups
    # stay as they are, so checkpoints load across layouts.
    mixed = len({_kind(p) for g in groups for p in g["params"]}) > 1
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                                 foreach=False if mixed else None)
    raise ValueError(f"optim.name={cfg.name!r} has no builder")
