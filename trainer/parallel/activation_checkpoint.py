"""Activation checkpointing (`parallel.activation_checkpoint=full`): every transformer block keeps only its inputs
for the backward and recomputes the rest there (Megatron `--recompute-granularity full --recompute-method uniform
--recompute-num-layers 1`; torchtitan's full `apply_ac`). Applied by `trainer.parallel.apply.parallelize` after the
TP / EP / CP plans and before FSDP (torchtitan's order), on one process as on many.

Memory: a block then keeps its streams S [B, T, n, dim] and `pre` [B, T, n] (its inputs) instead of every
intermediate; the ForwardState's tensors (compressed KV, top-k, pool, h_{L/2}) are held by the state either way.
Cost: one more forward of every block, collectives included (tp, ep, cp, Engram rows), in the backward.

How a block is wrapped. `Block.forward` runs inside non-reentrant `torch.utils.checkpoint`, by swapping the block's
class for a subclass whose forward calls the original through the checkpoint (what `fully_shard` does for FSDP):
module names, state-dict keys and checkpoints stay those of the model without checkpointing (a checkpoint saved
with it loads without it and back), the pipeline's stage modules and StageGroup reference the same blocks, and the
checkpointed function receives the block's arguments after every forward pre-hook (TP's input layouts, FSDP's).
The recomputation calls `Block.forward` directly: module hooks do not run again (FSDP's pre-backward hook has
already unsharded the block).

Side effects: none to guard. A block reads the ForwardState and returns what it makes (its KV, top-k, pool, indexer
KL, MoE loads and balance loss: `model.attention.LayerOutputs`); the loop over blocks records that in the state
(`model.transformer.forward_blocks`), and the trainer adds the loads to the balancing counters. A recomputation
calls the block again and drops what it returns, so no loss term or expert load is counted twice, and the tensors
it rebuilds for autograd are the forward's (same inputs, same function: see below), the top-k and pool included.

Gradients through the state. Non-reentrant checkpointing keeps the forward's autograd graph and drops only the
tensors saved for backward, which the recomputation rebuilds (matched by order; shapes, dtypes and devices are
checked). A tensor a block returns for later layers (its KV, read by Reuse and Reindex layers) is an ordinary
node of that graph: later layers' gradients reach it and flow on into the checkpointed block like the gradient of
its streams. tests/parallel/test_activation_checkpoint.py proves losses, aux terms, gradients and bias updates
equal to the run without checkpointing.

What recomputation assumes: a block's forward is a deterministic function of its inputs and parameters, so MoE
routing, the top-k and the pool come out the same. It is: the recomputation
starts from the forward's own inputs, the forward kernels use no atomics (only backward kernels do), and on CPU
the whole step is bitwise the one without checkpointing (tests/parallel/test_activation_checkpoint.py, the Triton
path under the interpreter too). The block draws no random numbers; the RNG state is stashed and restored anyway
(preserve_rng_state), so a dropout added later would be replayed exactly.
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
