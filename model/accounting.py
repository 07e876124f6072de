"""Counts read off a built model (meta device is fine): parameters by kind, active parameters, KV-cache bytes and
decode FLOPs, training FLOPs per token, and what one layer keeps for its backward in training
(`layer_activation_bytes`, for the planner trainer/memory_plan.py).

Contract: every figure walks the real parameters and the cache records that the layers declare; nothing is a formula
typed separately from the modules. `summary(model)` returns the counts (params_total, params_engram,
params_backbone, params_active_decode / _prefill, kv bytes, decode FLOPs, the drafter's), `vision_parameters` the
tower's apart. What a tensor-parallel plan splits is passed in (`shard_dims`, trainer/parallel/tensor.py): the model
knows no plan. docs/model.md says what each count includes.

Design and reasoning: docs/model.md#counts-read-off-the-model
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch
from torch import nn

from kernels import fp4
from model.csa2 import Compressor
from model.dspark import DSpark
from model.moe import Router
from model.vision import VisionEncoder

# a module -> {parameter name: the dim a tensor-parallel plan splits}: the plan's, passed in (trainer/parallel/)
ShardDims = Callable[[nn.Module], dict[str, int]]


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

    if getattr(model, "vision", None) is not None:  # the tower counts apart (`vision_parameters`), not as dense
        seen.update(id(p) for p in model.vision.parameters())
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
    itemsize = model.embed.weight.element_size()  # format "none" stores the compute (parameter) dtype

    def record(dim: int, fmt: str) -> int:
        return dim * itemsize if fmt == "none" else fp4.record_bytes(dim, fmt)

    for layer in model.layers:
        a, spec = layer.attn, layer.spec
        if spec.owns_kv:
            records.append(dict(layer=spec.index, kind="main_kv", entries_per_token=1 / spec.ratio,
                                bytes_per_entry=record(a.head_dim, q.cache_main_kv), persistent=True))
            fmt = "fp4_ue8m0" if q.cache_index == "fp4" else q.cache_index
            records.append(dict(layer=spec.index, kind="index_k", entries_per_token=1 / spec.ratio,
                                bytes_per_entry=record(a.indexer.head_dim, fmt), persistent=True))
        records.append(dict(layer=spec.index, kind="swa_kv", window=model.cfg.attention.window,
                            bytes_per_entry=record(a.head_dim, q.cache_swa_kv), persistent=False))
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
    if model.cfg.dspark.target_layers and all(i < model.cfg.num_layers for i in model.cfg.dspark.target_layers):
        out.update(dspark_parameters(model.cfg))
    return out


def dspark_parameters(cfg) -> dict[str, float]:
    """The drafter's parameters (model/dspark.py; built on the meta device): all of them, its routed experts, and
    those one drafted token reads (the routed experts times top-k / num_experts; the Markov tables one row each)."""
    with torch.device("meta"):
        d = DSpark(cfg)
    routed = sum(_numel(layer.ffn.experts.parameters()) for layer in d.layers)
    markov = d.markov_in.weight.numel()
    total = _numel(d.parameters())
    k, e = cfg.dspark.experts_per_token, cfg.dspark.num_experts
    return {"params_dspark": total, "params_dspark_routed_experts": routed,
            "params_dspark_active": total - routed + routed * k / e - markov + cfg.dspark.markov_rank}


def vision_parameters(cfg, tp: int = 1, shard_dims: ShardDims | None = None) -> dict[str, int]:
    """The vision side's parameters (model/vision/; built on the meta device): all of them, the ViT's, the aligner's
    (the START / NEWLINE / END vectors are the rest), and with tp > 1 those one tensor-parallel rank holds: those
    `shard_dims(tower)` names are split (the tower's plan, trainer.parallel.tensor.vision_shard_dims; the model
    knows no plan). {} for a text-only model (model.vision.num_layers 0). Not part of params_total, which counts the
    backbone (`parameter_groups` leaves out Transformer.vision, which model.build builds too)."""
    if cfg.vision.num_layers == 0:
        return {}
    if tp > 1 and shard_dims is None:
        raise ValueError(f"vision_parameters(tp={tp}) needs shard_dims: the tensor-parallel plan's split parameters")
    with torch.device("meta"):
        v = VisionEncoder(cfg.vision, cfg.dim, cfg.init_std)
    out = {"params_vision": _numel(v.parameters()), "params_vision_vit": _numel(v.vit.parameters()),
           "params_vision_aligner": _numel(v.aligner.parameters())}
    if tp > 1:
        split = shard_dims(v)
        out["params_vision_per_tp_rank"] = sum(p.numel() // tp if name in split else p.numel()
                                               for name, p in v.named_parameters())
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


# ---------------------------------------------------------------------------------------------------------------------
# Training memory: what one layer keeps for its backward
#
# Per layer and micro-batch of N = B * T tokens (T: this process's tokens; the compressed entries E = context / m
# cover the whole sequence, gathered under context parallelism), in bytes, for the run the planner plans: CUDA,
# bf16 autocast (c = 2 bytes per compute value), parameters and so the residual streams in fp32 (s = 4: the
# embedding's dtype), the Triton kernels where model/kernels.py uses them (sparse attention, indexer, fused mHC
# step) and the PyTorch Engram (a row-sharded table is a DTensor, which keeps Engram on its reference path).
# Read off the forward code: autocast saves the bf16 copy a linear or einsum casts its input to (one copy per call:
# it caches only leaf weights), every `.float()` of a bf16 tensor is a new fp32 tensor the next op saves, and the
# bf16 copy of every matmul weight stays in the graph until backward, once per micro-batch.
#   weight_casts    c * every matmul weight of the layer this rank holds (experts: E / ep of them, the per-expert
#                   loop casts each one it runs, as the dispatched rows are fp32 and miss the grouped GEMM); the
#                   mHC `fn`, the router and a ratio > 1 compressor's projections run in fp32 and the Engram table
#                   is read, not multiplied: none of them is cast
#   streams         the block's input S (saved by hc_attn and the collapse), hc_attn's RMS-normalised fp32 copy
#                   (its projection's input), S after the attention's expand (saved by the fused step for the FFN
#                   expand): n*dim*(2s + 4) per token; the FFN expand also keeps the MoE output in fp32 (4*dim)
#   mhc_coefficients two sites' Sinkhorn iterations (2 * (n^2 + n) fp32 each) and gates, the fused step's mix
#   norms           attn_norm and ffn_norm each keep x and x * rsqrt in fp32: 2 * 2 * 4 * dim
#   attention       bf16 input casts of wq_a and wkv (2c*dim), q_norm (2 * 4 * q_lora + c*q_lora), kv_norm
#                   (2 * 4 * D + c*D), the kernel's q, out and lse (H*D*c twice, 4H), the inverse-RoPE output read
#                   by wo_a (H*D*c), wo_a's output read by wo_b (G*o_lora*c), the output read by the mHC step
#                   (c*dim); the head-split terms divide by tp
#   selection       index sources: int32 top-k ids (4K) the attention kernels of the layer and its Reuse layers
#                   keep; the pool builder also keeps int32 pool blocks (4P)
#   indexer         index sources: kernel inputs q (Hi*Di*c) and w (4Hi), weights_proj's input cast (c*dim), and
#                   the KL over [N, E]: log_softmax output and target in fp32, three bool masks (11 E per token)
#   compressor      KV sources: the fp32 input of the pooling projections (4*dim; ratio 1: its bf16 cast, c*dim),
#                   the gate softmax (4D) and the fp32 values (4D) per token, per entry the latent norm (8D) and the
#                   key path (c*D + 8Di); a decoder Full layer also norms h_{L/2} (2 * 4 * dim)
#   moe             the router's fp32 input (4*dim) and fp32 logit/softplus chain (4 * 4 per expert); per routed copy
#                   (K per token): the bf16 input casts of w1 and w3 (2c*dim), six fp32 [F] SwiGLU intermediates
#                   (g, u, both clamps, silu, product with the weight), w2's bf16 input and the routing indices;
#                   the shared expert likewise without the weight product; F divides by tp
#   engram          Engram layers: the row ids, wkv's bf16 input (c*C*Dh), the gate's streams, fp32 key and h*qk
#                   (3 * 4 * n*dim), the fp32 value (4*dim), about ten fp32 [n] gate intermediates
# Not counted: per-layer constants (RoPE tables, the sites' small parameters).
# tests/trainer/test_plan.py measures the saved tensors of the MoE, the Engram and an mHC site on CPU (where they run
# the same code) against these terms.
# ---------------------------------------------------------------------------------------------------------------------

def _matmul_weights(layer) -> list[tuple[str, torch.Tensor]]:
    """The weights autocast casts to the compute dtype (and keeps a copy of per micro-batch): not mHC's `fn`, the
    router's, a ratio > 1 compressor's (all three run in fp32: model.common.full_precision) or Engram's table."""
    skip = {id(p) for m in layer.modules() if hasattr(m, "fn") for p in [m.fn]}
    for m in layer.modules():
        if isinstance(m, Router):
            skip.add(id(m.weight))
        elif isinstance(m, Compressor) and m.ratio > 1:
            skip.update(id(p) for p in (m.wkv.weight, m.wgate.weight))
    if layer.engram is not None:
        skip.add(id(layer.engram.table))
    return [(n, p) for n, p in layer.named_parameters() if p.ndim >= 2 and id(p) not in skip]


