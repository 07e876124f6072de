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


def _kind(p: torch.Tensor) -> tuple:
    """What one multi-tensor call can take together: plain tensors by device type; DTensors by device type and mesh
    (torch's foreach kernels refuse a list mixing DTensors with plain tensors, or DTensors of different meshes)."""
    mesh = getattr(p, "device_mesh", None)
    local = p.to_local() if mesh is not None else p
    return local.device.type, mesh


class AdamW(torch.optim.AdamW):
    """torch's AdamW, its step run over each param group split by `_kind`: a layout mixes DTensors (tensor-, expert-
    or Engram-sharded weights) with plain tensors and, with parallel.engram_host_memory, host tensors with device
    ones, which one multi-tensor (foreach, CUDA's default) call refuses or would move. Each kind keeps the
    multi-tensor step; the update of every parameter is the one torch's AdamW makes (element-wise, per parameter).
    The split lives only for the step: param_groups, and so state dicts and checkpoints, stay as built.

    The split of each group's parameters is worked out once and kept (re-worked only if a group's parameter list
    changes, e.g. after load_state_dict or add_param_group): a step rebuilds only the small dicts around the kept
    lists, so that the scheduler's lr and any other hyperparameter of the group reach the step as they are now."""

    _split: tuple[tuple, list[list[list[torch.Tensor]]]] | None = None

    def _kinds(self) -> list[list[list[torch.Tensor]]]:
        key = tuple((id(g["params"]), len(g["params"])) for g in self.param_groups)
        if self._split is None or self._split[0] != key:
            parts = []
            for group in self.param_groups:
                kinds: dict = {}
                for p in group["params"]:
                    kinds.setdefault(_kind(p), []).append(p)
                parts.append(list(kinds.values()))
            self._split = (key, parts)
        return self._split[1]

    @torch.no_grad()
    def step(self, closure=None):
        groups = self.param_groups
        parts = self._kinds()
        if all(len(ps) == 1 for ps in parts):
            return super().step(closure)
        self.param_groups = [{**group, "params": ps} for group, kinds in zip(groups, parts) for ps in kinds]
        try:
            return super().step(closure)
        finally:
            self.param_groups = groups


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.Optimizer:
    groups = param_groups(params, cfg.weight_decay)
    if not groups:
        raise ValueError("optimizer: no trainable parameters")
    if cfg.name == "adamw":
        impl = "fused" if cfg.impl == "auto" else cfg.impl
        return AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=impl == "fused",
                     foreach=impl == "foreach")
    raise ValueError(f"optim.name={cfg.name!r} has no builder")
