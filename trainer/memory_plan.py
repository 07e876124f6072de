"""The memory planner behind `python -m trainer.cli.plan`: what one rank of a layout holds and sends per optimiser
step.

Contract: `plan(node, world_size)` runs the trainer's own start-up checks first (`check_layout`: a layout the
trainer refuses raises its ValueError), then returns the counts read off the model built on the meta device
(model/accounting.py, with the drafter's and the image tower's) and, under "training", `plan_training`'s result: per
pipeline rank the memory by term (parameters, gradients, optimiser state, activations, working set, reserve), the
bytes sent per step by dimension (tp, ep, pp, cp, dp, optimizer, engram), the worst rank, whether its peak fits
`parallel.device_memory_gb` (default 141: H200) and the dominant term. Every figure is read off the plans the
trainer applies (tp_shard_dims, split_points, boundary_slots, layer_activation_bytes): an estimate, not a
measurement.

Design and reasoning: docs/memory_plan.md#the-memory-planner
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

import model as model_pkg
from model import accounting
from model.attention import head_rows
from trainer.parallel.tensor import block_shard_dims, tp_shard_dims, vision_shard_dims
from optim.hybrid import CHUNK
from optim.rules import assign, rows_per_head
from trainer.config import to_config
from trainer.fused_loss import default_chunk_tokens
from trainer.parallel.apply import validate_layout
from trainer.parallel.pipeline import split_points, stage_ids_for_rank
from trainer.parallel.pipeline_wire import boundary_slots
from trainer.stages.base import build_stage
from trainer.train import apply_stage_hooks, check_fused_loss, check_multimodal

_GB = 1e9
_RESERVE = 4e9
_KINDS = ("embed", "head", "dense", "routed_experts", "engram_tables")


def _build_meta(model_cfg):
    cfg = model_pkg.to_model_config(model_cfg)
    with torch.device("meta"):
        return model_pkg.build(cfg)


def plan_model(model_cfg) -> dict:
    m = _build_meta(model_cfg)
    out = {"model": m.cfg.name}
    out.update(accounting.summary(m))
    out.update(accounting.vision_parameters(m.cfg))  # the image tower, beside the backbone (none: text only)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# The layout


@dataclass
class Layout:
    """Parallel sizes and the step's shape, read from the composed config."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    pp_virtual: int = 1
    pp_schedule: str = "1F1B"
    pp_cuts: list[int] = field(default_factory=list)
    batch_size: int = 1  # rows per micro-batch per data rank
    seq_len: int = 4096
    grad_accum: int = 1  # micro-batches per step
    activation_checkpoint: str = "none"  # none | full
    engram_shard: bool = False  # parallel.engram_shard: rows over dp x ep x cp (trainer/parallel/engram.py)
    engram_shard_over: tuple[str, ...] = ("dp_replicate", "dp_shard", "ep", "cp")  # parallel.engram_shard_over
    fused_loss: bool = False  # trainer.fused_loss: the head and the cross-entropy chunked (trainer/fused_loss.py)
    optim_rules: tuple = ()  # optim.rules (optim=muon): which optimiser each parameter has; () = AdamW for all
    device_bytes: float = 141e9
    notes: list[str] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.ep * self.cp

    @property
    def data_ranks(self) -> int:
        """Ranks whose losses are averaged (and that read different tokens): dp x ep x cp."""
        return self.dp_replicate * self.dp_shard * self.ep * self.cp

    @property
    def engram_group(self) -> int:
        """Ranks that split the Engram rows: the product of parallel.engram_shard_over's sizes."""
        return math.prod(getattr(self, a) for a in self.engram_shard_over) if self.engram_shard else 1


