"""Pipeline parallelism for the CED backbone: where to cut, what crosses a cut, the stage modules and the
torch.distributed.pipelining schedules that drive them (1F1B, interleaved 1F1B, and the zero-bubble ZBV and
interleaved schedules, with our own split backward).

Shape legend: B micro-batch rows, T tokens, n mHC streams, dim hidden width, D main-KV latent width (head_dim),
Di indexer key width, E = T // m entries of a ratio-m KV source, C Engram columns per layer (orders x heads),
V vocabulary, M micro-batches per optimiser step, b bytes per activation element (4 fp32, 2 bf16).

Where to cut (`split_points`)
-----------------------------
A stage is a contiguous slice of layers run by `model.transformer.forward_blocks`, the loop the whole model runs,
so a stage computes exactly what its layers compute inside the whole model. Stages are cut only at a layer that
does not reuse the top-k of a layer before it (an SWA layer or the start of a Full / Reindex group): a cut in
front of a Reuse layer would ship a [T, E] selection that a group-start cut never needs. Among those cuts a
small dynamic programme minimises the most expensive stage, where a stage costs its layer count plus
`embed_cost` on the first stage (embedding + Engram hashing) and `head_cost` on the last (final norm, head,
cross-entropy): the first and last stages get fewer layers (torchtitan's "less layers" on both ends). Ties go to
the cuts that carry the least state (`carried`). Flagship, 40 layers, group starts at 1, 2, 8, 14, 20, 24, 28,
32, 36: pp 2 -> [20] (the decoder starts on the second stage, which then computes h_{L/2} itself); pp 4 ->
[8, 20, 32] (stage costs 9, 12, 12, 9); 8 stages -> [2, 8, 14, 20, 24, 28, 36] (3, 6, 6, 6, 4, 4, 8, 5: the
six-layer encoder groups bound the balance). At most 10 stages fit; `any_layer=True` also cuts in front of Reuse
layers, one extra top-k per such cut, for better balance (8 stages -> max cost 6) or more stages.

What crosses a cut (`boundary_slots`), per micro-batch, forward; the float entries carry a gradient of the same
size back (the integer and bit entries have none):

| state | crosses cut c when | shape | bytes |
| --- | --- | --- | --- |
| mHC streams S | always | [B, T, n, dim] | b*B*T*n*dim |
| previous site's `pre` | always | [B, T, n] fp32 | 4*B*T*n |
| h_{L/2} | the encoder ended before c and a decoder Full layer is >= c | [B, T, dim] | b*B*T*dim |
| main KV + indexer keys of source s | s < c and a layer >= c reads them | [B, E, D], [B, E, Di] | b*B*E*(D+Di) |
| top-k of index source s | s < c, a Reuse layer >= c uses it (sparse phase) | [B, T, E] bits, or ids | B*T*ceil(E/8) |
| candidate pool | built before c, a pool-restricted Reindex layer >= c | [B, T, E] bits, or ids | B*T*ceil(E/8) |
| Engram row ids | per Engram layer >= c (hashed once, on the first stage) | [B, T, C] int64 | 8*B*T*C |
| Engram dead mask | with any of those | [B, T] uint8 | B*T |
| image mask | batches carry one (MoE routes image tokens with its own bias) | [B, T] uint8 | B*T |
| aux: indexer KL sum, KL count, MoE seq balance | always | [3] fp32 | 12 |

Under sequence parallelism (tp > 1, model/parallelize.py) each stage holds the streams, `pre` and h_{L/2} as its
tp rank's sequence shard, T / tp tokens, and they cross as such (`sequence_shards`: the pipeline links ranks of one
tp coordinate, each ships its own shard); everything else crosses whole, as every tp rank holds it: the KV, keys,
top-k and pool (attention and the indexer gather the whole sequence before they make them), the Engram row ids and
dead mask (hashed from the whole token sequence), the image mask and aux. The first stage takes whole token ids
(the embedding hands on its shard) and the last returns whole logits (the head gathers the sequence).

On the Triton attention path (model/kernels.py; the default on CUDA without context parallelism) the top-k and the
pool live in the context as int32 ids, and cross as such (`ids=True`), exactly: the top-k [B, T, K] entry ids
(K = min(index_topk, E), or of the pool's slots in a pool-restricted source), 4*B*T*K bytes, and the pool [B, T, P]
block ids (P = min(candidate_topk_blocks, ceil(E / block))), 4*B*T*P bytes; -1 marks an empty place.

Under autocast with fp32 streams, compressed KV and keys cross in fp32 whatever dtype their path made (a bf16 one
is upcast exactly), with a [number of KV tensors] uint8 code the receiver uses to restore each one's dtype.

The streams dominate. Flagship (n=4, dim=5120, D=512, Di=128, C=24), bf16, B=1, T=4096, at the cut in front of
layer 24 (a Reindex group start): S 167.8 MB, pre 0.07 MB, layer 20's KV + keys 5.2 MB, pool 2.1 MB: 175 MB per
micro-batch forward and 173 MB of gradient back. At the cut in front of layer 2, the two Engram layers' row ids
add 0.8 MB. The pool and a top-k grow as T^2/8 (33.6 MB per boundary at T=16K); both are bit-packed. h_{L/2}
(42 MB) crosses only when the encoder ends on an earlier stage than a decoder Full layer; in the flagship plan
the one decoder Full layer is layer 20, the first decoder layer, so no cut carries it. A top-k never crosses a
group-start cut.

Auxiliary losses: every stage adds its layers' indexer KL (sum and count, so the last stage forms the same mean
over layers as `Transformer._aux`) and MoE sequence-balance terms to the running aux vector; the last stage's
loss is lm + coef * kl_sum / kl_count + seq_balance, so each term's gradient flows back to the stage that made it.

MoE balancing: each stage's MoE layers count the loads of all M micro-batches; `Pipeline.update_router_biases`
updates them from those counts (summed over the data ranks by the caller when dp/ep > 1), as the single process
does on the whole batch.

Zero bubble: ZBVZeroBubble and InterleavedZeroBubble split each stage's backward into an input and a weight pass;
trainer/parallel/zero_bubble.py makes that split exact on these stages (the stage wraps its received inputs and
its outputs in that module's `ContiguousGrad` and `Tie`, and the schedules run `ZeroBubbleStage`s).

torch 2.11 (the GPU machine's) sets requires_grad on every received buffer, which integer dtypes refuse, creates a
gradient receive buffer for every output of the previous stage and expects a gradient back for every received
tensor. Under `_FLOAT_WIRE` (on for torch < 2.13) every non-floating slot therefore crosses as a float32 "carrier"
holding its exact bytes (`to_carrier` / `from_carrier`: int32 [..., K] -> [..., K]; int64 [..., C] -> [..., 2C];
uint8 [..., N] -> [..., ceil(N / 4)], zero-padded), declared requires_grad in the stage metadata and decoded from
its detached bytes on arrival; a carrier's bit pattern may be a NaN as a float, so nothing computes on it (gloo and
NCCL copy bytes). Each received carrier gets an exact zero gradient back (zero_bubble.ZeroGrad), and any received
float that gets no gradient gets zeros (ZeroBubbleStage.fill_input_grads); the sender's backward skips outputs
that neither require grad nor have a grad_fn. The cost: the carriers' bytes again as gradient traffic, and uint8
masks padded to 4 bytes per row. torch 2.13 carries the integers as they are and sends zeros itself.

Stage modules keep the model's parameter names (`embed.weight`, `layers.<i>...`, `norm.weight`, `head.weight`):
`layers` is an nn.ModuleDict keyed by the global layer index, so state dicts and checkpoints match the whole model.
The stages use static shapes (PipelineStage input/output metadata from `boundary_slots`): no metadata-inference
forward runs, so MoE load counters see only real micro-batches, and every micro-batch must have B rows of T tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from model import kernels as kern
from model.attention import ForwardContext
from model.config import ModelConfig
from model.layer_plan import LayerSpec, build_layer_plan
from model.moe import MoE
from model.transformer import Transformer, embed_streams, forward_blocks, head_logits, new_context
from trainer.parallel.zero_bubble import OLD_PIPELINING, ContiguousGrad, Tie, ZeroBubbleStage, ZeroGrad

__all__ = [
    "SCHEDULES", "Slot", "PipelineStageModule", "PipelineLoss", "Pipeline",
    "allowed_cuts", "split_points", "stage_ids_for_rank", "boundary_slots", "boundary_bytes",
    "split_model", "build_pipeline", "check_torch_version", "clip_grad_norm_", "pack_bits", "unpack_bits",
    "to_carrier", "from_carrier",
]

# schedule name -> (class, stage placement: "loop" puts stage s on rank s % pp, "v" puts rank r's two stages at
# r and 2*pp - 1 - r)
SCHEDULES = {
    "1F1B": (Schedule1F1B, "loop"),
    "Interleaved1F1B": (ScheduleInterleaved1F1B, "loop"),
    "InterleavedZeroBubble": (ScheduleInterleavedZeroBubble, "loop"),
    "ZBVZeroBubble": (ScheduleZBVZeroBubble, "v"),
}


# ---------------------------------------------------------------------------------------------------------------------
# Where to cut


def allowed_cuts(plan: Sequence[LayerSpec], any_layer: bool = False) -> list[int]:
    """Layers a stage may start at: every layer but the first that does not reuse an earlier layer's top-k
    (any_layer: every layer but the first)."""
    return [s.index for s in plan[1:] if any_layer or s.role != "reuse"]


def _carried_count(plan: Sequence[LayerSpec], cut: int) -> int:
    """A plan-only proxy for the state crossing `cut`: the number of tensors beyond S, pre and aux."""
    return len(_boundary_items(plan, cut, phase="sparse", image_mask=False)) - 3


def split_points(plan: Sequence[LayerSpec], num_stages: int, *, embed_cost: float = 1.0, head_cost: float = 1.0,
                 carried: Callable[[int], float] | None = None, any_layer: bool = False) -> list[int]:
    """Cut the layers into `num_stages` (pp x pp_virtual) contiguous stages; returns the num_stages - 1 cut points
    (the first layer of every stage but the first).

    Minimises the largest stage cost (layer count, + embed_cost on the first stage, + head_cost on the last) over
    `allowed_cuts`; among equally balanced splits, the one whose cuts carry least (`carried(cut)`, default the
    number of state tensors crossing it; pass e.g. `lambda c: boundary_bytes(cfg, c, 1, T)` to count bytes).
    any_layer: allow cuts in front of Reuse layers too (better balance; each such cut also ships a top-k).
    Raises ValueError when the layers cannot make that many stages."""
    num_layers = len(plan)
    cuts = allowed_cuts(plan, any_layer)
    if num_stages < 1:
        raise ValueError(f"pipeline: the number of stages (pp x pp_virtual) must be >= 1, got {num_stages}")
    if num_stages > len(cuts) + 1:
        where = ("any layer" if any_layer else "an SWA layer or a Full/Reindex group start")
        raise ValueError(
            f"pipeline: cannot split num_layers={num_layers} into {num_stages} pipeline stages (pp x pp_virtual): "
            f"a stage may only start at {where}, layers {cuts}, which allows at most {len(cuts) + 1} stages"
            + ("" if any_layer else "; any_layer=True also cuts inside groups (one top-k more per such cut)"))
    carried = carried or (lambda c: float(_carried_count(plan, c)))
    bounds = [0] + cuts + [num_layers]  # candidate stage boundaries
    last = len(bounds) - 1

    def cost(i: int, j: int) -> float:  # stage from bounds[i] to bounds[j]
        return bounds[j] - bounds[i] + (embed_cost if i == 0 else 0.0) + (head_cost if j == last else 0.0)

    # best[k][j]: (max stage cost, carried state) of the best split of layers [0, bounds[j]) into k stages
    inf = (math.inf, math.inf)
    best = [[inf] * (last + 1) for _ in range(num_stages + 1)]
    prev = [[-1] * (last + 1) for _ in range(num_stages + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, num_stages + 1):
        for j in range(1, last + 1):
            for i in range(j):
                if best[k - 1][i] == inf:
                    continue
                edge = carried(bounds[i]) if i > 0 else 0.0
                cand = (max(best[k - 1][i][0], cost(i, j)), best[k - 1][i][1] + edge)
                if cand < best[k][j]:
                    best[k][j], prev[k][j] = cand, i
    out, j = [], last
    for k in range(num_stages, 0, -1):
        j = prev[k][j]
        out.append(bounds[j])
    return sorted(out)[1:]


def stage_ids_for_rank(pp_rank: int, pp: int, num_virtual: int, schedule: str) -> list[int]:
    """The global stage indices rank `pp_rank` of `pp` holds, in the placement the schedule expects."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
    style = SCHEDULES[schedule][1]
    if schedule == "1F1B" and num_virtual != 1:
        raise ValueError(f"schedule 1F1B runs one stage per rank; got pp_virtual={num_virtual} "
                         "(use Interleaved1F1B or a zero-bubble schedule)")
    if style == "v":
        if num_virtual != 2:
            raise ValueError(f"schedule {schedule} needs exactly pp_virtual=2 stages per rank, got {num_virtual}")
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(num_virtual)]


