"""Activation checkpointing (`parallel.activation_checkpoint=full`): every transformer block keeps only its inputs
for the backward and recomputes the rest there (torchtitan's full `apply_ac`). Applied by
`trainer.parallel.apply.parallelize` after the TP / EP / CP plans and before FSDP, on one process as on many.

Contract: `apply_activation_checkpointing(model, mode)` swaps each block's class for a checkpointing subclass
(`is_checkpointed`), so module names, state-dict keys and checkpoints are those of the model without it. Losses,
aux terms, gradients and bias updates equal the run without checkpointing (tests/parallel/
test_activation_checkpoint.py): a block's forward must stay a deterministic function of its inputs and parameters
that writes no shared state. Cost: one more forward of every block, collectives included, in the backward.

Design and reasoning: docs/parallelism.md#activation-checkpointing
"""

from __future__ import annotations

from torch import nn
from torch.utils.checkpoint import checkpoint

from trainer.config import ACTIVATION_CHECKPOINT_MODES

__all__ = ["apply_activation_checkpointing", "is_checkpointed"]


class _Checkpointed:
    """Mixin placed in front of a block's class: forward through non-reentrant activation checkpointing."""

    def forward(self, *args, **kwargs):
        return checkpoint(super().forward, *args, use_reentrant=False, **kwargs)


_CLASSES: dict[type, type] = {}


def _checkpointed_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Checkpointed{cls.__name__}", (_Checkpointed, cls), {})
    return _CLASSES[cls]


def is_checkpointed(block: nn.Module) -> bool:
    return isinstance(block, _Checkpointed)


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Checkpoint every block of `model.layers` (a Transformer, on meta or materialised) when mode is "full"; "none"
    leaves it alone. In place; idempotent."""
    if mode not in ACTIVATION_CHECKPOINT_MODES:
        raise ValueError(f"parallel.activation_checkpoint must be one of {list(ACTIVATION_CHECKPOINT_MODES)}, got "
                         f"{mode!r}")
    if mode == "none":
        return
    for block in model.layers:
        if not is_checkpointed(block):
            block.__class__ = _checkpointed_class(type(block))
