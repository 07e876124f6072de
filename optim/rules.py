"""Parameter groups by rules: name patterns -> the optimiser that updates them and their hyperparameters.

`optim.rules` is a list of ParamRule, each a set of glob patterns (fnmatch, on the names `named_parameters`
gives: `layers.3.attn.wq_b.weight`) with the optimiser and the learning-rate multiplier of the parameters it
matches. Every trainable parameter must match exactly one rule: one matched by none, or by two, is an error that
names it (and the rules). `describe` prints the assignment as a table at start-up.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from config_checks import check_choices, choice_field, positive

OPTIMIZERS = ("adamw", "muon", "sinkhorn")


@dataclass
class ParamRule:
    params: list[str] = field(default_factory=list)
    """glob patterns (fnmatch) on parameter names; a parameter matches the rule if it matches any of them"""
    optimizer: str = choice_field("adamw", OPTIMIZERS)
    """adamw: AdamW (optim.betas, optim.eps); muon: Muon (optim.muon); sinkhorn: Sinkhorn-balanced momentum
    (optim.sinkhorn)"""
    lr_mult: float = 1.0
    """the group's learning rate is optim.lr times this (the schedule scales both alike)"""
    weight_decay: float | None = None
    """decoupled weight decay; None: optim.weight_decay"""
    headwise: bool = False
    """muon only: orthogonalise each head's rows on its own (the model's head layout: model.head_rows)"""
    name: str = ""
    """the rule's label in the start-up table (default: its first pattern)"""

    def __post_init__(self) -> None:
        check_choices(self, "optim.rules[]")
        if not self.params:
            raise ValueError("optim.rules: a rule needs at least one pattern in `params`")
        positive("optim.rules[].lr_mult", self.lr_mult)
        if self.headwise and self.optimizer != "muon":
            raise ValueError(f"optim.rules {self.label}: headwise applies to optimizer=muon only, not "
                             f"{self.optimizer!r}")

    @property
    def label(self) -> str:
        return self.name or self.params[0]

    def matches(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.params)


def assign(names: list[str], rules: list[ParamRule]) -> list[int]:
    """The index of the one rule each name matches; an error naming every parameter matched by none or by two."""
    out, none, many = [], [], []
    for name in names:
        hits = [i for i, rule in enumerate(rules) if rule.matches(name)]
        if len(hits) == 1:
            out.append(hits[0])
        elif not hits:
            none.append(name)
        else:
            many.append(f"{name} ({', '.join(repr(rules[i].label) for i in hits)})")
    problems = []
    if none:
        problems.append(f"{len(none)} parameter(s) matched by no rule: {', '.join(none[:8])}"
                        + (", ..." if len(none) > 8 else ""))
    if many:
        problems.append(f"{len(many)} parameter(s) matched by more than one rule: {', '.join(many[:8])}"
                        + (", ..." if len(many) > 8 else ""))
    if problems:
        raise ValueError("optim.rules: every trainable parameter must match exactly one rule; "
                         + "; ".join(problems) + f". Rules: {[r.label for r in rules]}")
    return out


def rows_per_head(name: str, head_rows: dict[str, int]) -> int | None:
    """The rows per head of parameter `name` by the model's head layout (model.attention.head_rows: name suffix ->
    rows), None if it has none."""
    return next((r for suffix, r in head_rows.items() if name == suffix or name.endswith("." + suffix)), None)


def describe(rows: list[dict]) -> str:
    """The start-up table: rows of {rule, optimizer, lr, weight_decay, params, values}."""
    head = ("rule", "optimizer", "lr", "weight decay", "parameters", "values")
    cells = [head] + [(r["rule"], r["optimizer"], f"{r['lr']:.3g}", f"{r['weight_decay']:.3g}", str(r["params"]),
                       f"{r['values']:,}") for r in rows]
    width = [max(len(c[i]) for c in cells) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, width)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in width))
    return "\n".join(lines)
