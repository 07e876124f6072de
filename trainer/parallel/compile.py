"""Regional compilation (`trainer.compile=true`): torch.compile on each transformer block, as torchtitan does.

Contract: `compile_blocks(model, mode=)` compiles each block's `forward` (with activation checkpointing, the
checkpointed forward), not its `__call__`, with `fullgraph=True` (a graph break is an error), so module hooks
(FSDP2, tensor-parallel layouts) stay eager outside the graph; the embedding, the head, the loss and the loop over
blocks stay eager. The compiled callable is an instance attribute, so parameter names, state dicts and checkpoints
are unchanged; `is_compiled` tells. Under `trainer.compile_mode=reduce-overhead` each block runs as CUDA graphs, and
`mark_step` begins a new generation of the graph trees per micro-batch forward.

Design and reasoning: docs/parallelism.md#regional-compilation
"""

from __future__ import annotations

import torch
from torch import nn

from model.block import Block

__all__ = ["CUDAGRAPH_MODES", "compile_blocks", "is_compiled", "mark_step"]

_COMPILED = "_cedar_compiled"
_CUDAGRAPHS = "_cedar_cudagraphs"  # set on the model whose blocks compile with CUDA graphs
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile's modes that record CUDA graphs
# graphs a block may need: training, evaluation and no-grad forwards, each possibly at a second sequence length
_GRAPHS_PER_BLOCK = 8


def _blocks(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, Block)]


def is_compiled(block: nn.Module) -> bool:
    return getattr(block, _COMPILED, False)


def mark_step(model: nn.Module) -> None:
    """Before a micro-batch's forward: a new generation of the CUDA graph trees when `model`'s blocks run as CUDA
    graphs (the outputs of the graphs' earlier replays are then dead), nothing otherwise."""
    if getattr(model, _CUDAGRAPHS, False):
        torch.compiler.cudagraph_mark_step_begin()


def compile_blocks(model: nn.Module, backend="inductor", fullgraph: bool = True, mode: str = "default") -> int:
    """Compile the forward of every block of `model` (a Transformer or a pipeline StageGroup) in place; idempotent.
    Returns the number of blocks compiled. Call it after activation checkpointing and the tp / ep / cp plans and
    before FSDP (torchtitan's order). fullgraph=False lets a block fall back to Python at a graph break (to find
    the breaks: bench/profile_step.py counts them) instead of failing. mode: torch.compile's (trainer.compile_mode;
    the inductor backend's), "default" for none."""
    import torch._dynamo.config as dynamo_config

    if mode != "default" and backend != "inductor":
        raise ValueError(f"compile mode {mode!r} is a mode of the inductor backend, not of {backend!r}")
    options = {} if mode == "default" else {"mode": mode}

    blocks = [b for b in _blocks(model) if not is_compiled(b)]
    need = _GRAPHS_PER_BLOCK * len(_blocks(model))
    # One code object (Block.forward) serves every block: its cache must hold a graph per block and mode.
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name) and getattr(dynamo_config, name) < need:
            setattr(dynamo_config, name, need)
    if hasattr(dynamo_config, "accumulated_recompile_limit"):
        dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 4 * need)
    for block in blocks:
        # the class's forward (the checkpointed one under activation checkpointing), bound to this block
        block.forward = torch.compile(block.forward, fullgraph=fullgraph, backend=backend, **options)
        setattr(block, _COMPILED, True)
    if mode in CUDAGRAPH_MODES:
        setattr(model, _CUDAGRAPHS, True)
    return len(blocks)
