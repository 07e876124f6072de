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

from optim.adamw import AdamW
from optim.config import OptimConfig
from optim.hybrid import Hybrid
from optim.rules import assign, describe, rows_per_head


def param_groups(params: Iterable[torch.nn.Parameter], weight_decay: float) -> list[dict]:
    """Two groups: decayed (ndim >= 2) and not decayed (ndim < 2); empty groups are dropped."""
    decay, no_decay, seen = [], [], set()
    for p in params:
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        _check_fp32(p, f"a parameter of shape {tuple(p.shape)}")
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def _check_fp32(p: torch.Tensor, what: str) -> None:
    if p.dtype != torch.float32:
        raise ValueError(f"optimizer: trainable parameters must be fp32 (they are the master weights), got {p.dtype} "
                         f"for {what}")


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimConfig, *,
                    named: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
                    head_rows: dict[str, int] | None = None, log=None) -> torch.optim.Optimizer:
    """The optimiser of `params`. With optim.rules, `named` (the module's named_parameters) gives each parameter the
    name its rule matches, and `head_rows` (model.attention.head_rows) the head layout of head-wise Muon; `log`
    (a logging function) gets the start-up table."""
    params = list(params)
    impl = "fused" if cfg.impl == "auto" else cfg.impl
    adamw_options = dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=impl == "fused",
                         foreach=impl == "foreach")
    if cfg.rules:
        if named is None:
            raise ValueError("optim.rules: the builder needs the parameters' names (named=...)")
        groups, table = rule_groups(params, named, cfg, head_rows or {})
        if log is not None:
            log("optimiser groups (optim.rules):\n" + describe(table))
        return Hybrid(groups, adamw_options)
    groups = param_groups(params, cfg.weight_decay)
    if not groups:
        raise ValueError("optimizer: no trainable parameters")
    if cfg.name == "adamw":
        opt = AdamW(groups, **adamw_options)
        devices = {p.device.type for p in params}
        if cfg.clip_in_step == "on" and len(devices) > 1:  # torch would copy the scale to the host without waiting
            raise ValueError(f"optim.clip_in_step=on: the parameters live on {sorted(devices)} (host-resident Engram "
                             "tables?); the folded clip needs them on one kind of device: use clip_in_step=auto")
        opt.clip_in_step = impl == "fused" and (cfg.clip_in_step == "on" or (cfg.clip_in_step == "auto"
                                                                              and devices == {"cuda"}))
        return opt
    raise ValueError(f"optim.name={cfg.name!r} has no builder")


def rule_groups(params: list[torch.nn.Parameter], named, cfg: OptimConfig, head_rows: dict[str, int]
                ) -> tuple[list[dict], list[dict]]:
    """The Hybrid optimiser's groups by optim.rules (one per rule, AdamW's split by decay, head-wise Muon's by rows
    per head), and the rows of the start-up table."""
    wanted = {id(p) for p in params}
    names, ps, seen = [], [], set()
    for name, p in named:
        if id(p) in wanted and id(p) not in seen:
            seen.add(id(p))
            names.append(name)  # (the plain model's: checkpointing and compile keep the names)
            ps.append(p)
    missing = wanted - seen
    if missing:
        raise ValueError(f"optim.rules: {len(missing)} trainable parameter(s) not among the module's named parameters")
    for name, p in zip(names, ps):
        _check_fp32(p, name)
    which = assign(names, cfg.rules)
    # One group per rule and variant, in rule order, those this rank holds parameters of (a pipeline stage holds
    # only some): checkpoints key the Hybrid optimiser's hyperparameters by parameter name (trainer/checkpoint/checkpointer.py).
    groups: dict[tuple, dict] = {}
    for i, rule in enumerate(cfg.rules):
        for variant in _variants(rule, head_rows):
            groups[i, variant] = _group(cfg, rule, variant)
    for name, p, i in zip(names, ps, which):
        rule = cfg.rules[i]
        if rule.optimizer == "adamw":
            variant = "decay" if p.ndim >= 2 or rule.weight_decay is not None else "no_decay"
        elif rule.headwise:
            variant = rows_per_head(name, head_rows)
            if variant is None:
                raise ValueError(f"optim.rules {rule.label!r}: head-wise Muon for {name}, which has no head "
                                 f"layout (model.attention.head_rows: {sorted(head_rows)})")
        else:
            variant = None
        groups[i, variant]["params"].append(p)
    table = [dict(rule=g["rule"], optimizer=g["kind"] + (f" (heads of {g['head_rows']} rows)"
                                                         if g.get("head_rows") else ""),
                  lr=g["lr"], weight_decay=g["weight_decay"], params=len(g["params"]),
                  values=sum(p.numel() for p in g["params"])) for g in groups.values() if g["params"]]
    return [g for g in groups.values() if g["params"]], table


def _variants(rule, head_rows: dict[str, int]) -> list:
    """A rule's groups: AdamW's decayed and not decayed parameters, head-wise Muon's per rows per head."""
    if rule.optimizer == "adamw":
        return ["decay", "no_decay"]
    if rule.headwise:
        return sorted(set(head_rows.values()))
    return [None]


def _group(cfg: OptimConfig, rule, variant) -> dict:
    wd = cfg.weight_decay if rule.weight_decay is None else rule.weight_decay
    g = dict(params=[], kind=rule.optimizer, rule=rule.label, lr=cfg.lr * rule.lr_mult, weight_decay=wd)
    if rule.optimizer == "adamw":
        g["weight_decay"] = 0.0 if variant == "no_decay" else wd
    elif rule.optimizer == "muon":
        g.update(momentum=cfg.muon.momentum, nesterov=cfg.muon.nesterov, rms=cfg.muon.rms, head_rows=variant)
    else:
        g.update(momentum=cfg.sinkhorn.momentum, nesterov=cfg.sinkhorn.nesterov, rms=cfg.sinkhorn.rms,
                 iters=cfg.sinkhorn.iters)
    return g