def layout_from_config(cfg, dims, cuts: list[int], device_memory_gb: float = 141.0,
                       world_size_given: bool = True) -> Layout:
    """The layout of the typed config `cfg` (trainer.config.Config) with the sizes `dims` that
    ParallelConfig.resolve gave and the pipeline cuts that validate_layout returned (see `check_layout`)."""
    par = cfg.parallel
    lay = Layout(
        dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard, tp=dims.tp, pp=dims.pp, ep=dims.ep, cp=dims.cp,
        pp_virtual=par.pp_virtual, pp_schedule=par.pp_schedule, pp_cuts=list(cuts),
        batch_size=cfg.data.batch_size, seq_len=cfg.data.seq_len, grad_accum=cfg.trainer.grad_accum,
        activation_checkpoint=par.activation_checkpoint,
        engram_shard=par.engram_shard, engram_shard_over=tuple(par.engram_shard_over),
        fused_loss=cfg.trainer.fused_loss, device_bytes=float(device_memory_gb) * _GB,
        optim_rules=tuple(cfg.optim.rules))
    if par.dp_replicate == -1 and not world_size_given:
        lay.notes.append("parallel.dp_replicate=-1 (fill) planned as 1: give --world-size=N to plan N processes")
    return lay


def check_layout(node, world_size: int | None = None):
    """The trainer's start-up checks on the composed config `node`, the functions trainer.train.build runs before any
    process group exists, in its order: the typed config (trainer.config.to_config: every `__post_init__`),
    trainer.fused_loss's rules (trainer.train.check_fused_loss), the stage hooks, data=multimodal's rules
    (trainer.train.check_multimodal), the model's layout rules
    (trainer.parallel.apply.validate_layout: divisibility by tp / ep / cp, the pipeline split, enough micro-batches)
    and the world size (ParallelConfig.resolve). Without `world_size`, the world the sizes make (dp_replicate=-1
    counted as 1). A layout the trainer refuses raises its ValueError.

    Returns (cfg, model_cfg, dims, cuts, device_memory_gb). `+parallel.device_memory_gb=...` is the planner's own
    key, not the trainer's, so it is taken out before the schema sees it."""
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(node, resolve=True)
    device_memory_gb = float(plain.get("parallel", {}).pop("device_memory_gb", 141))
    cfg = to_config(OmegaConf.create(plain))
    if cfg.trainer.fused_loss:
        check_fused_loss(cfg, build_stage(cfg.stage).loss())
    model_cfg = apply_stage_hooks(cfg.model, cfg.stage)
    check_multimodal(cfg, model_cfg)
    cuts = validate_layout(cfg.parallel, model_cfg, seq_len=cfg.data.seq_len, grad_accum=cfg.trainer.grad_accum)
    if world_size is None:
        par = cfg.parallel
        world_size = max(par.dp_replicate, 1) * par.dp_shard * par.tp * par.pp * par.ep * par.cp
    dims = cfg.parallel.resolve(world_size)
    return cfg, model_cfg, dims, cuts, device_memory_gb


def _stage_bounds(model, lay: Layout) -> list[int]:
    num_stages = lay.pp * lay.pp_virtual
    cuts = lay.pp_cuts or (split_points(model.plan, num_stages) if num_stages > 1 else [])
    if len(cuts) != num_stages - 1:
        raise ValueError(f"parallel.pp_cuts={cuts} must hold pp * pp_virtual - 1 = {num_stages - 1} layers")
    return [0, *cuts, model.cfg.num_layers]


def _rank_stages(lay: Layout) -> list[list[int]]:
    return [stage_ids_for_rank(r, lay.pp, lay.pp_virtual, lay.pp_schedule) for r in range(lay.pp)]


# ---------------------------------------------------------------------------------------------------------------------
# Parameters per rank


def param_kind(name: str) -> str:
    if name in ("embed.weight", "head.weight"):
        return name.split(".")[0]
    if name.endswith("engram.table"):
        return "engram_tables"
    if ".ffn.experts." in name:
        return "routed_experts"
    return "dense"