def layer_activation_bytes(layer, tokens: int, context: int, *, stream_bytes: int = 4, compute_bytes: int = 2,
                           tp: int = 1, ep: int = 1, shard_dims: ShardDims | None = None) -> dict[str, float]:
    """Bytes `layer` (a model.block.Block) keeps for backward on `tokens` tokens of a sequence of `context` tokens
    (compressed entries E = context // ratio), itemised as in the table above, on a rank holding 1 / ep of the
    routed experts and 1 / tp of the weights `shard_dims(layer)` names (the tensor-parallel plan's,
    trainer.parallel.tensor.block_shard_dims; needed with tp > 1)."""
    if tp > 1 and shard_dims is None:
        raise ValueError(f"layer_activation_bytes(tp={tp}) needs shard_dims: the tensor-parallel plan's split weights")
    cfg = layer.attn.cfg
    spec, attn, moe = layer.spec, layer.attn, layer.ffn
    s, c, n, dim = stream_bytes, compute_bytes, cfg.mhc.num_streams, cfg.dim
    H, D = attn.num_heads, attn.head_dim
    q_lora, o_groups, o_lora = attn.wq_a.out_features, cfg.attention.o_groups, cfg.attention.o_lora_rank
    iters = cfg.mhc.sinkhorn_iters
    casts = 0.0
    tp_dims = shard_dims(layer) if tp > 1 else {}  # what the plan splits over tp
    for name, p in _matmul_weights(layer):
        split = (tp if name in tp_dims else 1) * (ep if name.startswith("ffn.experts.") else 1)
        casts += p.numel() / split
    per_token: dict[str, float] = {
        "streams": n * dim * (2 * s + 4) + 4 * dim,
        "mhc_coefficients": 2 * 4 * (iters * 2 * (n * n + n) + 2 * n * n) + 4 * (n + 1) ** 2,
        "norms": 2 * 2 * 4 * dim,
        "attention": (2 * c * dim + 2 * 4 * q_lora + c * q_lora + 2 * 4 * D + c * D + c * dim
                      + (3 * H * D * c + 4 * H + o_groups * o_lora * c) / tp),
    }
    c2 = cfg.csa2
    if spec.owns_indexer:
        entries = context // spec.ratio
        idx = attn.indexer
        per_token["selection"] = 4 * c2.index_topk + (4 * c2.candidate_topk_blocks if spec.builds_pool else 0)
        per_token["indexer"] = idx.num_heads * idx.head_dim * c + 4 * idx.num_heads + c * dim + 11 * entries
    if spec.owns_kv:
        Di = c2.index_head_dim
        per_entry = 8 * D + c * D + 8 * Di
        comp = 4 * dim + 8 * D if spec.ratio > 1 else c * dim + 8 * D
        if spec.kv_input == "h_mid":
            comp += 2 * 4 * dim
        per_token["compressor"] = comp + per_entry / spec.ratio
    K, F_exp = moe.cfg.experts_per_token, moe.cfg.expert_dim / tp
    shared = moe.cfg.num_shared_experts * moe.cfg.expert_dim / tp
    per_token["moe"] = (4 * dim + 4 * 4 * moe.num_experts + K * (2 * c * dim + 6 * 4 * F_exp + c * F_exp + 3 * 8)
                        + (2 * c * dim + 5 * 4 * shared + c * shared if moe.shared_experts is not None else 0))
    if layer.engram is not None:
        e = layer.engram
        per_token["engram"] = e.num_columns * (8 + c * e.head_dim) + 3 * 4 * n * dim + 4 * dim + 10 * 4 * n
    out = {k: v * tokens for k, v in per_token.items()}
    out["weight_casts"] = c * casts
    return out


