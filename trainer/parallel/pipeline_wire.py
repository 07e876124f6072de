"""The wire format of a pipeline cut: which tensors cross the boundary between two stages of
trainer/parallel/pipeline.py, in which order, shape and dtype (`boundary_slots`, the slot table), how many bytes
(`boundary_bytes`, which trainer/memory_plan.py also counts), and the encodings some of them cross in: bit-packed masks
(`pack_bits` / `unpack_bits`) and, on torch < 2.13, float32 carriers of integer tensors (`to_carrier` /
`from_carrier`). Functions of the config, the cut and the micro-batch shape only; the stage modules that fill and
read these tuples, and the flag that turns the float wire on, live in trainer/parallel/pipeline.py.

Shape legend: B micro-batch rows, T tokens, n mHC streams, dim hidden width, D main-KV latent width (head_dim),
Di indexer key width, E = T // m entries of a ratio-m KV source, C Engram columns per layer (orders x heads),
K top-k ids per query, P pool block ids per query, b bytes per activation element (4 fp32, 2 bf16).

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

Under sequence parallelism (tp > 1, trainer/parallel/tensor.py) each stage holds the streams, `pre` and h_{L/2} as its
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

The float wire: torch 2.11's PipelineStage (the GPU machine's) sets requires_grad on every received buffer, which
integer dtypes refuse. Under it (pipeline.py `_FLOAT_WIRE`, on for torch < 2.13, passed to these functions as
`float_wire`) every non-floating slot crosses as a float32 "carrier" holding its exact bytes (`to_carrier` /
`from_carrier`: int32 [..., K] -> [..., K]; int64 [..., C] -> [..., 2C]; uint8 [..., N] -> [..., ceil(N / 4)],
zero-padded), declared requires_grad in the stage metadata (`slot_meta`) and decoded from its detached bytes on
arrival; a carrier's bit pattern may be a NaN as a float, so nothing computes on it (gloo and NCCL copy bytes).
The cost: the carriers' bytes again as (zero) gradient traffic, and uint8 masks padded to 4 bytes per row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from model.config import ModelConfig
from model.layer_plan import LayerSpec, build_layer_plan

__all__ = [
    "KV_SLOTS", "Slot", "boundary_slots", "boundary_bytes", "carried_count", "is_carried", "to_carrier",
    "from_carrier", "pack_bits", "unpack_bits", "slot_meta",
]


# ---------------------------------------------------------------------------------------------------------------------
# The slot table


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


# the slots of a compressed KV source: its main KV and its indexer keys
KV_SLOTS = ("kv_main", "kv_keys")


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
    num_kv = sum(s.name in KV_SLOTS for s in slots)
    if num_kv and autocast_dtype is not None and autocast_dtype != act_dtype:
        slots.insert(-1, Slot("kv_dtypes", None, (num_kv,), torch.uint8, False))  # 1: autocast dtype
    return tuple(slots)


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


def carried_count(plan: Sequence[LayerSpec], cut: int) -> int:
    """A plan-only proxy for the state crossing `cut`: the number of tensors beyond S, pre and aux."""
    return len(_boundary_items(plan, cut, phase="sparse", image_mask=False)) - 3


# ---------------------------------------------------------------------------------------------------------------------
# Float carriers (the float wire, torch < 2.13)


def is_carried(slot: Slot, float_wire: bool) -> bool:
    """Whether `slot` crosses as a float32 carrier of its bytes: under the float wire, every non-floating slot."""
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


def slot_meta(slot: Slot, float_wire: bool = False) -> torch.Tensor:
    """The meta tensor (shape, dtype, requires_grad) that PipelineStage's input / output metadata declares for
    `slot`."""
    if is_carried(slot, float_wire):  # a float32 carrier of the slot's bytes, with a (zero) gradient
        return torch.empty(_carrier_shape(slot.shape, slot.dtype), device="meta").requires_grad_()
    t = torch.empty(slot.shape, dtype=slot.dtype, device="meta")
    return t.requires_grad_() if slot.grad else t


# ---------------------------------------------------------------------------------------------------------------------
# Bit packing (the [B, T, E] top-k and pool masks)


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
