"""All parallel plans applied to the meta-built model in one place: `validate_layout`, `parallelize`, `materialize`.

Order: `validate_layout` before any process group exists (each error names the key to change); `parallelize` on the
whole meta-built Transformer: TP -> EP -> CP -> activation checkpointing, then the pipeline split (this rank's
stages in one `StageGroup` named like the whole model) and Engram row sharding; `materialize`: piece by piece,
`to_empty`, init from the piece's own seed (`piece_seed`), then FSDP2 `fully_shard` when dp_shard > 1.

Contract: every layout (one process, TP / EP shards, any pipeline split) holds exactly the single process's
initial values of what it holds, and module names match the unparallelised model. The result is a
`ParallelModel` (meshes None for a single process), what trainer/parallel/gradients.py takes.

Design and reasoning: docs/parallelism.md#applying-the-plans
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from typing import TYPE_CHECKING

import torch
from torch import nn

from model.common import init_normal
from model.config import ModelConfig
from model.layer_plan import build_layer_plan
from trainer.parallel.tensor import apply_tp
from trainer.config import ENGRAM_SHARD_AXES, ParallelConfig, ParallelDims
from trainer.parallel.activation_checkpoint import apply_activation_checkpointing
from trainer.parallel.context import apply_cp, check_sequence_length
from trainer.parallel.engram import apply_engram_sharding, engram_tables
from trainer.parallel.expert import AllToAllDispatcher, apply_ep, moe_layers
from trainer.parallel.pipeline import build_pipeline, check_torch_version, split_model, split_points, stage_ids_for_rank

if TYPE_CHECKING:  # importing the mesh machinery costs a single process a second or so
    from torch.distributed.device_mesh import DeviceMesh

    from trainer.parallel.engram import EngramSharding
    from trainer.parallel.mesh import Meshes

__all__ = ["ParallelModel", "StageGroup", "validate_layout", "parallelize", "materialize", "piece_seed", "describe"]


# ---------------------------------------------------------------------------------------------------------------------
# Start-up checks


def validate_layout(parallel: ParallelConfig, cfg: ModelConfig, *, seq_len: int, grad_accum: int) -> list[int]:
    """ValueError naming the key and the value for a layout this model and batch cannot run; returns the pipeline
    cuts (first layer of each stage but the first; [] without pp). Needs no world size and no process group.

    tp must divide the query heads, the output groups, the expert width, the hidden width and the vocabulary (the
    plan of trainer/parallel/tensor.py splits them; the indexer is replicated, so its heads need not divide); under
    sequence parallelism also each rank's sequence. ep must divide the routed experts; cp the sequence, in chunks
    whole in every compression ratio and at least one window halo long; pp * pp_virtual stages must fit the layer
    plan (trainer/parallel/pipeline.py split_points) and the schedule must get enough micro-batches."""
    if parallel.tp > 1:
        a, moe = cfg.attention, cfg.moe
        for key, size in (("attention.num_heads", a.num_heads), ("attention.o_groups", a.o_groups),
                          ("moe.expert_dim", moe.expert_dim), ("dim", cfg.dim), ("vocab_size", cfg.vocab_size)):
            if size % parallel.tp:
                raise ValueError(f"parallel.tp={parallel.tp} does not divide model.{key}={size}: tensor parallelism "
                                 f"splits it evenly; choose a tp that divides it")
        if parallel.sequence_parallel and (seq_len // parallel.cp) % parallel.tp:
            raise ValueError(f"parallel.sequence_parallel: the sequence (data.seq_len={seq_len}, / cp={parallel.cp}) "
                             f"does not split into tp={parallel.tp} equal shards; choose a data.seq_len that does")
    if parallel.ep > 1 and cfg.moe.num_experts % parallel.ep:
        raise ValueError(f"parallel.ep={parallel.ep} does not divide model.moe.num_experts={cfg.moe.num_experts}: each "
                         "expert-parallel rank holds num_experts / ep experts; choose an ep that divides it")
    if parallel.cp > 1:
        try:
            check_sequence_length(cfg, seq_len, parallel.cp)
        except ValueError as e:
            raise ValueError(f"parallel.cp={parallel.cp} with data.seq_len={seq_len}: {e}") from None
    if parallel.pp == 1:
        return []

    check_torch_version()

    plan = build_layer_plan(cfg)
    num_stages = parallel.pp * parallel.pp_virtual
    if parallel.pp_cuts:
        cuts = list(parallel.pp_cuts)
    else:
        try:
            cuts = split_points(plan, num_stages)
        except ValueError as e:
            reason = str(e).split("; any_layer")[0]  # that switch is parallel.pp_cuts here
            raise ValueError(f"parallel.pp={parallel.pp} x parallel.pp_virtual={parallel.pp_virtual}: {reason}; use "
                             "fewer stages, or give the cuts with parallel.pp_cuts (a cut in front of a Reuse layer "
                             "also ships its top-k)") from None
    if any(b >= c for b, c in zip([0, *cuts], [*cuts, cfg.num_layers])):
        raise ValueError(f"parallel.pp_cuts={cuts} must increase strictly inside (0, model.num_layers="
                         f"{cfg.num_layers})")
    _check_microbatches(parallel, parallel.pp, grad_accum)
    return cuts


def _check_microbatches(parallel: ParallelConfig, pp: int, grad_accum: int) -> None:
    """The schedules' own rules (torch.distributed.pipelining), stated in our keys. Every schedule, the zero-bubble
    ones included, trains exactly like the single process on the tiny model's splits where compressed KV and indexer
    keys cross a cut (tests/parallel/test_layouts.py, tests/parallel/test_zero_bubble.py); the zero-bubble split
    backward needs the stage module's hooks for that (trainer/parallel/zero_bubble.py). With activation
    checkpointing a zero-bubble schedule recomputes each block twice, once for the input pass and once for the
    weight pass (two autograd calls), exactly (tests/parallel/test_zero_bubble.py)."""
    num_stages = pp * parallel.pp_virtual
    if parallel.pp_schedule == "1F1B" and grad_accum < num_stages:
        raise ValueError(f"parallel.pp_schedule={parallel.pp_schedule} needs at least as many micro-batches as "
                         f"stages: trainer.grad_accum={grad_accum} < pp * pp_virtual = {num_stages}; raise "
                         "trainer.grad_accum")
    if parallel.pp_schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, grad_accum // pp)
        if grad_accum % rounds:
            raise ValueError(f"parallel.pp_schedule={parallel.pp_schedule} runs micro-batches in rounds of pp={pp}: "
                             f"trainer.grad_accum={grad_accum} must be below pp or a multiple of "
                             f"{rounds} (grad_accum // pp); a multiple of pp always works")


# ---------------------------------------------------------------------------------------------------------------------
# The plans


class StageGroup(nn.Module):
    """This pipeline rank's stage modules as one module under the whole model's names (`embed`, `layers.<i>`,
    `norm`, `head`, `hasher`): the optimiser, gradient reduction and DCP checkpoints see exactly the parameters
    and fully-qualified names the single process has for these layers. Not called: the schedule runs the stages."""

    def __init__(self, stages: list[nn.Module]):
        super().__init__()
        self.cfg = stages[0].cfg
        self.layers = nn.ModuleDict()
        for stage in stages:
            for name, child in stage.named_children():
                if name == "layers":
                    self.layers.update(child)
                elif child is not None:
                    self.add_module(name, child)
        self.layers = nn.ModuleDict(sorted(self.layers.items(), key=lambda kv: int(kv[0])))

    def forward(self, *args):
        raise RuntimeError("StageGroup is not called: the pipeline schedule runs its stage modules")


@dataclass
class ParallelModel:
    """What this rank runs and holds after `parallelize`."""

    module: nn.Module  # the Transformer, or the StageGroup of this rank's stages: parameters under global names
    meshes: Meshes | None  # None for a single process
    dims: ParallelDims
    sequence_parallel: bool
    stages: list = field(default_factory=list)  # PipelineStageModules of this rank (pp > 1)
    fsdp: bool = False  # dp_shard > 1: blocks and roots wrapped by fully_shard in `materialize`
    ep_cp: DeviceMesh | None = None  # ep x cp flattened: what FSDP's reduction leaves to reduce (fsdp only)
    pipeline: object = None  # trainer.parallel.pipeline.Pipeline, built by `materialize`
    engram: EngramSharding | None = None  # parallel.engram_shard: this rank's Engram row readers (prefetch handle)
    activation_checkpoint: str = "none"  # parallel.activation_checkpoint the blocks were wrapped with

    @classmethod
    def local(cls, module: nn.Module) -> ParallelModel:
        """A module one process runs with no plan that reduces across ranks (a plain model, or one whose plan needs
        no cross-rank reduction of gradients or loads, e.g. tensor parallelism alone)."""
        return cls(module, None, ParallelDims(1, 1, 1, 1, 1, 1), sequence_parallel=False)

    @property
    def loss_parallel(self) -> bool:
        """The logits come back vocab-sharded (a DTensor): cross-entropy under tensor.parallel.loss_parallel."""
        return self.dims.tp > 1 and self.dims.pp == 1

    @property
    def cfg(self) -> ModelConfig:
        return self.module.cfg


def _apply_ep_over_tp(model: nn.Module, meshes: Meshes, capacity_factor: float = 0.0) -> None:
    """EP on experts that TP already split along their width F: rank (e, t) keeps experts [e * E/ep, (e+1) * E/ep)
    of its F/tp columns, a DTensor on the (ep, tp) mesh with placements (Shard(0), Shard(F's dim)). Every tp rank
    routes the same tokens, so the ep all-to-all of one tp rank carries what its tp peers' carry; TP's hooks
    (experts' input gradient all-reduced over tp, MoE output reduced over tp) then stay exact."""
    from torch.distributed.tensor import DTensor, Shard

    mesh = meshes.world["ep", "tp"]
    ep, rank = meshes.ep.size(), meshes.ep.get_local_rank()
    for moe in moe_layers(model):
        experts = moe.experts
        num_experts = experts.w1.shape[0]
        e_local = num_experts // ep
        for name in ("w1", "w3", "w2"):
            w = getattr(experts, name)
            (tp_placement,) = w.placements  # Shard(1) for w1 / w3, Shard(2) for w2 (apply_tp's plan)
            rows = w.to_local().detach()[rank * e_local:(rank + 1) * e_local].clone()
            shard = DTensor.from_local(rows, mesh, [Shard(0), tp_placement], run_check=False)
            experts.register_parameter(name, nn.Parameter(shard, requires_grad=w.requires_grad))
        moe.dispatcher = AllToAllDispatcher(meshes.ep.get_group(), num_experts, capacity_factor)


def parallelize(model: nn.Module, meshes: Meshes | None, parallel: ParallelConfig, dims: ParallelDims, *,
                cuts: list[int]) -> ParallelModel:
    """Apply TP -> EP -> CP -> activation checkpointing to the meta-built Transformer, then cut this rank's pipeline
    stages (see docs/parallelism.md). FSDP comes in `materialize`. A single process (meshes None) gets only the
    activation checkpointing."""
    if meshes is None:
        apply_activation_checkpointing(model, parallel.activation_checkpoint)
        return ParallelModel(model, None, dims, False, activation_checkpoint=parallel.activation_checkpoint)
    if dims.tp > 1:
        # Pipeline stages exchange plain tensors and the pipeline's loss reads whole logits: no loss_parallel (the
        # head all-gathers the logits; under sequence parallelism also the sequence, so the last stage returns
        # whole [B, T, V] logits while the streams cross cuts as sequence shards).
        apply_tp(model, meshes.tp, parallel.sequence_parallel, loss_parallel=dims.pp == 1)
    if dims.ep > 1:
        if dims.tp > 1:
            _apply_ep_over_tp(model, meshes, parallel.ep_capacity_factor)
        else:
            apply_ep(model, meshes.ep, capacity_factor=parallel.ep_capacity_factor)
    if dims.cp > 1:
        apply_cp(model, meshes.cp)
    apply_activation_checkpointing(model, parallel.activation_checkpoint)  # after the plans' hooks, before FSDP
    pm = ParallelModel(model, meshes, dims, parallel.sequence_parallel and dims.tp > 1, fsdp=dims.dp_shard > 1,
                       activation_checkpoint=parallel.activation_checkpoint)
    if pm.fsdp and dims.ep * dims.cp > 1:
        pm.ep_cp = meshes.world["ep", "cp"]._flatten("ep_cp")  # every rank creates the group, now
    if dims.pp > 1:
        ids = stage_ids_for_rank(meshes.pp.get_local_rank(), dims.pp, parallel.pp_virtual, parallel.pp_schedule)
        pm.stages = split_model(model, cuts, ids)
        pm.module = StageGroup(pm.stages)
    if parallel.engram_shard and model.cfg.engram.layers:
        # After the cut, so only this rank's Engram layers get a reader; over the ranks of its stage and tp rank on
        # the axes parallel.engram_shard_over names, replicated over the rest of dp x ep x cp. On meta:
        # init_weights then draws each rank's rows with the single process's values.
        over = [a for a in ENGRAM_SHARD_AXES if a in parallel.engram_shard_over]
        rest = [a for a in ENGRAM_SHARD_AXES if a not in over]
        group = meshes.dp_ep_cp if not rest else _submesh(meshes.world, over, "engram_rows")
        replicas = _submesh(meshes.world, rest, "engram_replicas").get_group() if rest else None
        pm.engram = apply_engram_sharding(pm.module, group, host_memory=parallel.engram_host_memory)
        pm.engram.replica_group = replicas
    return pm


def _submesh(world: DeviceMesh, axes: list[str], name: str) -> DeviceMesh:
    """The 1-D mesh over `axes` of the world mesh (flattened when there are several)."""
    return world[axes[0]] if len(axes) == 1 else world[tuple(axes)]._flatten(name)


# ---------------------------------------------------------------------------------------------------------------------
# Materialisation, initialisation, FSDP


def piece_seed(seed: int, piece: int) -> int:
    """The generator seed of one piece of the model (see docs/parallelism.md#applying-the-plans)."""
    return (seed * 1_000_003 + piece) % 2**63


VISION_PIECE = 1_000_000
"""The vision tower's piece id: past every 4 + layer index a model can have, so adding the tower (after the layers
had their ids) changes no other piece's seed and hence no text-only model's initial values."""


def _pieces(module: nn.Module) -> list[tuple[int, nn.Module, object, bool]]:
    """(piece id, module, init, is a block) for what `module` holds. A Transformer or StageGroup, in
    Transformer.init_weights' terms: embedding 0, head 1, final norm 2, Engram hasher 3, layer i -> 4 + i (the
    layers are the blocks: FSDP units), the vision tower VISION_PIECE. Another module (the DSpark drafter) lists its
    own (`init_pieces`)."""
    if hasattr(module, "init_pieces"):
        return module.init_pieces()
    cfg = module.cfg
    out = []
    if getattr(module, "embed", None) is not None:
        out.append((0, module.embed, lambda: init_normal(module.embed.weight, cfg.init_std), False))
    if getattr(module, "head", None) is not None:
        out.append((1, module.head, lambda: init_normal(module.head.weight, cfg.init_std), False))
    if getattr(module, "norm", None) is not None:
        out.append((2, module.norm, module.norm.init_weights, False))
    if getattr(module, "hasher", None) is not None:
        out.append((3, module.hasher, module.hasher.init_buffers, False))
    if getattr(module, "vision", None) is not None:
        # Not a block: its own FSDP unit would all-gather only on ranks whose micro-batch holds an image, and the
        # ranks without one would hang in the collective; in the root it is gathered with the embedding every step.
        out.append((VISION_PIECE, module.vision, module.vision.init_weights, False))
    layers = module.layers.values() if isinstance(module.layers, nn.ModuleDict) else module.layers
    out += [(4 + layer.spec.index, layer, layer.init_weights, True) for layer in layers]
    return out


def _engram_tables(module: nn.Module) -> set[nn.Parameter] | None:
    """Row-sharded Engram tables FSDP must leave alone: it would all-gather whole tables (trainer/parallel/engram.py).
    None without any (an empty set would change which parameterless modules fully_shard manages)."""
    return set(engram_tables(module)) or None


def _fsdp_mesh(meshes: Meshes, dims: ParallelDims) -> DeviceMesh:
    """dp_shard (FSDP), or (dp_replicate, dp_shard) (HSDP: shards within a replica, all-reduce across them)."""
    if dims.dp_replicate == 1:
        return meshes.dp_shard
    return meshes.world["dp_replicate", "dp_shard"]


def materialize(pm: ParallelModel, device: torch.device, seed: int, *, microbatch_size: int, seq_len: int,
                grad_accum: int, schedule: str = "1F1B", autocast_dtype: torch.dtype | None = None) -> None:
    """Allocate this rank's parameters on `device`, initialise them (the single process's values), wrap them in
    FSDP2 when dp_shard > 1 and, with pp > 1, build the pipeline schedule over `grad_accum` micro-batches of
    `microbatch_size` rows x `seq_len` tokens (whole sequences; chunks under cp)."""
    fully_shard = mp_policy = mesh = None
    if pm.fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

        mp_policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
        mesh = _fsdp_mesh(pm.meshes, pm.dims)
    with torch.no_grad():
        for piece, module, init, block in _pieces(pm.module):
            module.to_empty(device=device)
            torch.manual_seed(piece_seed(seed, piece))
            init()
            if pm.engram is not None and pm.engram.host_memory and block:
                pm.engram.to_host(module)  # the block's initialised rows to host memory, before FSDP sees it
            if pm.fsdp and block:  # a block: its own FSDP unit
                fully_shard(module, mesh=mesh, mp_policy=mp_policy, ignored_params=_engram_tables(module))
                for method in getattr(module, "fsdp_forward_methods", ()):  # called besides forward (a draft block's
                    register_fsdp_forward_method(module, method)  # context KV): gathers and frees as forward does
    left = [n for n, t in [*pm.module.named_parameters(), *pm.module.named_buffers()] if t.is_meta]
    if left:  # a tensor outside the pieces _pieces knows (a new top-level part of the model)
        raise RuntimeError(f"materialize: {left} are still on the meta device; add their piece to _pieces")
    if pm.fsdp:
        # The roots hold embedding, head and final norm; they stay gathered between forward and backward.
        roots = pm.stages if pm.stages else [pm.module]
        for root in roots:
            fully_shard(root, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False,
                        ignored_params=_engram_tables(root))
        for m in [*pm.stages, *pm.module.modules()]:
            if hasattr(m, "set_reduce_scatter_unused_params"):
                # A parameter no token reached on this rank (an expert) still takes part in the reduce-scatter,
                # as zeros, so every rank issues the same collectives.
                m.set_reduce_scatter_unused_params(True)
    if pm.stages:
        cp = pm.dims.cp
        pm.pipeline = build_pipeline(
            pm.stages, pm.meshes.pp.get_group(), schedule=schedule, n_microbatches=grad_accum,
            microbatch_size=microbatch_size, seq_len=seq_len // cp, device=device, autocast_dtype=autocast_dtype,
            context_len=seq_len if cp > 1 else None, sequence_shards=pm.dims.tp if pm.sequence_parallel else 1)


def describe(pm: ParallelModel) -> dict:
    """A one-line summary for the log: sizes and, with pp, this rank's layers."""
    out = dataclasses.asdict(pm.dims)
    if pm.stages:
        out["stages"] = [(s.stage_index, s.start, s.end) for s in pm.stages]
    out["fsdp"] = pm.fsdp
    out["activation_checkpoint"] = pm.activation_checkpoint
    return out
