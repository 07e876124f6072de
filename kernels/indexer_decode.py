"""Indexer scoring of a decode step on the cache's stored indexer keys (issue 40), dequantised in the kernel
(DeepGEMM's fp8_fp4_mqa_logits idea), and the top-k over the scores on kernels.topk.

Shape legend: B requests, Hi / Di indexer heads / head dim, N key slots, P pool blocks, BS entries a block, K top-k.

Contract: `index_scores_decode(q, w, keys, fmt, positions, ratio)` -> [B, N] fp32, Di^-1/2 sum_h w relu(q . k) as
kernels.indexer, -inf where entry e is not visible at positions[b] (e >= (p + 1) // ratio); with `pool` ([B, P] int32
block ids, -1 empty) only the pool's slots, [B, P * BS] (slot i * BS + j: entry pool[b, i] * BS + j). Keys come as
the store's buffers in a kernels.sparse_decode.STORE_FMT format. `select_decode_topk` -> entry ids [B, min(k, X)]
int32 (-1: none), ties to the lowest position (a pool sorted by block id keeps the lowest entry id). No host read (a
CUDA graph captures both). `index_scores_decode_reference` is the plain-PyTorch equal.

Design and reasoning: docs/generation.md#decode-on-the-kernels
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.sparse_decode import STORE_FMT, decode_rows, load_stored_rows
from kernels.topk import RESIDENT_MAX_N, topk
from kernels.triton_common import check_device, dot, interpreting

__all__ = ["index_scores_decode", "index_scores_decode_reference", "select_decode_topk", "INDEX_DECODE_CONFIG"]

INDEX_DECODE_CONFIG = {"BLOCK_E": 64, "num_warps": 4}


@triton.jit
def _scores_decode(q_ptr, w_ptr, kv_ptr, ks_ptr, pos_ptr, pool_ptr, out_ptr, N, X, P, ratio, scale,
                   HI: tl.constexpr, DI: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_DI: tl.constexpr,
                   BLOCK_E: tl.constexpr, BS: tl.constexpr, FMT: tl.constexpr, POOL: tl.constexpr,
                   PREC: tl.constexpr):
    """Program (x block, b): scores of BLOCK_E entries (or pool slots) of request b for its one query."""
    scale = tl.cast(scale, tl.float32)
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_x = pid * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_h = tl.arange(0, BLOCK_HI)
    offs_c = tl.arange(0, BLOCK_DI)
    h_ok = offs_h < HI
    n_vis = (tl.load(pos_ptr + b) + 1) // ratio
    if POOL:
        blk = tl.load(pool_ptr + b * P + offs_x // BS, mask=offs_x < X, other=-1)
        ent = blk * BS + offs_x % BS
        valid = (blk >= 0) & (ent < n_vis) & (ent < N)
    else:
        ent = offs_x
        valid = (ent < n_vis) & (ent < N)
    k = load_stored_rows(kv_ptr, ks_ptr, b * N + tl.where(valid, ent, 0), valid, DI, BLOCK_DI, FMT)  # [BE, BDI]
    q = tl.load(q_ptr + (b * HI + offs_h)[:, None] * DI + offs_c[None, :],
                mask=h_ok[:, None] & (offs_c < DI)[None, :], other=0.0)  # [BHI, BDI]
    w = tl.load(w_ptr + b * HI + offs_h, mask=h_ok, other=0.0)  # [BHI]
    if PREC == "bf16":
        # the caller vouches that q and k hold FP4 values (exact in bf16): tensor-core products are then exact
        d = dot(k.to(tl.bfloat16), tl.trans(q.to(tl.bfloat16)), None, "tf32")
    else:
        d = dot(k, tl.trans(q.to(tl.float32)), None, PREC)  # [BE, BHI]
    s = tl.sum(tl.maximum(d, 0.0) * w[None, :], 1) * scale
    tl.store(out_ptr + b * X + offs_x, tl.where(valid, s, float("-inf")), mask=offs_x < X)


def index_scores_decode(q: torch.Tensor, w: torch.Tensor, keys: tuple, fmt: str, positions: torch.Tensor,
                        ratio: int, *, pool: torch.Tensor | None = None, block_size: int = 1,
                        fp4_values: bool = False) -> torch.Tensor:
    """q [B, Hi, Di] (one query per request), w [B, Hi] fp32, keys the store's buffers [B, N, ...] in format fmt,
    positions [B] -> scores [B, N] fp32 (or [B, P * block_size] over pool [B, P] int32). fp4_values: q and the keys
    hold FP4 grid values times power-of-two or E4M3 scales (exact in bf16), so the GPU may multiply in bf16 on the
    tensor cores (fp32 accumulation: the same scores to fp32 rounding); otherwise the dots run in fp32."""
    if q.dim() != 3 or w.shape != q.shape[:2] or w.dtype != torch.float32:
        raise ValueError(f"index_scores_decode: q must be [B, Hi, Di] and w fp32 [B, Hi], got {tuple(q.shape)} and "
                         f"{w.dtype} {tuple(w.shape)}")
    B, Hi, Di = q.shape
    if fmt not in STORE_FMT:
        raise ValueError(f"index_scores_decode: fmt must be one of {list(STORE_FMT)}, got {fmt!r}")
    code = STORE_FMT[fmt]
    kv = keys[0]
    if kv.dim() != 3 or kv.shape[0] != B or kv.shape[2] != (Di // 2 if code >= 2 else Di):
        raise ValueError(f"index_scores_decode: key values of a {fmt!r} store must be [{B}, N, "
                         f"{Di // 2 if code >= 2 else Di}], got {tuple(kv.shape)}")
    ks = keys[1] if code else kv
    kv, ks = (t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu) else t for t in (kv, ks))
    if positions.shape != (B,):
        raise ValueError(f"index_scores_decode: positions must be [{B}], got {tuple(positions.shape)}")
    if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 1:
        raise ValueError(f"index_scores_decode: ratio must be an int >= 1, got {ratio!r}")
    N = kv.shape[1]
    if pool is None:
        X, P, pool_arg = N, 0, positions
    else:
        if pool.dim() != 2 or pool.shape[0] != B or pool.dtype != torch.int32:
            raise ValueError(f"index_scores_decode: pool must be int32 [{B}, P], got {pool.dtype} {tuple(pool.shape)}")
        if block_size & (block_size - 1):
            raise ValueError(f"index_scores_decode: block_size must be a power of two, got {block_size}")
        P = pool.shape[1]
        X, pool_arg = P * block_size, pool.contiguous()
    q, w = q.contiguous(), w.contiguous()
    check_device("q, w, keys, positions and pool", "index_scores_decode", q, w, kv, ks, positions, pool_arg)
    out = torch.empty(B, X, dtype=torch.float32, device=q.device)
    if interpreting():
        prec = "interp"
    else:
        prec = "bf16" if fp4_values else "ieee"
    BE = INDEX_DECODE_CONFIG["BLOCK_E"]
    if X:
        _scores_decode[(triton.cdiv(X, BE), B)](
            q, w, kv, ks, positions, pool_arg, out, N, X, P, ratio, Di ** -0.5, HI=Hi, DI=Di,
            BLOCK_HI=max(16, triton.next_power_of_2(Hi)), BLOCK_DI=max(16, triton.next_power_of_2(Di)), BLOCK_E=BE,
            BS=block_size, FMT=code, POOL=pool is not None, PREC=prec, num_warps=INDEX_DECODE_CONFIG["num_warps"])
    return out


def select_decode_topk(scores: torch.Tensor, k: int, *, pool: torch.Tensor | None = None, block_size: int = 1
                       ) -> torch.Tensor:
    """Scores [B, X] (-inf = not allowed) -> entry ids [B, min(k, X)] int32 of the top picks (-1 where a pick is
    -inf), ties to the lowest position (kernels.topk's Triton kernels, "radix" past RESIDENT_MAX_N); with pool
    ([B, P] block ids) positions are pool slots, mapped to their entries."""
    X = scores.shape[-1]
    variant = "resident" if max(triton.next_power_of_2(X), 16) <= RESIDENT_MAX_N else "radix"
    vals, pos = topk(scores, min(k, X), impl="triton", variant=variant)
    if pool is not None:  # (a pick of -inf may come back at any position: clamped before the gather, masked after)
        pos = pos.clamp(0, X - 1)
        ent = pool.gather(-1, (pos // block_size).long()) * block_size + pos % block_size
    else:
        ent = pos
    return torch.where(vals > float("-inf"), ent, -1).to(torch.int32)


def index_scores_decode_reference(q, w, keys, fmt, positions, ratio, *, pool=None, block_size=1):
    """`index_scores_decode` on the decoded keys, with kernels.indexer's operations (fp32 dots, ReLU, the head
    weights' sum)."""
    B, Hi, Di = q.shape
    k = decode_rows(tuple(keys), fmt, torch.float32)  # [B, N, Di]
    N = k.shape[1]
    if pool is None:
        ent = torch.arange(N, device=q.device)[None].expand(B, N)
        ok = torch.ones_like(ent, dtype=torch.bool)
    else:
        ent = (pool.long()[..., None] * block_size + torch.arange(block_size, device=q.device)).flatten(1)
        ok = (pool[..., None] >= 0).expand(-1, -1, block_size).flatten(1)
    ok = ok & (ent < ((positions + 1) // ratio)[:, None]) & (ent < N)
    rows = k.gather(1, torch.where(ok, ent, 0)[..., None].expand(-1, -1, Di))
    dots = torch.einsum("bhd,bxd->bhx", q.float(), rows).relu()
    scores = torch.einsum("bhx,bh->bx", dots, w) * Di ** -0.5
    return scores.masked_fill(~ok, float("-inf"))
