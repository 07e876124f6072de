"""Tensor and sequence parallelism for the V4.1 backbone, applied from outside the model (`apply_tp`).

Applied first (torchtitan's order: TP -> activation checkpointing -> compile -> FSDP) on a model built on the meta
device; it installs DTensor parameters and forward hooks, so the model never sees a process group.

Contract: after `apply_tp` every parameter is a DTensor on the tp mesh (Shard where split, Replicate elsewhere);
which parameters are split, and on which dim, is `tp_shard_dims` (read off the same plan objects). Under
`sequence_parallel=True` activations between sub-blocks are Shard(1) along T (T must divide by tp), and the
replicated norms / mHC sites get Partial gradients that `reduce_partial_grads` completes after backward. With
`loss_parallel` (default) the logits stay vocab-sharded and the caller computes the cross-entropy and backward
inside `torch.distributed.tensor.parallel.loss_parallel()`. `apply_tp` refuses parameters another plan already
distributed (not composed with EP's expert split).

Design and reasoning: docs/parallelism.md#tensor-and-sequence-parallelism
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.distributed.tensor.placement_types import Placement
from torch.utils._pytree import tree_map_only

__all__ = ["apply_tp", "block_shard_dims", "reduce_partial_grads", "tp_shard_dims"]


# ---------------------------------------------------------------------------------------------------------------------
# Tensor parallelism
# ---------------------------------------------------------------------------------------------------------------------


def _place_params(module: nn.Module, mesh: DeviceMesh, placements: dict[str, Placement] | Placement) -> None:
    """Turn parameters into DTensors: `placements` maps names (relative to `module`) to a placement, or is one
    placement for every parameter below `module`. No communication: every rank built the same model (on meta, or with
    the same seed) and keeps its own slice. A parameter another plan already distributed is an error: the hooks of
    this plan assume its own placements."""
    for name, param in list(module.named_parameters()):
        placement = placements if isinstance(placements, Placement) else placements.get(name)
        if placement is None:
            continue
        if isinstance(param, DTensor):
            if param.device_mesh == mesh and param.placements == (placement,):
                continue
            raise ValueError(f"apply_tp: {name} of {type(module).__name__} is already distributed "
                             f"({param.placements} on {param.device_mesh}); tensor parallelism must be applied first")
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        dist = distribute_tensor(param, mesh, [placement], src_data_rank=None)
        owner.register_parameter(attr, nn.Parameter(dist, requires_grad=param.requires_grad))


def _grad_all_reduce(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Identity forward; the gradient, a partial sum on each rank, is all-reduced on the way back (Megatron's `f`)."""
    return DTensor.from_local(t, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


class DistributeParams(ParallelStyle):
    """Only place parameters (no hooks): for parameters the model reads through `model.common.local`."""

    def __init__(self, placements: dict[str, Placement]):
        self.placements = placements

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        missing = set(self.placements) - {name for name, _ in module.named_parameters()}
        if missing:
            raise ValueError(f"DistributeParams: {type(module).__name__} has no parameters {sorted(missing)}")
        _place_params(module, device_mesh, self.placements)
        return module


class ReplicateParallel(ParallelStyle):
    """Replicated parameters, computed in DTensor form (torchtitan's NoParallel, and SequenceParallel generalised to
    several inputs and tuple outputs).

    Positional tensor inputs become DTensors with `input_layouts[i]` (None: left alone), redistributed to
    `desired_input_layouts[i]` where given; the module then runs on DTensors, so every parameter gradient gets its
    placement from the data: Partial (summed over tp) when the inputs are sequence shards, Replicate when every rank
    holds the whole sequence. Outputs (tensors, tuples, named tuples) are redistributed to `output_layout` if given
    (an explicit, autograd-tracked step) and come back as local tensors.
    partial_output_grad: the output's consumers hold only this rank's heads, so its gradient is all-reduced.
    """

    def __init__(self, *, input_layouts: tuple[Placement | None, ...] = (Replicate(),),
                 desired_input_layouts: tuple[Placement | None, ...] | None = None,
                 output_layout: Placement | None = None, partial_output_grad: bool = False):
        self.input_layouts = input_layouts
        self.desired_input_layouts = desired_input_layouts or input_layouts
        self.output_layout = output_layout
        self.partial_output_grad = partial_output_grad

    def _inputs(self, mesh: DeviceMesh, args: tuple) -> tuple:
        out = list(args)
        for i, (src, dst) in enumerate(zip(self.input_layouts, self.desired_input_layouts)):
            if i >= len(args) or src is None or not isinstance(args[i], torch.Tensor) or isinstance(args[i], DTensor):
                continue
            t = DTensor.from_local(args[i], mesh, [src], run_check=False)
            out[i] = t.redistribute(mesh, [dst]) if dst != src else t
        return tuple(out)

    def _outputs(self, mesh: DeviceMesh, outputs):
        def to_local(t: DTensor) -> torch.Tensor:
            if self.output_layout is not None and t.placements != (self.output_layout,):
                t = t.redistribute(mesh, [self.output_layout])
            t = t.to_local()
            return _grad_all_reduce(t, mesh) if self.partial_output_grad else t

        return tree_map_only(DTensor, to_local, outputs)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _place_params(module, device_mesh, Replicate())
        module.register_forward_pre_hook(lambda _, args: self._inputs(device_mesh, args))
        module.register_forward_hook(lambda _, args, out: self._outputs(device_mesh, out))
        return module


class GatherInputs(ParallelStyle):
    """Entry of a region that needs the whole sequence (attention, MoE): positional tensor inputs with a layout are
    all-gathered to Replicate and handed over as local tensors (None inputs pass). The backward of the gather is a
    slice: the plans make every gradient that reaches these inputs complete on every rank."""

    def __init__(self, input_layouts: tuple[Placement | None, ...]):
        self.input_layouts = input_layouts

    def _inputs(self, mesh: DeviceMesh, args: tuple) -> tuple:
        out = list(args)
        for i, src in enumerate(self.input_layouts):
            if i >= len(args) or src is None or not isinstance(args[i], torch.Tensor) or src == Replicate():
                continue
            out[i] = DTensor.from_local(args[i], mesh, [src], run_check=False).redistribute(mesh, [Replicate()])
            out[i] = out[i].to_local()
        return tuple(out)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(lambda _, args: self._inputs(device_mesh, args))
        return module


class PartialGradInputs(ParallelStyle):
    """Floating-point tensor inputs are read by this rank's shard of the weights only: their gradients are partial
    sums, all-reduced on the way back."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def hook(_, args):
            return tuple(_grad_all_reduce(a, device_mesh) if isinstance(a, torch.Tensor) and a.is_floating_point()
                         else a for a in args)

        module.register_forward_pre_hook(hook)
        return module


class _Chain(ParallelStyle):
    """Several styles on one module, applied in order."""

    def __init__(self, *styles: ParallelStyle):
        self.styles = styles

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for style in self.styles:
            module = style._apply(module, device_mesh)
        return module


def _no_scatter(style: ParallelStyle) -> ParallelStyle:
    # Every rank holds the same full weights before parallelising, so built-in styles keep their own slice instead of
    # scattering rank 0's (no communication, and meta tensors are fine).
    style.src_data_rank = None
    return style


def _block_plan(block: nn.Module, seq: Placement) -> dict[str, ParallelStyle]:
    """The TP plan of one transformer block, keyed by module path. seq: the layout of activations between sub-blocks
    (Shard(1) under sequence parallelism, Replicate otherwise)."""
    attn = block.attn
    plan: dict[str, ParallelStyle] = {
        # per-token sites: local sequence shard (SP) or the whole sequence
        "attn_norm": ReplicateParallel(input_layouts=(seq,)),
        "ffn_norm": ReplicateParallel(input_layouts=(seq,)),
        "hc_attn": ReplicateParallel(input_layouts=(seq,)),
        "hc_ffn": ReplicateParallel(input_layouts=(seq,)),
        # attention: forward(x, state, kv_in)
        "attn": _Chain(GatherInputs((seq, None, seq)), DistributeParams({"attn_sink": Shard(0)})),
        "attn.wq_a": ReplicateParallel(),
        "attn.q_norm": ReplicateParallel(),
        "attn.wq_b": _no_scatter(ColwiseParallel()),  # its input hook all-reduces q_res's gradient
        "attn.wkv": ReplicateParallel(),
        "attn.kv_norm": ReplicateParallel(partial_output_grad=True),
        "attn.wo_a": DistributeParams({"weight": Shard(0)}),  # G/tp groups = this rank's heads
        "attn.wo_b": _no_scatter(RowwiseParallel(output_layouts=seq)),
        "attn.head_sum": PrepareModuleOutput(output_layouts=Partial(), desired_output_layouts=Replicate()),
        # MoE: forward(x, image_mask) -> (y, load, balance loss); experts and shared expert return partial sums of y,
        # reduced once at the output; load and loss are the same on every tp rank (all route the same tokens)
        "ffn": _Chain(GatherInputs((seq, None)),
                      PrepareModuleOutput(output_layouts=(Partial(), None, None),
                                          desired_output_layouts=(seq, None, None))),
        "ffn.gate": DistributeParams({"weight": Replicate()}),
        "ffn.experts": _Chain(DistributeParams({"w1": Shard(1), "w3": Shard(1), "w2": Shard(2)}),
                              PartialGradInputs()),
    }
    if block.ffn.shared_experts is not None:
        plan.update({
            # hand w1/w3 a DTensor, so their two partial input gradients meet and are all-reduced once
            "ffn.shared_experts": PrepareModuleInput(input_layouts=(Replicate(),),
                                                     desired_input_layouts=(Replicate(),)),
            "ffn.shared_experts.w1": _no_scatter(ColwiseParallel()),
            "ffn.shared_experts.w3": _no_scatter(ColwiseParallel()),
            "ffn.shared_experts.w2": _no_scatter(RowwiseParallel(output_layouts=Partial())),
        })
    if attn.compressor is not None:
        plan["attn.compressor"] = ReplicateParallel(partial_output_grad=True)
    if attn.indexer is not None:
        for name, child in attn.indexer.named_children():
            if child is not None:
                plan[f"attn.indexer.{name}"] = ReplicateParallel()
    if block.engram is not None:
        # forward(S, row_ids, dead) on the whole sequence, the output sliced back (see the module docstring)
        plan["engram"] = ReplicateParallel(input_layouts=(seq, Replicate(), Replicate()),
                                           desired_input_layouts=(Replicate(),) * 3, output_layout=seq)
    return plan


def _vision_plan(vision: nn.Module) -> dict[str, ParallelStyle]:
    """The TP plan of the vision tower (model/vision/vit.py `VisionEncoder`), keyed by module path below it. Every
    tp rank runs the tower on all of the batch's images (the images are the batch's, which tp peers share), so the
    activations between its blocks are replicated, as the backbone's without sequence parallelism: Megatron's pairs
    inside each block, heads split (wq, wk, wv column-wise; wo row-wise, all-reduced) and the SwiGLU width split (w1,
    w3 column-wise; w2 row-wise), the aligner's two linears likewise (column-, then row-wise). Replicated: the patch
    embedding, the norms and the START / NEWLINE / END vectors (read through `model.common.local`). The input of
    each split pair enters as one DTensor, so the partial gradients of its column-wise linears meet and are
    all-reduced once."""
    plan: dict[str, ParallelStyle] = {
        "": DistributeParams({"image_start": Replicate(), "image_newline": Replicate(), "image_end": Replicate()}),
        "vit.patch_embed": ReplicateParallel(),
        "vit.norm": ReplicateParallel(),
        "aligner": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
        "aligner.w1": _no_scatter(ColwiseParallel()),
        "aligner.w2": _no_scatter(RowwiseParallel()),
    }
    for i in range(len(vision.vit.layers)):
        p = f"vit.layers.{i}"
        plan.update({
            f"{p}.attn_norm": ReplicateParallel(),
            f"{p}.mlp_norm": ReplicateParallel(),
            # forward(x, cos, sin, seqlens): x one DTensor for wq, wk and wv
            f"{p}.attn": PrepareModuleInput(input_layouts=(Replicate(), None, None, None),
                                            desired_input_layouts=(Replicate(), None, None, None)),
            f"{p}.attn.wq": _no_scatter(ColwiseParallel()),
            f"{p}.attn.wk": _no_scatter(ColwiseParallel()),
            f"{p}.attn.wv": _no_scatter(ColwiseParallel()),
            f"{p}.attn.wo": _no_scatter(RowwiseParallel()),
            f"{p}.mlp": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
            f"{p}.mlp.w1": _no_scatter(ColwiseParallel()),
            f"{p}.mlp.w3": _no_scatter(ColwiseParallel()),
            f"{p}.mlp.w2": _no_scatter(RowwiseParallel()),
        })
    return plan


def _check_tp(model: nn.Module, tp: int) -> None:
    # Even shards: the attention's per-rank head and group counts come from shard shapes and must line up.
    cfg = model.cfg
    a, moe = cfg.attention, cfg.moe
    sizes = {"attention.num_heads": a.num_heads, "attention.o_groups": a.o_groups, "moe.expert_dim": moe.expert_dim,
             "dim": cfg.dim, "vocab_size": cfg.vocab_size}
    if getattr(model, "vision", None) is not None:  # the tower's heads and SwiGLU width (the aligner's: dim)
        sizes.update({"vision.num_heads": cfg.vision.num_heads, "vision.mlp_dim": cfg.vision.mlp_dim})
    for name, size in sizes.items():
        if size % tp:
            raise ValueError(f"tensor parallelism: model.{name}={size} is not divisible by tp={tp}")


def _top_plan(seq: Placement, loss_parallel: bool) -> dict[str, ParallelStyle]:
    """The TP plan of the modules outside the blocks (embedding, final norm, head), keyed by module path."""
    return {
        "embed": _no_scatter(ColwiseParallel(input_layouts=Replicate(), output_layouts=seq)),
        "norm": ReplicateParallel(input_layouts=(seq,)),
        "head": _no_scatter(ColwiseParallel(input_layouts=seq,
                                            output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                            use_local_output=not loss_parallel)),
    }


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool, *, loss_parallel: bool = True) -> None:
    """Tensor (and sequence) parallelism for a `model.transformer.Transformer`, in place; see docs/parallelism.md.

    With loss_parallel the model returns logits as a DTensor sharded over the vocabulary: compute the loss and call
    backward inside `torch.distributed.tensor.parallel.loss_parallel()`. A tp mesh of size 1 leaves the model alone.
    """
    tp = tp_mesh.size()
    if tp == 1:
        return
    _check_tp(model, tp)
    seq = Shard(1) if sequence_parallel else Replicate()
    for block in model.layers:
        parallelize_module(block, tp_mesh, _block_plan(block, seq))
    parallelize_module(model, tp_mesh, _top_plan(seq, loss_parallel))
    if getattr(model, "vision", None) is not None:
        plan = _vision_plan(model.vision)
        parallelize_module(model.vision, tp_mesh, plan.pop(""))  # the tower's own parameters
        parallelize_module(model.vision, tp_mesh, plan)
        if sequence_parallel:
            # Each rank places the features of its chunk's placeholders only (model.forward.embed_streams reads
            # which chunk from image_sequence_shard), so the tower's output gets a partial gradient on each rank:
            # summed over tp on the way back (Megatron's `f`), the tower's gradients are complete everywhere.
            model.image_sequence_shard = (tp_mesh.get_local_rank(), tp)
            model.vision.register_forward_hook(lambda _, args, out: _grad_all_reduce(out, tp_mesh))
    if sequence_parallel:
        def check_length(_, args, kwargs):
            T = (args[0] if args else kwargs["input_ids"]).shape[1]
            if T % tp:
                raise ValueError(f"sequence parallelism: sequence length {T} is not divisible by tp={tp}")

        model.register_forward_pre_hook(check_length, with_kwargs=True)


def _style_placements(style: ParallelStyle, module: nn.Module) -> dict[str, Placement]:
    """The placement `style` gives the parameters below `module` (names relative to it) when applied to it; the
    parameters it leaves alone are absent. Torch's ColwiseParallel / RowwiseParallel are read as their
    `_partition_*_fn` place them. A style not listed here is an error rather than "no parameters", so a new style in
    the plans cannot silently drop out of `tp_shard_dims`."""
    if isinstance(style, _Chain):
        out: dict[str, Placement] = {}
        for s in style.styles:
            out.update(_style_placements(s, module))
        return out
    if isinstance(style, DistributeParams):
        return dict(style.placements)
    if isinstance(style, ReplicateParallel):
        return {name: Replicate() for name, _ in module.named_parameters()}
    if isinstance(style, (ColwiseParallel, RowwiseParallel)):
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            raise TypeError(f"{type(style).__name__} on {type(module).__name__}: torch supports Linear and Embedding")
        linear = isinstance(module, nn.Linear)
        if isinstance(style, ColwiseParallel):  # Linear: output rows (weight and bias); Embedding: channels
            return {name: Shard(0 if linear else 1) for name, _ in module.named_parameters()}
        if linear:  # input columns; the bias is replicated
            return {name: Shard(1) if name == "weight" else Replicate() for name, _ in module.named_parameters()}
        return {name: Shard(0) for name, _ in module.named_parameters()}  # Embedding: vocabulary rows
    if isinstance(style, (GatherInputs, PartialGradInputs, PrepareModuleInput, PrepareModuleOutput)):
        return {}
    raise TypeError(f"tp_shard_dims: no parameter placements known for {type(style).__name__}")


def _plan_shard_dims(root: nn.Module, plan: dict[str, ParallelStyle]) -> dict[str, int]:
    out: dict[str, int] = {}
    for path, style in plan.items():
        module = root.get_submodule(path)
        for name, placement in _style_placements(style, module).items():
            if isinstance(placement, Shard):
                full = f"{path}.{name}" if path else name
                out[full] = placement.dim % module.get_parameter(name).ndim
    return out


def block_shard_dims(block: nn.Module) -> dict[str, int]:
    """`tp_shard_dims` of one transformer block, names relative to the block (`attn.wq_b.weight`): what a
    per-layer count (model/accounting.py) needs. The layout of activations does not move parameters, so the plan is
    read without sequence parallelism."""
    return _plan_shard_dims(block, _block_plan(block, Replicate()))


def tp_shard_dims(model: nn.Module) -> dict[str, int]:
    """Every parameter tensor parallelism splits (full names, as `model.named_parameters()` gives them) -> the dim it
    splits along, read off the plans `apply_tp` applies (`_block_plan`, `_top_plan`), so the planner and the
    accounting (trainer/memory_plan.py, model/accounting.py) count the very layout the trainer builds. Parameters not
    listed are replicated over tp. Pure: reads only the model's structure (a meta-device model is fine), no process
    group."""
    dims: dict[str, int] = {}
    for key, block in model.layers.named_children():
        dims.update({f"layers.{key}.{name}": d for name, d in block_shard_dims(block).items()})
    dims.update(_plan_shard_dims(model, _top_plan(Replicate(), loss_parallel=True)))
    if getattr(model, "vision", None) is not None:
        dims.update({f"vision.{name}": d for name, d in vision_shard_dims(model.vision).items()})
    return dims


def vision_shard_dims(vision: nn.Module) -> dict[str, int]:
    """`tp_shard_dims` of a vision tower (model/vision/vit.py `VisionEncoder`), names relative to it."""
    return _plan_shard_dims(vision, _vision_plan(vision))


def reduce_partial_grads(model: nn.Module) -> None:
    """Complete the Partial gradients (under SP: the norms and mHC sites, which saw only this rank's tokens) with one
    all-reduce each, so clipping and the optimiser read plain replicated gradients. Call after backward when no
    FSDP wraps the model (FSDP2 redistributes a gradient to its parameter's placement itself)."""
    for p in model.parameters():
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            p.grad = g.redistribute(placements=p.placements)