def layer_checkpoint_bytes(layer, tokens: int, *, stream_bytes: int = 4) -> float:
    """What a layer keeps under full activation checkpointing: its inputs, the streams S and the previous `pre`."""
    n, dim = layer.attn.cfg.mhc.num_streams, layer.attn.cfg.dim
    return tokens * (n * dim * stream_bytes + 4 * n)


def layer_transient_bytes(layer, tokens: int, context: int, *, stream_bytes: int = 4,
                          compute_bytes: int = 2) -> dict[str, float]:
    """The largest short-lived buffers of one layer's forward or backward (freed before the next layer runs):
    the indexer's fp32 scores and their masked copy [N, E] (index sources), the sparse-attention backward's
    P / dS scratch (bounded by the kernel's query chunking at 1 GiB), the MoE dispatch (fp32 rows out, bf16 results
    back, the fp32 sum over K)."""
    cfg, spec = layer.attn.cfg, layer.spec
    c, dim, H = compute_bytes, cfg.dim, layer.attn.num_heads
    slots = cfg.attention.window + (cfg.csa2.index_topk if spec.ratio else 0)
    out = {"attention_backward_scratch": min(float(1 << 30), 2.0 * tokens * H * slots * c)}
    if spec.owns_indexer:
        out["indexer_scores"] = 2 * 4 * tokens * (context // spec.ratio)
    K = layer.ffn.cfg.experts_per_token
    out["moe_dispatch"] = tokens * K * dim * (stream_bytes + c + 4)
    return out