def local_numel(name: str, shape: tuple[int, ...], lay: Layout, tp_dims: dict[str, int]) -> int:
    """Elements of parameter `name` on the rank holding the largest share of it in layout `lay`. tp_dims: the
    model's `trainer.parallel.tensor.tp_shard_dims` (the dim tp splits, for the parameters it splits)."""
    shape = list(shape)
    kind = param_kind(name)
    if kind == "engram_tables" and lay.engram_shard:
        # Row blocks over the Engram group; excluded from FSDP (an FSDP table would be all-gathered whole).
        return -(-shape[0] // lay.engram_group) * math.prod(shape[1:])
    if lay.tp > 1 and name in tp_dims:
        shape[tp_dims[name]] //= lay.tp
    if kind == "routed_experts":
        shape[0] //= lay.ep
    if lay.dp_shard > 1:
        shape[0] = -(-shape[0] // lay.dp_shard)
    return math.prod(shape)


def _stage_of(name: str, bounds: list[int]) -> int:
    if name.startswith("layers."):
        layer = int(name.split(".")[1])
        return next(s for s in range(len(bounds) - 1) if bounds[s] <= layer < bounds[s + 1])
    return 0 if name == "embed.weight" else len(bounds) - 2  # final norm and head: the last stage


def stage_parameters(model, lay: Layout, bounds: list[int]) -> list[dict[str, dict[str, int]]]:
    """Per pipeline stage and kind: {"numel": local elements, "bytes": in the parameters' dtypes,
    "low_precision_numel": elements not stored in fp32 (they get an fp32 master copy)}."""
    out = [{k: {"numel": 0, "bytes": 0, "low_precision_numel": 0, "momentum_numel": 0, "owner_numel": 0,
                "largest_sinkhorn_numel": 0, "largest_owned_numel": 0} for k in _KINDS} for _ in range(len(bounds) - 1)]
    tp_dims = tp_shard_dims(model)
    named = list(model.named_parameters())
    rules = list(lay.optim_rules)
    which = assign([name for name, _ in named], rules) if rules else [None] * len(named)
    rows_of = head_rows(model.cfg)
    for (name, p), i in zip(named, which):
        n = local_numel(name, tuple(p.shape), lay, tp_dims)
        rec = out[_stage_of(name, bounds)][param_kind(name)]
        rec["numel"] += n
        rec["bytes"] += n * p.element_size()
        if p.dtype != torch.float32:
            rec["low_precision_numel"] += n
        if i is not None and rules[i].optimizer != "adamw":
            rec["momentum_numel"] += n
            rows = rows_per_head(name, rows_of) if rules[i].headwise else None
            if rules[i].optimizer == "sinkhorn":
                rec["largest_sinkhorn_numel"] = max(rec["largest_sinkhorn_numel"], n)
            elif _muon_needs_owner(name, tuple(p.shape), lay, tp_dims, rows):
                rec["owner_numel"] += n
                rec["largest_owned_numel"] = max(rec["largest_owned_numel"], p.numel())
    return out


def _muon_needs_owner(name: str, shape: tuple[int, ...], lay: Layout, tp_dims: dict[str, int],
                      rows: int | None) -> bool:
    """Whether a Muon matrix's blocks are split across ranks in this layout, so an owner gathers it
    (optim/hybrid.py): any split of a dim other than 0, or a split of dim 0 that cuts a block (an expert, a head)."""
    ways = 1
    if lay.tp > 1 and name in tp_dims:
        if tp_dims[name] != 0:
            return True
        ways *= lay.tp
    if param_kind(name) == "routed_experts":
        ways *= lay.ep
    ways *= lay.dp_shard
    if ways == 1:
        return False
    if len(shape) == 3 and rows is None:
        return shape[0] % ways != 0
    if len(shape) == 2 and rows is not None:
        return (shape[0] // rows) % ways != 0
    return True


# ---------------------------------------------------------------------------------------------------------------------
# Memory


def _kv_context_bytes(model, layers: range, lay: Layout, tokens: int) -> float:
    """Compressed entries (main KV + indexer keys, fp32) the stage's layers read, per micro-batch."""
    cfg = model.cfg
    sources = {model.plan[i].kv_source for i in layers if model.plan[i].kv_source is not None}
    per_entry = 4 * (cfg.attention.head_dim + cfg.csa2.index_head_dim)
    return sum(lay.batch_size * (lay.seq_len // model.plan[s].ratio) * per_entry for s in sources)


def _stage_memory(model, lay: Layout, bounds: list[int], stage: int) -> dict:
    cfg = model.cfg
    tokens = lay.batch_size * lay.seq_len // lay.cp  # this rank's tokens per micro-batch
    layers = range(bounds[stage], bounds[stage + 1])
    per_layer = []
    for i in layers:
        terms = accounting.layer_activation_bytes(model.layers[i], tokens, lay.seq_len, tp=lay.tp, ep=lay.ep,
                                                 shard_dims=block_shard_dims)
        per_layer.append(terms)
    full = sum(sum(t.values()) for t in per_layer)
    if lay.activation_checkpoint == "full":
        saved = sum(accounting.layer_checkpoint_bytes(model.layers[i], tokens) for i in layers)
    else:
        saved = full
    saved += _kv_context_bytes(model, layers, lay, tokens)
    is_last = stage == len(bounds) - 2
    vocab = cfg.vocab_size / lay.tp
    if is_last and lay.fused_loss:
        # kept: the per-token log-sum-exp; in flight: one chunk's fp32 logits and their gradient (the backward forms
        # the chunk's logits again); the [tokens, vocab] logits never exist
        saved += 4 * tokens
        head = 2 * 4 * min(tokens, default_chunk_tokens(int(vocab))) * vocab
    elif is_last:
        saved += 2 * 4 * tokens * vocab  # fp32 logits and the cross-entropy's log-softmax
        head = 4 * tokens * vocab  # the logits' gradient
    else:
        head = 0.0
    largest = max((sum(t.values()) for t in per_layer), default=0.0)
    grads_of_layer = largest * (2 if lay.activation_checkpoint == "full" else 1)
    transient = max((sum(accounting.layer_transient_bytes(model.layers[i], tokens, lay.seq_len).values())
                     for i in layers), default=0.0)
    working = grads_of_layer + transient + head
    if lay.dp_shard > 1:
        # FSDP2 holds a block's unsharded (fp32) parameters while it runs, and prefetches the next block's.

        whole, tp_dims = dataclasses.replace(lay, dp_shard=1), tp_shard_dims(model)
        blocks = [sum(local_numel(f"layers.{i}.{n}", tuple(p.shape), whole, tp_dims) * p.element_size()
                      for n, p in model.layers[i].named_parameters() if not n.endswith("engram.table"))
                  for i in layers]
        working += 2 * max(blocks, default=0)
    itemised: dict[str, float] = {}
    for t in per_layer:
        for k, v in t.items():
            itemised[k] = itemised.get(k, 0.0) + v
    return {"saved_per_microbatch": saved, "working_set": working, "itemised_per_microbatch": itemised}


def _in_flight(lay: Layout, rank: int) -> int:
    if lay.pp_schedule == "1F1B":
        return min(lay.grad_accum, lay.pp - rank)
    return min(lay.grad_accum, lay.pp)


def rank_memory(model, lay: Layout, bounds: list[int], params: list[dict], stages: list[int], rank: int) -> dict:
    """Bytes on pipeline rank `rank` (holding `stages`), by term."""
    by_kind = {k: sum(params[s][k]["bytes"] for s in stages) for k in _KINDS}
    numel = sum(params[s][k]["numel"] for s in stages for k in _KINDS)
    low = sum(params[s][k]["low_precision_numel"] for s in stages for k in _KINDS)
    grads = dict(by_kind)
    # AdamW: two fp32 moments; Muon and Sinkhorn momentum: one fp32 buffer; a low-precision parameter: its fp32 master
    momentum = sum(params[s][k]["momentum_numel"] for s in stages for k in _KINDS)
    optimizer = {k: sum(8 * (params[s][k]["numel"] - params[s][k]["momentum_numel"])
                        + 4 * params[s][k]["momentum_numel"] + 4 * params[s][k]["low_precision_numel"]
                        for s in stages) for k in _KINDS}
    mems = [_stage_memory(model, lay, bounds, s) for s in stages]
    in_flight = _in_flight(lay, rank)
    activations = in_flight * sum(m["saved_per_microbatch"] for m in mems)
    working = max(m["working_set"] for m in mems)
    # foreach AdamW's denominators, then the largest of what optim/hybrid.py's Muon and Sinkhorn steps hold at once:
    # a chunk of Muon updates (fp32 Nesterov update + bf16 stacked blocks, iterate and result: 10 B a value), an
    # owner's whole gathered matrix (the same), a Sinkhorn table's touched rows, all of them at worst (gradient,
    # momentum and update rows, their squares, the balanced and the new rows: 24 B a value)

    def _largest(key: str) -> int:
        return max((params[s][k][key] for s in stages for k in _KINDS), default=0)

    step_transient = 4 * (numel - momentum) + max(10 * min(momentum, CHUNK), 10 * _largest("largest_owned_numel"),
                                                  24 * _largest("largest_sinkhorn_numel"))
    static = sum(by_kind.values()) + sum(grads.values()) + sum(optimizer.values())
    peak = static + max(activations + working, step_transient) + _RESERVE
    itemised: dict[str, float] = {}
    for m in mems:
        for k, v in m["itemised_per_microbatch"].items():
            itemised[k] = itemised.get(k, 0.0) + v
    return {
        "pp_rank": rank, "stages": stages, "layers": [[bounds[s], bounds[s + 1]] for s in stages],
        "microbatches_in_flight": in_flight,
        "params_numel": numel, "params_low_precision_numel": low, "params_momentum_numel": momentum,
        "params_bytes": by_kind, "grads_bytes": grads, "optimizer_bytes": optimizer,
        "activations_bytes": activations, "activations_per_microbatch_itemised": itemised,
        "working_set_bytes": working, "optimizer_step_transient_bytes": step_transient,
        "reserve_bytes": _RESERVE, "peak_bytes": peak,
    }


def dominant_term(mem: dict) -> tuple[str, float]:
    """The largest single term of a rank's peak: one kind's parameters + gradients + optimiser state, the
    activations, or the working set."""
    terms = {f"{k} (params + grads + optimiser state)": mem["params_bytes"][k] + mem["grads_bytes"][k]
             + mem["optimizer_bytes"][k] for k in _KINDS}
    terms["activations"] = mem["activations_bytes"]
    terms["working_set"] = mem["working_set_bytes"]
    name = max(terms, key=terms.get)
    return name, terms[name]


# ---------------------------------------------------------------------------------------------------------------------
# Communication


def _ring(size: int) -> float:
    """Fraction of a tensor one rank sends in a ring all-gather or reduce-scatter over `size` ranks."""
    return (size - 1) / size


def rank_communication(model, lay: Layout, bounds: list[int], params: list[dict], stages: list[int]) -> dict:
    """Bytes pipeline rank `stages`' ranks send per optimiser step, by dimension (see
    docs/memory_plan.md#the-memory-planner)."""
    cfg = model.cfg
    M, B = lay.grad_accum, lay.batch_size
    N = B * lay.seq_len // lay.cp
    # a GPU run on the Triton attention path (model.kernels auto or triton) ships top-k and pool as int32 ids
    ids = cfg.kernels != "reference"
    s, c, dim = 4, 2, cfg.dim
    fwd_passes = 2 if lay.activation_checkpoint == "full" else 1  # recomputation repeats forward collectives
    layers = [i for st in stages for i in range(bounds[st], bounds[st + 1])]
    out = dict.fromkeys(("tp", "ep", "pp", "cp", "dp", "engram"), 0.0)
    K = cfg.moe.experts_per_token
    D, Di = cfg.attention.head_dim, cfg.csa2.index_head_dim
    for i in layers:
        spec = model.plan[i]
        entries = B * (lay.seq_len // spec.ratio) if spec.ratio else 0
        if lay.tp > 1:
            fwd = N * dim * c + N * dim * 4
            bwd = N * cfg.attention.q_lora_rank * c + N * D * c + N * K * (dim + 1) * s + N * dim * s
            if spec.owns_kv:
                bwd += entries * D * c
            out["tp"] += M * 2 * _ring(lay.tp) * (fwd_passes * fwd + bwd)
        if lay.ep > 1:
            one_way = N * K * ((dim + 1) * s + dim * c)  # rows + packed fp32 weight out, bf16 results back
            out["ep"] += M * _ring(lay.ep) * (fwd_passes + 1) * one_way
        if lay.cp > 1:
            per = 2 * B * (cfg.attention.window - 1) * D * c  # halo, forward and backward
            if spec.owns_kv:
                per += 2 * _ring(lay.cp) * entries * (D + Di) * s
            out["cp"] += M * per * (fwd_passes + 1) / 2
        if model.layers[i].engram is not None and lay.engram_group > 1:
            e = model.layers[i].engram
            rows = N * e.num_columns  # distinct rows per lookup, at most
            t = e.table.element_size()
            out["engram"] += M * _ring(lay.engram_group) * (fwd_passes * rows * (8 + e.head_dim * t)
                                                             + rows * e.head_dim * t)
    first, last = 0 in stages, (len(bounds) - 2) in stages
    if lay.tp > 1:
        if first:
            out["tp"] += M * fwd_passes * _ring(lay.tp) * N * dim * s
        if last and lay.pp > 1:
            out["tp"] += M * _ring(lay.tp) * N * cfg.vocab_size * 4
    if lay.cp > 1 and first:
        out["cp"] += M * _ring(lay.cp) * B * lay.seq_len * 8
    for st in stages:
        if st + 1 < len(bounds) - 1:  # forward state across the output cut
            out["pp"] += M * sum(x.num_bytes for x in boundary_slots(cfg, bounds[st + 1], B, lay.seq_len // lay.cp,
                                                                      context_len=lay.seq_len, ids=ids))
        if st > 0:  # gradients of the float state across the input cut
            out["pp"] += M * sum(x.num_bytes for x in boundary_slots(cfg, bounds[st], B, lay.seq_len // lay.cp,
                                                                      context_len=lay.seq_len, ids=ids) if x.grad)
    # Data parallelism: fp32 gradients (and, with FSDP, fp32 parameters).
    grad_bytes = {k: sum(params[st][k]["numel"] for st in stages) * 4 for k in _KINDS}
    experts = grad_bytes["routed_experts"]
    replicated = sum(v for k, v in grad_bytes.items() if k not in ("routed_experts", "engram_tables")
                     or (k == "engram_tables" and not lay.engram_shard))
    dp = lay.dp_replicate * lay.dp_shard
    engram_replicas = lay.data_ranks // lay.engram_group if lay.engram_shard else 1
    if engram_replicas > 1:  # blocks held on several ranks (engram_shard_over leaves axes out): all-reduced
        out["dp"] += 2 * _ring(engram_replicas) * grad_bytes["engram_tables"]
    if lay.dp_shard == 1:
        if lay.data_ranks > 1:
            out["dp"] += 2 * _ring(lay.data_ranks) * replicated
        if dp * lay.cp > 1:
            out["dp"] += 2 * _ring(dp * lay.cp) * experts
    else:
        f = lay.dp_shard
        sharded = replicated + experts  # this rank's shards; the unsharded unit is f times that
        out["dp"] += M * (2 + 1) * _ring(f) * f * sharded  # all-gather forward + backward, reduce-scatter
        if lay.dp_replicate > 1:
            out["dp"] += M * 2 * _ring(lay.dp_replicate) * sharded
        if lay.ep * lay.cp > 1:
            out["dp"] += 2 * _ring(lay.ep * lay.cp) * replicated
    if lay.optim_rules:
        # Muon matrices split across ranks: each rank's fp32 shard of the update goes to the matrix's owner and comes
        # back orthogonalised (optim/hybrid.py), twice the shard per step on balance
        out["optimizer"] = 2 * 4 * sum(params[st][k]["owner_numel"] for st in stages for k in _KINDS)
    out["total"] = sum(out.values())
    return out


# ---------------------------------------------------------------------------------------------------------------------
# The plan


def _assumptions(lay: Layout) -> list[str]:
    out = [
        "CUDA run: bf16 autocast, parameters (so the residual streams) fp32 except the Engram tables "
        "(model.engram.table_dtype); Triton kernels for attention, indexer and the fused mHC step; PyTorch Engram",
        ("optim.rules (optim=muon): Muon and Sinkhorn momentum 1 fp32 buffer per parameter, AdamW 2 moments; the "
         "step's transient the largest Muon chunk, owner matrix or Sinkhorn table (every row touched); Muon "
         "matrices split across ranks gathered by an owner and scattered back (the 'optimizer' communication)"
         if lay.optim_rules else
         "AdamW: 2 fp32 moments per parameter, plus an fp32 master copy of every parameter not stored in fp32 "
         "(optim/builder.py refuses such parameters today); foreach step allocates an fp32 denominator per "
         "parameter"),
        "gradients in the parameters' dtypes; FSDP2 (dp_shard > 1) shards dim 0 over dp_shard and gathers in fp32 "
        "(no param_dtype in trainer/parallel/apply.py), reduce-scatters every micro-batch",
        ("Engram tables row-sharded over dp x ep x cp (trainer/parallel/engram.py), kept out of FSDP"
         if lay.engram_shard else "Engram tables not row-sharded (parallel.engram_shard=false)"),
        f"pipeline schedule {lay.pp_schedule}: micro-batches in flight on pipeline rank r = "
        + ("min(M, pp - r)" if lay.pp_schedule == "1F1B" else "min(M, pp) per stage (upper bound)"),
        f"activation checkpointing: {lay.activation_checkpoint}"
        + (" (every block recomputed in backward, trainer/parallel/activation_checkpoint.py)"
           if lay.activation_checkpoint == "full" else ""),
        "communication: bytes sent per rank per optimiser step; Engram exchange bounded by distinct rows = C per "
        "token (no repeats)",
        f"reserve {_RESERVE / _GB:.0f} GB for CUDA context, NCCL buffers and fragmentation",
    ]
    return out + lay.notes


def plan_training(model, lay: Layout) -> dict:
    """The "training" section of the plan (docs/memory_plan.md says what each term counts)."""
    bounds = _stage_bounds(model, lay)
    params = stage_parameters(model, lay, bounds)
    ranks = []
    for r, stages in enumerate(_rank_stages(lay)):
        mem = rank_memory(model, lay, bounds, params, stages, r)
        mem["communication_bytes_per_step"] = rank_communication(model, lay, bounds, params, stages)
        name, size = dominant_term(mem)
        mem["dominant"] = {"term": name, "bytes": size, "share_of_peak": size / mem["peak_bytes"]}
        ranks.append(mem)
    worst = max(ranks, key=lambda m: m["peak_bytes"])
    comm_max = {k: max(m["communication_bytes_per_step"][k] for m in ranks) for k in ranks[0]
                ["communication_bytes_per_step"]}
    return {
        "layout": {"world_size": lay.world_size, "dp_replicate": lay.dp_replicate, "dp_shard": lay.dp_shard,
                   "tp": lay.tp, "pp": lay.pp, "pp_virtual": lay.pp_virtual, "ep": lay.ep, "cp": lay.cp,
                   "pp_schedule": lay.pp_schedule, "stage_bounds": bounds, "engram_group": lay.engram_group,
                   "activation_checkpoint": lay.activation_checkpoint, "seq_len": lay.seq_len,
                   "batch_size": lay.batch_size, "grad_accum": lay.grad_accum,
                   "tokens_per_step": lay.seq_len * lay.batch_size * lay.grad_accum * lay.data_ranks // lay.cp,
                   "device_memory_bytes": lay.device_bytes},
        "assumptions": _assumptions(lay),
        "per_pp_rank": ranks,
        "peak_bytes": worst["peak_bytes"],
        "peak_pp_rank": worst["pp_rank"],
        "fits": worst["peak_bytes"] <= lay.device_bytes,
        "dominant": worst["dominant"],
        "communication_bytes_per_step_max": comm_max,
    }


def plan(node, world_size: int | None = None) -> dict:
    """Model counts plus the training plan of the composed config `node`, after the trainer's own start-up checks
    (`check_layout`): a layout the trainer refuses raises its ValueError instead of being planned."""
    cfg, model_cfg, dims, cuts, device_memory_gb = check_layout(node, world_size)
    m = _build_meta(model_cfg)
    out = {"model": m.cfg.name}
    out.update(accounting.summary(m))
    # the image tower, beside the backbone (none: text only), and one tp rank's part of it
    out.update(accounting.vision_parameters(m.cfg, tp=dims.tp, shard_dims=vision_shard_dims))
    lay = layout_from_config(cfg, dims, cuts, device_memory_gb, world_size_given=world_size is not None)
    out["training"] = plan_training(m, lay)
    return out