# ---------------------------------------------------------------------------------------------------------------------
# What crosses a cut


@dataclass(frozen=True)
class Slot:
    """One tensor of the tuple sent across a stage boundary."""

    name: str  # streams, pre, h_mid, kv_main, kv_keys, topk, pool, engram_rows, engram_dead, image_mask, aux
    layer: int | None  # the source / Engram layer of per-layer state
    shape: tuple[int, ...]
    dtype: torch.dtype
    grad: bool  # float state that carries a gradient back
    entries: int = 0  # E of a bit-packed [B, T, E] mask (topk, pool)

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def _boundary_items(plan: Sequence[LayerSpec], cut: int, phase: str, image_mask: bool) -> list[tuple[str, int | None]]:
    """(name, layer) of the state crossing a cut in front of layer `cut`, in wire order."""
    before, after = plan[:cut], plan[cut:]
    items: list[tuple[str, int | None]] = [("streams", None), ("pre", None)]
    decoder = [s.index for s in plan if s.is_decoder]
    if decoder and decoder[0] < cut and any(s.owns_kv and s.kv_input == "h_mid" for s in after):
        items.append(("h_mid", None))
    for src in (s.index for s in before if s.owns_kv):
        if any(s.kv_source == src for s in after):
            items += [("kv_main", src), ("kv_keys", src)]
    if phase == "sparse":
        for src in (s.index for s in before if s.owns_indexer):
            if any(s.index_source == src and s.role == "reuse" for s in after):
                items.append(("topk", src))
    if any(s.builds_pool for s in before) and any(s.uses_pool for s in after):
        items.append(("pool", None))
    engram = [s.index for s in after if s.engram]
    items += [("engram_rows", i) for i in engram]
    if engram:
        items.append(("engram_dead", None))
    if image_mask:
        items.append(("image_mask", None))
    items.append(("aux", None))
    return items


