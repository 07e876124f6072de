"""The wire format of a pipeline cut: which tensors cross the boundary between two stages of
trainer/parallel/pipeline.py, in which order, shape and dtype (`boundary_slots`, the slot table of `Slot`s), how
many bytes (`boundary_bytes`, which trainer/memory_plan.py also counts), and the encodings some of them cross in:
bit-packed masks (`pack_bits` / `unpack_bits`) and, on torch < 2.13, float32 carriers of integer tensors holding
their exact bytes (`to_carrier` / `from_carrier`, `slot_meta`). Functions of the config, the cut and the
micro-batch shape only; the stage modules that fill and read these tuples, and the flag that turns the float wire
on, live in trainer/parallel/pipeline.py. Float slots carry a gradient of the same size back; integer and bit
slots carry none. Under sequence parallelism the streams, `pre` and h_{L/2} cross as each tp rank's sequence
shard (`sequence_shards`); everything else crosses whole.

Design and reasoning: docs/parallelism.md#pipeline-wire-format
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
