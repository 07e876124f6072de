"""torch's AdamW over parameters of mixed kinds (DTensors of several meshes, plain tensors, host and device tensors):
the AdamW every optimiser of optim/ uses (optim/builder.py alone, optim/hybrid.py for its AdamW groups)."""

from __future__ import annotations

import torch

__all__ = ["AdamW"]


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
    clip_in_step = False
    """set by optim.builder (optim.clip_in_step): the trainer then hands the clip to `scale_next_step`"""
    _next_scale: torch.Tensor | None = None

    def scale_next_step(self, coef: torch.Tensor) -> None:
        """The next step multiplies every gradient by `coef` (a 0-dim tensor) inside its fused kernel, through
        torch's `grad_scale` (the kernel divides by 1 / coef; the gradients are left scaled, as a multiply before the
        step would leave them). Only for the fused implementation: torch's foreach and for-loop steps refuse it."""
        if not self.defaults.get("fused"):
            raise RuntimeError("AdamW.scale_next_step needs the fused implementation (optim.impl auto or fused)")
        self._next_scale = coef.float().reciprocal()

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
        self.grad_scale, self._next_scale = self._next_scale, None  # torch's fused step reads self.grad_scale
        try:
            return self._step_by_kind(closure)
        finally:
            self.grad_scale = None

    def _step_by_kind(self, closure):
        groups = self.param_groups
        parts = self._kinds()
        if all(len(ps) == 1 for ps in parts):
            return super().step(closure)
        self.param_groups = [{**group, "params": ps} for group, kinds in zip(groups, parts) for ps in kinds]
        try:
            return super().step(closure)
        finally:
            self.param_groups = groups
