"""The decode step of one CSA2 layer on the serving kernels (issue 40): `model.serving.decode_step(...,
kernels="triton")` runs each layer's attention and index-source choice here instead of the reference operations.

Shape legend: B cache rows (one token each), H heads, D latent width, N entry slots, P pool blocks, K top-k.

Contract: `decode_attention` computes what `model.serving.cached_attention` computes for a static decode step (to
fp32 rounding, the same cache contents) from the stored bytes: attention over the window ring and the selected
main-KV entries only (kernels.sparse_decode); an index source scores the stored keys in place and picks its top-k
(kernels.indexer_decode), a Reindex layer over its pool only; a Reuse layer runs no indexer. Selections are
[B, 1, K'] int32 entry ids (-1 empty), the pool [B, P] int32 block ids ascending (-1 last). Static shapes, no host
read: a CUDA graph captures it. `check_decode_kernels` gives the one-line reason a model cannot take this path.

Design and reasoning: docs/generation.md#decode-on-the-kernels
"""

from __future__ import annotations

import importlib.util
import os

import torch

from kernels import fp8
from model import kernels as kern
from model.common import autocast_dtype, local
from model.forward import LayerOutputs
from model.rope import apply_rope

__all__ = ["decode_attention", "decode_pool", "check_decode_kernels", "DECODE_KERNELS"]

DECODE_KERNELS = ("reference", "triton")
"""decode_step's `kernels`: the reference operations, or this module's path on the Triton kernels."""


def check_decode_kernels(cfg, device: torch.device | None = None) -> str | None:
    """Why a model of config cfg (on `device`, when given: Triton and the device are checked too) cannot decode on
    the kernels (a one-line reason), or None. Every cache storage format is read by the kernels
    (kernels.sparse_decode.STORE_FMT)."""
    if cfg.indexer.phase != "sparse":
        return (f"the decode kernels attend to the top-k (indexer.phase='sparse'); this model is in "
                f"indexer.phase={cfg.indexer.phase!r}")
    if device is None:
        return None
    if importlib.util.find_spec("triton") is None:
        return "the decode kernels need Triton, which is not installed"
    if torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return f"the Triton kernels need the model on a CUDA device (or TRITON_INTERPRET=1 on the CPU), not {device}"
    return None


def _kernels():
    """(kernels.sparse_decode, kernels.indexer_decode), imported on the first decode on the kernels: Triton is an
    optional dependency (none off Linux), and the reference path runs without it."""
    from kernels import indexer_decode, sparse_decode  # Triton is optional: the reference path runs without it

    return sparse_decode, indexer_decode


def decode_attention(layer, x: torch.Tensor, state, made: LayerOutputs):
    """x [B, 1, dim] the decode token's attention input; made: what the layer made so far (a KV source's entries,
    already written by the caller). Writes the token's SWA row, runs the index source's choice and the attention.
    Returns (the attention output before the output projection [B, 1, H, D], cos, sin, made)."""
    a, qc = layer.cfg.attention, layer.cfg.quant
    spec = layer.spec
    lc = state.cache.layers[spec.index]
    pos = state.positions  # [B, 1]
    B = x.shape[0]
    cos, sin = state.rope(a, spec.rope, pos, x.dtype)
    q_res, q = layer.queries(x, cos, sin)  # [B, 1, H, D]
    # the token's window row first: the kernel reads the window (own row included) from the ring alone
    fmt = "fp8" if qc.swa_kv == "fp8" else None
    swa_pre = apply_rope(layer.kv_norm(layer.wkv(x)), cos, sin)
    if lc.swa.fmt == "fp8":
        # an FP8 ring stores quantize_fp8 of the pre-fake-quant row whether or not the forward fake-quantises it
        # (Store.encode): one quantising kernel, bit-identical to the reference (kernels/fp8_triton.py)
        parts = fp8.quantize_fp8(swa_pre.contiguous(), 32, impl="triton")
    else:
        parts = lc.swa.encode(kern.fake_quant(swa_pre, fmt, "reference"), swa_pre, fmt)
    R = lc.swa.buffers[0].shape[1]
    lc.swa.write(torch.arange(B, device=x.device), pos[:, 0] % R, tuple(p[:, 0] for p in parts))

    main = ids = None
    if spec.ratio > 0:
        entries, idx_keys = made.kv if spec.owns_kv else state.kv[spec.kv_source]
        if spec.owns_indexer:
            made.selection, made.pool = _choose(layer, x, q_res, idx_keys.store, state)
        ids = (made.selection if spec.owns_indexer else state.selection[spec.index_source])[:, 0]
        main = entries.store
    # the reference's einsums run in the autocast dtype inside an autocast region: the query (and so the kernel's
    # dots, the keys cast to it exactly) takes it too; the output comes back in the query's dtype, as attend's
    kernel = _kernels()[0].sparse_decode
    out = kernel(q[:, 0].to(autocast_dtype(q.device.type) or q.dtype), lc.swa.buffers, lc.swa.fmt, pos[:, 0],
                 state.cache.swa_start, a.window, None if main is None else main.buffers,
                 None if main is None else main.fmt, ids, local(layer.attn_sink).float())
    return out[:, None].to(q.dtype), cos, sin, made


def _choose(layer, x, q_res, keys, state):
    """Index source: (top-k entry ids [B, 1, K'] int32, the pool [B, P] a pool builder makes, else None)."""
    c, spec = layer.cfg.csa2, layer.spec
    bs = c.candidate_block_size
    qi, w = layer.index_queries(x, q_res, state, "reference")  # [B, 1, Hi, Di], [B, 1, Hi]
    pos = state.positions[:, 0]
    # FP4 queries against FP4 keys: the products are exact in bf16 (the GPU's tensor cores)
    fp4_values = layer.cfg.quant.index == "fp4" and keys.fmt == "fp4_ue8m0"
    pool = state.pool if spec.uses_pool else None
    index = _kernels()[1]
    scores = index.index_scores_decode(qi[:, 0], w[:, 0], keys.buffers, keys.fmt, pos, spec.ratio, pool=pool,
                                       block_size=bs, fp4_values=fp4_values)
    ids = index.select_decode_topk(scores, c.index_topk, pool=pool, block_size=bs)
    new_pool = decode_pool(scores, pos, spec.ratio, bs, c.candidate_topk_blocks) if spec.builds_pool else None
    return ids[:, None], new_pool


def decode_pool(scores: torch.Tensor, positions: torch.Tensor, ratio: int, block_size: int, topk_blocks: int
                ) -> torch.Tensor:
    """`model.csa2.candidate_pool` for one query a row: scores [B, N] (-inf outside the domain), positions [B] ->
    the pool's block ids [B, min(topk_blocks, NB)] int32, ascending, -1 (empty) last."""
    B, N = scores.shape
    nb = -(-N // block_size)
    s = torch.nn.functional.pad(scores, (0, nb * block_size - N), value=float("-inf"))
    block = s.view(B, nb, block_size).amax(-1)  # [B, NB]
    newest = (positions + 1) // ratio - 1  # the newest visible entry's block is always in
    nb_idx = (newest.clamp(min=0) // block_size)[:, None]
    forced = torch.where((newest >= 0)[:, None], float("inf"), block.gather(-1, nb_idx))
    ids = _kernels()[1].select_decode_topk(block.scatter(-1, nb_idx, forced), topk_blocks)
    ordered = torch.where(ids < 0, nb, ids).sort(-1).values
    return torch.where(ordered >= nb, -1, ordered).to(torch.int32)