def boundary_slots(cfg: ModelConfig, cut: int, batch: int, seq_len: int, *, act_dtype: torch.dtype = torch.float32,
                   autocast_dtype: torch.dtype | None = None, image_mask: bool = False,
                   context_len: int | None = None, ids: bool = False,
                   sequence_shards: int = 1) -> tuple[Slot, ...]:
    """The tuple a stage ending in front of layer `cut` sends (and the next stage receives), for micro-batches of
    `batch` rows x `seq_len` tokens. act_dtype: the streams' dtype (the embedding's). Under autocast the compressed
    KV and keys come out in act_dtype or the autocast dtype depending on the path that made them (the ratio-2
    compressor pools in fp32): they cross in act_dtype, with a `kv_dtypes` code each so the receiver restores the
    exact tensor. context_len: the whole sequence when this process holds a context-parallel chunk of seq_len
    tokens (compressed entries are gathered over the sequence); default seq_len. ids: the top-k and the pool cross
    as the int32 ids the Triton attention path keeps (see the table at the top), not as bit-packed masks.
    sequence_shards: tp under sequence parallelism: the streams, `pre` and h_mid cross as this tp rank's
    [B, T / tp, ...] sequence shard (the pipeline links ranks of one tp coordinate); the rest crosses whole."""
    plan = build_layer_plan(cfg)
    if not 0 < cut < len(plan):
        raise ValueError(f"pipeline: a cut must lie in [1, {len(plan) - 1}], got {cut}")
    B, T, n, dim = batch, seq_len, cfg.mhc.num_streams, cfg.dim
    if seq_len % sequence_shards:
        raise ValueError(f"pipeline: {seq_len} tokens do not split into {sequence_shards} sequence shards")
    Ts = seq_len // sequence_shards  # the streams, pre and h_mid: this rank's sequence shard
    context_len = context_len or seq_len
    num_columns = (cfg.engram.max_ngram - 1) * cfg.engram.num_heads
    slots = []
    for name, layer in _boundary_items(plan, cut, cfg.indexer.phase, image_mask):
        entries = context_len // plan[layer].ratio if layer is not None and plan[layer].ratio else 0
        if name == "pool":
            entries = context_len // plan[cfg.csa2.candidate_source_layer].ratio
        if ids and name in ("topk", "pool"):
            slots.append(Slot(name, layer, (B, T, _id_count(cfg, plan, name, layer, context_len)), torch.int32,
                              False))
            continue
        shape, dtype, grad = {
            "streams": ((B, Ts, n, dim), act_dtype, True),
            "pre": ((B, Ts, n), torch.float32, True),
            "h_mid": ((B, Ts, dim), act_dtype, True),
            "kv_main": ((B, entries, cfg.attention.head_dim), act_dtype, True),
            "kv_keys": ((B, entries, cfg.csa2.index_head_dim), act_dtype, True),
            "topk": ((B, T, -(-entries // 8)), torch.uint8, False),
            "pool": ((B, T, -(-entries // 8)), torch.uint8, False),
            "engram_rows": ((B, T, num_columns), torch.int64, False),
            "engram_dead": ((B, T), torch.uint8, False),
            "image_mask": ((B, T), torch.uint8, False),
            "aux": ((3,), torch.float32, True),
        }[name]
        slots.append(Slot(name, layer, shape, dtype, grad, entries if name in ("topk", "pool") else 0))
    num_kv = sum(s.name in _KV for s in slots)
    if num_kv and autocast_dtype is not None and autocast_dtype != act_dtype:
        slots.insert(-1, Slot("kv_dtypes", None, (num_kv,), torch.uint8, False))  # 1: autocast dtype
    return tuple(slots)


_KV = ("kv_main", "kv_keys")


def _id_count(cfg: ModelConfig, plan: Sequence[LayerSpec], name: str, layer: int | None, context_len: int) -> int:
    """Ids per query of the Triton path's pool (P block ids) or of index source `layer`'s top-k (K ids, picked
    among the visible entries or, in a pool-restricted source, among the pool's P * block slots)."""
    c = cfg.csa2
    pool_entries = context_len // plan[c.candidate_source_layer].ratio
    pool = min(c.candidate_topk_blocks, -(-pool_entries // c.candidate_block_size))
    if name == "pool":
        return pool
    entries = context_len // plan[layer].ratio
    if entries == 0:
        return 0
    return min(c.index_topk, pool * c.candidate_block_size if plan[layer].uses_pool else entries)


def boundary_bytes(cfg: ModelConfig, cut: int, batch: int, seq_len: int, **kwargs) -> int:
    """Forward bytes per micro-batch across the cut in front of layer `cut` (see the table at the top)."""
    return sum(s.num_bytes for s in boundary_slots(cfg, cut, batch, seq_len, **kwargs))


# Non-floating slots cross as float32 carriers of their exact bytes (the module docstring: torch 2.11's PipelineStage
# cannot receive integer tensors). Read by PipelineStageModule.set_shapes; tests force it on under torch 2.13.
_FLOAT_WIRE = OLD_PIPELINING


def _is_carried(slot: Slot, float_wire: bool) -> bool:
    return float_wire and not slot.dtype.is_floating_point


def _carrier_shape(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, ...]:
    """[..., N] of `dtype` -> [..., ceil(N * element size / 4)] (the float32 carrier of the same bytes)."""
    nbytes = shape[-1] * torch.empty((), dtype=dtype).element_size()
    return (*shape[:-1], -(-nbytes // 4))


def to_carrier(t: torch.Tensor) -> torch.Tensor:
    """A non-floating tensor [..., N] -> the float32 tensor [..., ceil(N * element size / 4)] holding its exact
    bytes, each row zero-padded to a multiple of 4 bytes. Its values are bit patterns (NaN among them): copy it,
    never compute on it. Inverse: from_carrier."""
    if t.numel() == 0:  # (an empty view has strides a dtype view refuses)
        return t.new_empty(_carrier_shape(tuple(t.shape), t.dtype), dtype=torch.float32)
    b = t.contiguous().view(torch.uint8)  # [..., N * element size]
    pad = -b.shape[-1] % 4
    if pad:
        b = torch.cat([b, b.new_zeros((*b.shape[:-1], pad))], -1)
    return b.view(torch.float32)


def from_carrier(carrier: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The tensor of `shape` and `dtype` whose bytes `carrier` holds (to_carrier's output, detached first: it
    carries no gradient of its own)."""
    if math.prod(shape) == 0:
        return carrier.new_empty(shape, dtype=dtype)
    nbytes = shape[-1] * torch.empty((), dtype=dtype).element_size()
    b = carrier.detach().view(torch.uint8)
    if b.shape[-1] != nbytes:
        b = b[..., :nbytes]
        if dtype.itemsize > 1:
            b = b.contiguous()  # a wider view needs unit stride rows
    return b if dtype == torch.uint8 else b.view(dtype)


_BIT_WEIGHTS = (1, 2, 4, 8, 16, 32, 64, 128)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """[..., E] bool -> [..., ceil(E / 8)] uint8, bit k of byte j = mask[..., 8j + k]."""
    pad = -mask.shape[-1] % 8
    bits = F.pad(mask.to(torch.uint8), (0, pad)).unflatten(-1, (-1, 8))
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=mask.device)
    return (bits * weights).sum(-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, num_entries: int) -> torch.Tensor:
    """Inverse of pack_bits: [..., ceil(E / 8)] uint8 -> [..., E] bool."""
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=packed.device)
    return packed.unsqueeze(-1).bitwise_and(weights).ne(0).flatten(-2)[..., :num_entries]


# ---------------------------------------------------------------------------------------------------------------------
# Stage modules


class PipelineStageModule(nn.Module):
    """Layers [start, end) of the backbone, plus the embedding and Engram hasher on the first stage and the final
    norm + head on the last. forward(*inputs) -> outputs, both tuples of tensors laid out by `boundary_slots`
    (the first stage takes (input_ids [B, T], [image_mask [B, T]]); the last returns (logits [B, T, V] fp32,
    aux [3])). Parameter names are the whole model's."""

    def __init__(self, model: Transformer, bounds: Sequence[int], stage_index: int, *, image_mask: bool = False):
        super().__init__()
        cfg = model.cfg
        start, end = bounds[stage_index], bounds[stage_index + 1]
        self.cfg, self.start, self.end = cfg, start, end
        self.stage_index, self.num_stages = stage_index, len(bounds) - 1
        self.is_first, self.is_last = start == 0, end == cfg.num_layers
        self.uses_image_mask = image_mask
        self.autocast_dtype: torch.dtype | None = None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(start, end)})
        # context parallelism's hooks (a plain object, see model.attention.SequenceShard); set it on the stage too
        self.sequence_shard = model.sequence_shard
        self.hasher = model.hasher if self.is_first else None  # hashing runs once, on the first stage
        if self.is_first:
            self.embed = model.embed
        if self.is_last:
            self.norm = model.norm
            self.head = model.head
        self._in: tuple[Slot, ...] = ()
        self._out: tuple[Slot, ...] = ()

    def set_shapes(self, batch: int, seq_len: int, act_dtype: torch.dtype | None = None,
                   autocast_dtype: torch.dtype | None = None, context_len: int | None = None,
                   sequence_shards: int = 1) -> None:
        """Fix the micro-batch shape (static pipeline metadata) and the wire layout of both boundaries.
        act_dtype: the streams' dtype (default the parameters'; the compute dtype under an FSDP mixed-precision
        policy); autocast_dtype: run forward under torch.autocast with it (the trainer's bf16 mode); context_len:
        see boundary_slots (context parallelism); sequence_shards: tp under sequence parallelism (boundary_slots).
        batch and seq_len are the whole micro-batch (this process's chunk under cp): the first stage takes those
        token ids, the last returns those logits, whatever crosses in between."""
        act = act_dtype or (self.embed if self.is_first else next(iter(self.layers.values())).attn_norm).weight.dtype
        self.act_dtype, self.autocast_dtype = act, autocast_dtype
        # The Triton attention path keeps the top-k and the pool as int32 ids; they cross as such (model/kernels.py)
        device = next(iter(self.parameters())).device
        path = kern.resolve(self.cfg.kernels, device)
        kw = dict(act_dtype=act, autocast_dtype=autocast_dtype, image_mask=self.uses_image_mask,
                  context_len=context_len, ids=path == "triton", sequence_shards=sequence_shards)
        self.float_wire = _FLOAT_WIRE  # fixed here: the metadata, _pack and _unpack must agree
        self._in = () if self.is_first else boundary_slots(self.cfg, self.start, batch, seq_len, **kw)
        self._out = () if self.is_last else boundary_slots(self.cfg, self.end, batch, seq_len, **kw)
        self.batch, self.seq_len = batch, seq_len

    # -- set-up, mirroring Transformer ---------------------------------------------------------------------------
    def init_weights(self) -> None:
        """This stage's part of Transformer.init_weights. The random draws differ from the whole model's (each
        stage draws only its own tensors): to start from the single process's weights, load them by name."""
        std = self.cfg.init_std
        if self.is_first:
            nn.init.normal_(self.embed.weight, std=std)
        if self.is_last:
            nn.init.normal_(self.head.weight, std=std)
            self.norm.init_weights()
        for layer in self.layers.values():
            layer.init_weights()
        if self.is_first and self.hasher is not None:
            self.hasher.init_buffers()

    def set_canonical_vocab(self, canonical_map: torch.Tensor) -> None:
        if self.is_first and self.hasher is not None:
            self.hasher.set_canonical_map(canonical_map)

    def moe_layers(self) -> list[MoE]:
        return [layer.ffn for layer in self.layers.values()]

    # -- forward -------------------------------------------------------------------------------------------------
    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        """Meta tensors with the shapes, dtypes and requires_grad of forward's inputs (PipelineStage metadata)."""
        if self.is_first:
            ids = [torch.empty(self.batch, self.seq_len, dtype=torch.int64, device="meta")]
            if self.uses_image_mask:
                ids.append(torch.empty(self.batch, self.seq_len, dtype=torch.bool, device="meta"))
            return tuple(ids)
        return tuple(_meta(s, self.float_wire) for s in self._in)

    def example_outputs(self) -> tuple[torch.Tensor, ...]:
        if self.is_last:
            logits = torch.empty(self.batch, self.seq_len, self.cfg.vocab_size, device="meta").requires_grad_()
            return logits, torch.empty(3, device="meta").requires_grad_()
        return tuple(_meta(s, self.float_wire) for s in self._out)

    def forward(self, *inputs: torch.Tensor):
        device_type = inputs[0].device.type
        # The zero-bubble hooks (trainer/parallel/zero_bubble.py): every received tensor that carries a gradient goes
        # through ContiguousGrad (its input gradient leaves contiguous, as gloo's send needs), and every output that
        # carries one through Tie to a received tensor (every differentiable output is on autograd's path from the
        # stage inputs, where the input pass saves the gradients the weight pass starts from).
        anchor = next((t for t in inputs if t.requires_grad), None)
        if anchor is not None:
            inputs = tuple(ContiguousGrad.apply(t) if t.requires_grad else t for t in inputs)
        with torch.autocast(device_type, dtype=self.autocast_dtype or torch.float32,
                            enabled=self.autocast_dtype is not None):
            out = self._forward(inputs)
        if anchor is None:
            return out
        out = tuple(Tie.apply(t, anchor) if t.requires_grad else t for t in out)
        # Float wire: the received carriers (which the stage reads only through their detached bytes) get an exact
        # zero gradient, through the first differentiable output, so that every received tensor has a gradient to
        # send back (torch 2.11's PipelineStage needs one; see the module docstring).
        carriers = [t for s, t in zip(self._in, inputs) if _is_carried(s, self.float_wire) and t.requires_grad]
        if carriers:
            i = next(i for i, t in enumerate(out) if t.requires_grad)
            out = out[:i] + (ZeroGrad.apply(out[i], *carriers),) + out[i + 1:]
        return out

    def _forward(self, inputs):
        cfg = self.cfg
        if self.is_first:
            input_ids = inputs[0]
            image_mask = inputs[1] if self.uses_image_mask else None
            ctx, engram_in = new_context(cfg, input_ids, self.sequence_shard, self.hasher, image_mask)
            S, pre = embed_streams(self.embed, input_ids, cfg.mhc.num_streams)
            aux = torch.zeros(3, device=input_ids.device)
        else:
            S, pre, ctx, engram_in, image_mask, aux = self._unpack(inputs)
        S, pre = forward_blocks(self.layers.values(), S, pre, ctx, cfg.num_encoder_layers, engram_in, image_mask)
        aux = aux + self._aux(ctx, S.device)
        if self.is_last:
            return head_logits(self.norm, self.head, S, pre), aux
        return self._pack(S, pre, ctx, engram_in, image_mask, aux)

    def _aux(self, ctx: ForwardContext, device) -> torch.Tensor:
        """[indexer KL sum, number of KL terms, MoE sequence-balance sum] of this stage's layers."""
        zero = torch.zeros((), device=device)
        kl = list(ctx.indexer_kl.values())
        seq = [m.aux_loss for m in self.moe_layers() if m.aux_loss is not None]
        return torch.stack([sum(kl, zero), torch.tensor(float(len(kl)), device=device), sum(seq, zero)])

    def _unpack(self, inputs):
        cfg = self.cfg
        inputs = [from_carrier(t, s.shape, s.dtype) if _is_carried(s, self.float_wire) else t
                  for s, t in zip(self._in, inputs)]
        got = dict(zip(((s.name, s.layer) for s in self._in), inputs))
        entries = {(s.name, s.layer): s.entries for s in self._in}
        S, pre, aux = got[("streams", None)], got[("pre", None)], got[("aux", None)]
        # Positions (and the context-parallel chunk) as the whole model has them: without a hasher, new_context
        # reads only the token tensor's shape and device. The whole micro-batch's tokens, not S's: under sequence
        # parallelism S is this tp rank's sequence shard, and attention reads positions of the gathered sequence.
        ids = S.new_empty((S.shape[0], self.seq_len), dtype=torch.int64)
        ctx, _ = new_context(cfg, ids, self.sequence_shard)
        ctx.h_mid = got.get(("h_mid", None))
        codes = got[("kv_dtypes", None)].tolist() if ("kv_dtypes", None) in got else None
        kv = [(key, t) for key, t in got.items() if key[0] in _KV]
        for i, (key, t) in enumerate(kv):  # back to the dtype the sender's layers made (see boundary_slots)
            got[key] = t.to(self.autocast_dtype) if codes is not None and codes[i] else t
        for (name, layer), t in got.items():
            if name == "kv_main":
                ctx.kv[layer] = (t, got[("kv_keys", layer)])
            elif name == "topk":
                ctx.selection[layer] = t if t.dtype == torch.int32 else unpack_bits(t, entries[(name, layer)])
            elif name == "pool":
                ctx.pool = t if t.dtype == torch.int32 else unpack_bits(t, entries[(name, layer)])
        engram_in = None
        if ("engram_dead", None) in got:  # rows of this stage's Engram layers and of later stages' (passed on)
            dead = got[("engram_dead", None)].bool()
            engram_in = {layer: (t, dead) for (name, layer), t in got.items() if name == "engram_rows"}
        image_mask = got[("image_mask", None)].bool() if ("image_mask", None) in got else None
        return S, pre, ctx, engram_in, image_mask, aux

    def _pack(self, S, pre, ctx: ForwardContext, engram_in, image_mask, aux) -> tuple[torch.Tensor, ...]:
        out, kv_codes = [], []
        for s in self._out:
            if s.name == "streams":
                t = S
            elif s.name == "pre":
                t = pre
            elif s.name == "h_mid":
                t = ctx.h_mid
            elif s.name in _KV:
                t = ctx.kv[s.layer][_KV.index(s.name)]
                kv_codes.append(int(t.dtype == self.autocast_dtype and t.dtype != s.dtype))
                if kv_codes[-1]:
                    t = t.to(s.dtype)  # exact: the autocast dtype is the narrower one
            elif s.name == "kv_dtypes":
                t = torch.tensor(kv_codes, dtype=torch.uint8, device=S.device)
            elif s.name == "topk":
                t = ctx.selection[s.layer]
                t = t if s.dtype == torch.int32 else pack_bits(t)
            elif s.name == "pool":
                t = ctx.pool if s.dtype == torch.int32 else pack_bits(ctx.pool)
            elif s.name == "engram_rows":
                t = engram_in[s.layer][0]
            elif s.name == "engram_dead":
                t = next(iter(engram_in.values()))[1].to(torch.uint8)
            elif s.name == "image_mask":
                t = image_mask.to(torch.uint8)
            else:
                t = aux
            if tuple(t.shape) != s.shape or t.dtype != s.dtype:
                raise RuntimeError(
                    f"pipeline stage [{self.start}, {self.end}): {s.name}"
                    f"{'' if s.layer is None else f' of layer {s.layer}'} is {tuple(t.shape)} {t.dtype}, the "
                    f"static layout says {s.shape} {s.dtype} (micro-batch shape or act_dtype set wrong?)")
            if _is_carried(s, self.float_wire):
                t = to_carrier(t)
            t = t.contiguous()  # gloo sends contiguous tensors only
            if t._is_view() or (t.requires_grad and t.is_leaf):
                # The zero-bubble backward detaches stage outputs in place, which a view refuses and a leaf input
                # must not suffer (forward's Tie alias is neither, but the first stage's outputs are not tied).
                t = t.clone()
            out.append(t)
        return tuple(out)


def _meta(slot: Slot, float_wire: bool = False) -> torch.Tensor:
    if _is_carried(slot, float_wire):  # a float32 carrier of the slot's bytes, with a (zero) gradient
        return torch.empty(_carrier_shape(slot.shape, slot.dtype), device="meta").requires_grad_()
    t = torch.empty(slot.shape, dtype=slot.dtype, device="meta")
    return t.requires_grad_() if slot.grad else t


def split_model(model: Transformer, cuts: Sequence[int], stage_ids: Sequence[int], *,
                image_mask: bool = False) -> list[PipelineStageModule]:
    """This rank's stage modules (stages `stage_ids` of len(cuts) + 1), sharing the model's submodules; drop the
    model afterwards. Works on a meta-built model: apply TP / FSDP plans to each stage module, then `to_empty`
    and `init_weights()` them (or load a checkpoint: the names are the whole model's)."""
    num_layers = model.cfg.num_layers
    bounds = [0, *cuts, num_layers]
    if any(b >= c for b, c in zip(bounds, bounds[1:])):
        raise ValueError(f"pipeline: cuts must increase strictly inside (0, {num_layers}), got {list(cuts)}")
    for s in stage_ids:
        if not 0 <= s < len(bounds) - 1:
            raise ValueError(f"pipeline: stage {s} does not exist: {len(bounds) - 1} stages from cuts {list(cuts)}")
    return [PipelineStageModule(model, bounds, s, image_mask=image_mask) for s in stage_ids]


# ---------------------------------------------------------------------------------------------------------------------
# Loss and the schedule


class PipelineLoss:
    """The last stage's loss per micro-batch: cross-entropy + coef * mean indexer KL + MoE sequence balance, the
    terms forward_backward adds in the unpipelined trainer (and, like its grad_accum, a mean over micro-batches of
    per-micro-batch means). Keeps each micro-batch's detached terms for logging."""

    def __init__(self, cfg: ModelConfig):
        self.coef = cfg.indexer.loss_coef
        self.terms: list[torch.Tensor] = []  # [lm, kl mean (unweighted), seq balance] per micro-batch

    def __call__(self, output, labels: torch.Tensor) -> torch.Tensor:
        logits, aux = output
        lm = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        kl_sum, kl_count, seq = aux.unbind()
        kl = kl_sum / kl_count.clamp_min(1.0)  # no KL term at all without index sources (count 0, sum 0)
        self.terms.append(torch.stack([lm, kl, seq]).detach())
        return lm + (self.coef * kl + seq)


class Pipeline:
    """This rank's stages and the schedule that runs them. step() runs forward and backward of every micro-batch
    of one optimiser step; gradients land (averaged over micro-batches) in the stage modules' .grad."""

    def __init__(self, stages: list[PipelineStageModule], schedule, loss: PipelineLoss, group, image_mask: bool,
                 rows: int):
        self.stages, self.schedule, self.loss, self.group = stages, schedule, loss, group
        self.rows = rows  # M x B rows per step
        self.has_first = any(s.is_first for s in stages)
        self.has_last = any(s.is_last for s in stages)
        self.image_mask = image_mask
        self.metrics: dict[str, float] = {}

    def parameters(self):
        for stage in self.stages:
            yield from stage.parameters()

    def state_dict(self) -> dict:
        """This rank's part of the model's state dict, under the whole model's names (disjoint across pp ranks)."""
        return {k: v for stage in self.stages for k, v in stage.state_dict().items()}

    def moe_layers(self) -> list[MoE]:
        return [m for stage in self.stages for m in stage.moe_layers()]

    def load_counts(self) -> torch.Tensor:
        """[layers here, 2, E]: sum it over the ranks that route different tokens before update_router_biases."""
        return torch.stack([m.load_counts() for m in self.moe_layers()])

    @torch.no_grad()
    def update_router_biases(self, counts: torch.Tensor | list[torch.Tensor] | None = None) -> float:
        """Transformer.update_router_biases for this rank's MoE layers; the worst local max/mean expert load."""
        worst = 0.0
        for i, moe in enumerate(self.moe_layers()):
            c = None if counts is None else counts[i]
            worst = max(worst, float(moe.imbalance(c)))
            moe.update_bias(counts=c)
        return worst

    def step(self, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
             image_mask: torch.Tensor | None = None) -> float:
        """input_ids / labels [M*B, T] (input_ids needed where the first stage lives, labels where the last does).
        Returns the mean loss over the micro-batches (a float, the same on every rank of the pipeline group); sets
        `metrics` (means of lm, unweighted indexer_kl and moe_seq_balance)."""
        for name, t in (("input_ids", input_ids), ("labels", labels)):
            if t is not None and t.shape[0] != self.rows:
                raise ValueError(f"pipeline: {name} has {t.shape[0]} rows, the static micro-batch layout expects "
                                 f"n_microbatches x microbatch_size = {self.rows}")
        args: tuple = ()
        if self.has_first:  # contiguous: torch 2.11's stage checks the micro-batches' strides against its example
            args = (input_ids, image_mask) if self.image_mask else (input_ids,)
            args = tuple(a.contiguous() for a in args)
        self.loss.terms.clear()
        self.schedule.step(*args, target=labels if self.has_last else None, return_outputs=False)
        device = next(iter(self.stages[0].parameters())).device
        terms = torch.zeros(3, device=device)
        if self.has_last:
            terms = torch.stack(self.loss.terms).mean(0)
        if dist.get_world_size(self.group) > 1:  # exactly one rank holds the last stage; the others add zeros
            dist.all_reduce(terms, group=self.group)
        lm, kl, seq = terms.tolist()
        self.metrics = {"lm": lm, "indexer_kl": kl, "moe_seq_balance": seq}
        return lm + self.loss.coef * kl + seq


PIPELINE_MIN_TORCH = "2.11"


def check_torch_version() -> None:
    """Raise, naming the reason, on a torch older than the PipelineStage versions this module runs on (2.11, whose
    stages get the float wire, and 2.13; the project's own floor, pyproject.toml)."""
    if torch.torch_version.TorchVersion(torch.__version__) < PIPELINE_MIN_TORCH:
        raise RuntimeError(
            f"pipeline parallelism (parallel.pp > 1) needs torch >= {PIPELINE_MIN_TORCH}, this is {torch.__version__}: "
            "trainer/parallel/pipeline.py runs on torch.distributed.pipelining's PipelineStage of torch 2.11 (with "
            "the float wire: the module docstring) and 2.13; older ones are untested")


def build_pipeline(stages: list[PipelineStageModule], pp_group, *, schedule: str, n_microbatches: int,
                   microbatch_size: int, seq_len: int, device: torch.device, act_dtype: torch.dtype | None = None,
                   autocast_dtype: torch.dtype | None = None, context_len: int | None = None,
                   sequence_shards: int = 1) -> Pipeline:
    """Wrap this rank's (materialised) stage modules in PipelineStages with static shapes and build `schedule`
    (a key of SCHEDULES) over `n_microbatches` micro-batches of `microbatch_size` rows x `seq_len` tokens.
    pp_group: the pipeline process group (Meshes.pp.get_group()). autocast_dtype: run every stage under
    torch.autocast (the trainer's bf16 mode); act_dtype, context_len, sequence_shards (tp under sequence
    parallelism): see PipelineStageModule.set_shapes."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
    check_torch_version()
    cls, _ = SCHEDULES[schedule]
    pp = dist.get_world_size(pp_group)
    num_stages = len(stages) * pp
    cfg = stages[0].cfg
    pipeline_stages = []
    for module in stages:
        if module.num_stages != num_stages:
            raise ValueError(f"pipeline: stage {module.stage_index} was cut into {module.num_stages} stages, but "
                             f"{len(stages)} stages on each of {pp} ranks make {num_stages}")
        module.set_shapes(microbatch_size, seq_len, act_dtype, autocast_dtype, context_len, sequence_shards)
        stage = ZeroBubbleStage(module, module.stage_index, num_stages, device, input_args=module.example_inputs(),
                                output_args=module.example_outputs(), group=pp_group)
        stage.fill_input_grads = module.float_wire  # torch 2.11 sends a gradient back for every received tensor
        pipeline_stages.append(stage)
    loss = PipelineLoss(cfg)
    if schedule == "1F1B":
        if len(stages) != 1:
            raise ValueError(f"schedule 1F1B runs one stage per rank, this rank has {len(stages)}")
        sched = cls(pipeline_stages[0], n_microbatches=n_microbatches, loss_fn=loss)
    else:
        sched = cls(pipeline_stages, n_microbatches=n_microbatches, loss_fn=loss)
    return Pipeline(stages, sched, loss, pp_group, stages[0].uses_image_mask, n_microbatches * microbatch_size)


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float, pp_group=None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ (L2) over the whole model when each pipeline rank holds some of its
    parameters: squared norms are summed over the pipeline group (None: this process holds every parameter).
    Returns the total norm, the same on every rank. Plain (non-DTensor) gradients; with ep-sharded experts the
    expert squares must also be summed over ep (trainer/parallel/expert.py's clip does that part)."""
    grads = [p.grad for p in params if p.grad is not None]
    # Squares summed in fp64: the pipeline adds per-rank partial sums, the single process one running sum; the two
    # orders then agree far below fp32 rounding, so the fp32 norm and clip coefficient match (torch's fp32 norms
    # differ in the last bits, which the Engram gates amplify to 1e-4 relative in the next step's gradients).
    zero = torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else None)
    sq = sum((g.double().pow(2).sum() for g in grads), zero)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(sq, group=pp_group)
    total = sq.sqrt().float()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total
