"""Counts read off a built model (meta device is fine): parameters by kind, active parameters, KV-cache bytes and
decode FLOPs. Nothing here is a formula typed separately from the modules: every figure walks the real parameters
and the cache records that the layers declare.

What each count includes:
- params_total: every parameter (backbone + Engram tables).
- params_engram: the Engram hash tables only (their projections, gates and norms count as backbone).
- params_backbone: params_total - params_engram.
- params_active_decode: parameters one decoded token touches: every dense parameter of every layer (attention,
  compressor, indexer, router, shared expert, mHC, norms, Engram projections), the routed experts times
  top-k / num_experts, the head, and the Engram table rows read (orders x heads per module). The embedding is a
  lookup of one row: it counts with its full matrix only in `params_active_decode_with_embedding`.
- params_active_prefill: what a prompt token touches in CED prefill, where only the encoder runs on every prompt token
  and the decoder contributes its global-KV producers (the decoder Full layers' attn_norm, compressor and indexer
  keys); the decoder's full layers run only on the last window of rows, which vanishes per token for long prompts.
  The head is not run per prompt token. The embedding is reported separately as above.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from kernels import fp4


def _numel(params) -> int:
    return sum(p.numel() for p in params)


def parameter_groups(model: nn.Module) -> dict[str, int]:
    """Parameter counts by kind: embed, head, engram_tables, routed_experts, dense (everything else)."""
    groups: dict[str, int] = defaultdict(int)
    seen: set[int] = set()

    def take(kind: str, p: torch.Tensor) -> None:
        if id(p) not in seen:
            seen.add(id(p))
            groups[kind] += p.numel()

    take("embed", model.embed.weight)
    take("head", model.head.weight)
    for layer in model.layers:
        if layer.engram is not None:
            for p in [layer.engram.table]:
                take("engram_tables", p)
        for p in layer.ffn.experts.parameters():
            take("routed_experts", p)
    for p in model.parameters():
        take("dense", p)
    return dict(groups)


def _layer_dense(layer) -> int:
    routed = {id(p) for p in layer.ffn.experts.parameters()}
    tables = {id(p) for p in [layer.engram.table]} if layer.engram is not None else set()
    return sum(p.numel() for p in layer.parameters() if id(p) not in routed and id(p) not in tables)


def _layer_routed_active(layer) -> float:
    moe = layer.ffn
    return _numel(moe.experts.parameters()) * moe.cfg.experts_per_token / moe.cfg.num_experts


def _engram_rows_active(layer) -> int:
    return layer.engram.num_columns * layer.engram.head_dim if layer.engram is not None else 0


def active_parameters(model: nn.Module) -> dict[str, float]:
    cfg = model.cfg
    embed, head = model.embed.weight.numel(), model.head.weight.numel()
    decode = head + sum(_layer_dense(l) + _layer_routed_active(l) + _engram_rows_active(l) for l in model.layers)
    prefill = 0.0
    for layer in model.layers:
        if layer.spec.index < cfg.num_encoder_layers:
            prefill += _layer_dense(layer) + _layer_routed_active(layer) + _engram_rows_active(layer)
        elif layer.spec.owns_kv:  # decoder global-KV producer, runs on every prompt token
            a = layer.attn
            prefill += _numel(layer.attn_norm.parameters()) + _numel(a.compressor.parameters())
            prefill += _numel(a.indexer.wk.parameters()) + _numel(a.indexer.k_norm.parameters())
    return {
        "params_active_decode": decode,
        "params_active_decode_with_embedding": decode + embed,
        "params_active_prefill": prefill,
        "params_active_prefill_with_embedding": prefill + embed,
    }


def kv_cache_layout(model: nn.Module) -> list[dict]:
    """The cache records the layers declare: one global record pair per Full layer (main KV + indexer keys, persisted
    with the prefix cache), one SWA ring per layer (short-lived DRAM pool, never persisted)."""
    records = []
    q = model.cfg.quant
    for layer in model.layers:
        a, spec = layer.attn, layer.spec
        if spec.owns_kv:
            records.append(dict(layer=spec.index, kind="main_kv", entries_per_token=1 / spec.ratio,
                                bytes_per_entry=fp4.record_bytes(a.head_dim, q.cache_main_kv), persistent=True))
            fmt = "fp4_ue8m0" if q.cache_index == "fp4" else q.cache_index
            records.append(dict(layer=spec.index, kind="index_k", entries_per_token=1 / spec.ratio,
                                bytes_per_entry=fp4.record_bytes(a.indexer.head_dim, fmt), persistent=True))
        records.append(dict(layer=spec.index, kind="swa_kv", window=model.cfg.attention.window,
                            bytes_per_entry=fp4.record_bytes(a.head_dim, q.cache_swa_kv), persistent=False))
    return records


def kv_bytes(model: nn.Module) -> dict[str, float]:
    layout = kv_cache_layout(model)
    glob = sum(r["entries_per_token"] * r["bytes_per_entry"] for r in layout if r["kind"] != "swa_kv")
    persistent = sum(r["entries_per_token"] * r["bytes_per_entry"] for r in layout
                     if r["kind"] != "swa_kv" and r["persistent"])
    swa = [r["window"] * r["bytes_per_entry"] for r in layout if r["kind"] == "swa_kv"]
    return {"kv_bytes_per_token": glob, "kv_bytes_per_token_persistent": persistent,
            "swa_kv_bytes_per_layer": swa[0] if swa else 0}


def decode_flops_per_token(model: nn.Module, context: int) -> float:
    """FLOPs to decode one token with `context` tokens before it: 2 x active matmul parameters (head included, the
    embedding lookup and the Engram row reads are not matmuls), plus per layer the attention over the window and
    the selected entries (QK and PV), plus the indexer scoring of every entry it searches."""
    cfg = model.cfg
    a, c = cfg.attention, cfg.csa2
    flops = 2 * (model.head.weight.numel() + sum(_layer_dense(l) + _layer_routed_active(l) for l in model.layers))
    pool = c.candidate_topk_blocks * c.candidate_block_size
    for layer in model.layers:
        spec = layer.spec
        keys = min(a.window, context)
        if spec.ratio > 0:
            entries = context // spec.ratio
            keys += min(c.index_topk, entries)
            if spec.owns_indexer:
                searched = min(entries, pool) if spec.uses_pool else entries
                flops += searched * c.index_num_heads * (2 * c.index_head_dim + 2)
        flops += 2 * 2 * a.num_heads * a.head_dim * keys
    return float(flops)


def summary(model: nn.Module) -> dict:
    groups = parameter_groups(model)
    total = sum(groups.values())
    out = {
        "params_total": total,
        "params_backbone": total - groups.get("engram_tables", 0),
        "params_engram": groups.get("engram_tables", 0),
        "params_routed_experts": groups.get("routed_experts", 0),
    }
    out.update(active_parameters(model))
    out.update(kv_bytes(model))
    out["decode_flops_per_token_4k"] = decode_flops_per_token(model, 4096)
    out["decode_flops_per_token_1m"] = decode_flops_per_token(model, 1 << 20)
    return out


def train_flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Useful training FLOPs per token (forward + backward = 3x forward) at `seq_len`, averaged over positions:
    6 x active matmul parameters, plus the sparse attention over the window and the selected entries, plus the
    indexer scoring. Counts what the architecture needs, not what a dense reference implementation spends."""
    cfg = model.cfg
    a, c = cfg.attention, cfg.csa2
    matmul = model.head.weight.numel() + sum(_layer_dense(l) + _layer_routed_active(l) for l in model.layers)
    pos = torch.arange(1, seq_len + 1, dtype=torch.float64)  # p + 1 for every position
    pool = c.candidate_topk_blocks * c.candidate_block_size
    flops = 6.0 * matmul
    for layer in model.layers:
        spec = layer.spec
        keys = pos.clamp(max=a.window)
        if spec.ratio > 0:
            entries = torch.div(pos, spec.ratio, rounding_mode="floor")
            keys = keys + entries.clamp(max=c.index_topk)
            if spec.owns_indexer:
                searched = entries.clamp(max=pool) if spec.uses_pool else entries
                flops += 3 * float(searched.mean()) * c.index_num_heads * (2 * c.index_head_dim + 2)
        flops += 3 * 4 * a.num_heads * a.head_dim * float(keys.mean())
    return flops
