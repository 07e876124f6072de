"""Decode attention on the inference cache's stored bytes (issue 40): one query token per request attends to its
SWA window (from the ring) and to its selected top-k entries (from the main-KV store), dequantised in the kernel.

Shape legend: B requests, H heads, D head dim, R ring rows, N main-KV slots, K selected entries, W window.

Contract: `sparse_decode(q, window_kv, window_fmt, positions, swa_start, window, main_kv, main_fmt, ids, sink)` ->
out [B, H, D] in q's dtype, `model.csa2.attend` for one query: window keys are positions (p - W, p] from swa_start
on (position j at ring slot j % R: the caller writes the query's own row first); entries are ids[b] (-1 or outside
[0, N): empty, never read); the sink joins the max and denominator only; no key gives 0. Stores come as their
buffers (`model.cache.Store.buffers`) in a `STORE_FMT` format. Static grids, no host read (a CUDA graph captures
it). `sparse_decode_reference` is the plain-PyTorch equal; `load_stored_rows` (the in-kernel row decoder) and
`decode_rows` are shared with kernels.indexer_decode.

Design and reasoning: docs/generation.md#decode-on-the-kernels
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels import fp4, fp8
from kernels.triton_common import check_device, dot, dot_prec, e2m1_value, e4m3_value, e8m0_value, num_sms

__all__ = ["sparse_decode", "sparse_decode_reference", "load_stored_rows", "decode_rows", "STORE_FMT",
           "DECODE_CONFIG"]

STORE_FMT = {"none": 0, "bf16": 0, "fp8": 1, "fp4": 2, "fp4_ue8m0": 3}
"""A store format (model.cache.STORE_FORMATS) -> the kernels' FMT code: 0 one buffer in a float dtype, 1 e4m3 + an
e8m0 scale per 32, 2 packed e2m1 + an e4m3 scale per 16, 3 packed e2m1 + an e8m0 scale per 32."""
_BLOCK = {1: 32, 2: 16, 3: 32}
_LOG2E = math.log2(math.e)
# Keys per inner step and programs per request: BLOCK_N keys a step; the keys are cut into chunks of CHUNK_BLOCKS
# steps so that B * chunks fills the GPU about twice (batch 1 splits W + K keys over several SMs, batch 32 barely).
# Heads: at most HEADS a program (v41_small's 16 in one; the flagship's 64 in two groups, so the fp32 accumulator
# stays at [32, 512]).
DECODE_CONFIG = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "waves": 2, "HEADS": 32}


@triton.jit
def load_stored_rows(v_ptr, s_ptr, rows, valid, D: tl.constexpr, BLOCK_D: tl.constexpr, FMT: tl.constexpr):
    """Rows [BN] (int64 row numbers of the flattened [B * N] store, valid [BN]) -> fp32 [BN, BLOCK_D], the decoded
    values (0 in invalid rows and padded channels). FMT: see STORE_FMT."""
    offs_d = tl.arange(0, BLOCK_D)
    mask = valid[:, None] & (offs_d < D)[None, :]
    if FMT == 0:
        return tl.load(v_ptr + rows[:, None] * D + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    elif FMT == 1:
        code = tl.load(v_ptr + rows[:, None] * D + offs_d[None, :], mask=mask, other=0).to(tl.int32)
        sc = tl.load(s_ptr + rows[:, None] * (D // 32) + offs_d[None, :] // 32, mask=mask, other=127).to(tl.int32)
        return e4m3_value(code) * e8m0_value(sc)
    else:
        # element 2i in the low nibble of byte i, 2i + 1 in the high one (kernels/fp4.py); each byte read twice
        byte = tl.load(v_ptr + rows[:, None] * (D // 2) + offs_d[None, :] // 2, mask=mask, other=0).to(tl.int32)
        val = e2m1_value((byte >> ((offs_d[None, :] % 2) * 4)) & 0xF)
        if FMT == 2:
            sc = tl.load(s_ptr + rows[:, None] * (D // 16) + offs_d[None, :] // 16, mask=mask, other=0x38)
            return val * e4m3_value(sc.to(tl.int32))
        else:
            sc = tl.load(s_ptr + rows[:, None] * (D // 32) + offs_d[None, :] // 32, mask=mask, other=127)
            return val * e8m0_value(sc.to(tl.int32))


@triton.jit
def _decode_partial(
    q_ptr, wv_ptr, ws_ptr, mv_ptr, ms_ptr, pos_ptr, start_ptr, ids_ptr, m_out, l_out, acc_out,
    R, N, K, W, NW, qk_scale,
    H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    CHUNK: tl.constexpr, WIN_FMT: tl.constexpr, MAIN_FMT: tl.constexpr, PREC: tl.constexpr,
):
    """Program (b, split, head group): one chunk of the window's slots (split < NW) or of the selected entries -> the
    chunk's running max m and sum l (log2 units, no sink) and unnormalised output acc [D] of the group's G heads."""
    qk_scale = tl.cast(qk_scale, tl.float32)
    b = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    NS = tl.num_programs(1)
    offs_h = tl.program_id(2) * G + tl.arange(0, BLOCK_H)
    h_in = (tl.arange(0, BLOCK_H) < G) & (offs_h < H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    hd_ok = h_in[:, None] & (offs_d < D)[None, :]
    q = tl.load(q_ptr + b * H * D + offs_h[:, None] * D + offs_d[None, :], mask=hd_ok, other=0.0)  # [BH, BD]
    m = tl.full([BLOCK_H], -1.0e30, tl.float32)  # finite: a chunk without a valid key keeps l = 0
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    if split < NW:
        p = tl.load(pos_ptr + b)
        first = tl.maximum(tl.load(start_ptr + b), 0)
        for n0 in range(split * CHUNK, tl.minimum(split * CHUNK + CHUNK, W), BLOCK_N):
            j = p - W + 1 + n0 + offs_n  # window positions (p - W, p]
            valid = (j >= first) & (n0 + offs_n < W)
            slot = tl.where(valid, j % R, 0)
            k = load_stored_rows(wv_ptr, ws_ptr, b * R + slot, valid, D, BLOCK_D, WIN_FMT).to(q.dtype)
            m, l, acc = _step(q, k, valid, m, l, acc, qk_scale, PREC)
    else:
        c0 = (split - NW) * CHUNK
        for n0 in range(c0, tl.minimum(c0 + CHUNK, K), BLOCK_N):
            slot = n0 + offs_n
            idx = tl.load(ids_ptr + b * K + slot, mask=slot < K, other=-1)
            valid = (idx >= 0) & (idx < N)
            k = load_stored_rows(mv_ptr, ms_ptr, b * N + tl.where(valid, idx, 0), valid, D, BLOCK_D,
                                 MAIN_FMT).to(q.dtype)
            m, l, acc = _step(q, k, valid, m, l, acc, qk_scale, PREC)
    row = (b * NS + split) * H + offs_h
    tl.store(m_out + row, m, mask=h_in)
    tl.store(l_out + row, l, mask=h_in)
    tl.store(acc_out + row[:, None] * D + offs_d[None, :], acc, mask=hd_ok)


@triton.jit
def _step(q, k, valid, m, l, acc, qk_scale, PREC: tl.constexpr):
    """One block of keys (K = V) for all heads, online softmax in the log2 domain."""
    s = dot(q, tl.trans(k), None, PREC) * qk_scale  # [BH, BN]
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    # probabilities in the keys' dtype before P @ V, as the reference does
    return m_new, l, dot(p.to(k.dtype), k, acc * alpha[:, None], PREC)


@triton.jit
def _decode_combine(m_in, l_in, acc_in, sink_ptr, out_ptr, NS,
                    H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    """Program (b, head group): merge the NS partial softmaxes with the sink (in the max and denominator only)."""
    b = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * G + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = (tl.arange(0, BLOCK_H) < G) & (offs_h < H)
    hd_ok = h_ok[:, None] & (offs_d < D)[None, :]
    m = tl.load(sink_ptr + offs_h, mask=h_ok, other=0.0) * 1.4426950408889634  # sink in log2 units
    for s in range(NS):
        m = tl.maximum(m, tl.load(m_in + (b * NS + s) * H + offs_h, mask=h_ok, other=-1.0e30))
    l = tl.exp2(tl.load(sink_ptr + offs_h, mask=h_ok, other=0.0) * 1.4426950408889634 - m)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for s in range(NS):
        row = (b * NS + s) * H + offs_h
        a = tl.exp2(tl.load(m_in + row, mask=h_ok, other=-1.0e30) - m)
        l += a * tl.load(l_in + row, mask=h_ok, other=0.0)
        acc += a[:, None] * tl.load(acc_in + row[:, None] * D + offs_d[None, :], mask=hd_ok, other=0.0)
    out = acc / l[:, None]
    tl.store(out_ptr + b * H * D + offs_h[:, None] * D + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=hd_ok)


def _check_store(name: str, parts, fmt: str, B: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A store's buffers -> (values, scales) as the kernel reads them (one-byte floats as uint8)."""
    if fmt not in STORE_FMT:
        raise ValueError(f"sparse_decode: {name} format must be one of {list(STORE_FMT)}, got {fmt!r}")
    code = STORE_FMT[fmt]
    width = D if code in (0, 1) else D // 2
    want = 1 if code == 0 else 2
    if len(parts) != want:
        raise ValueError(f"sparse_decode: a {fmt!r} {name} store has {want} buffer(s), got {len(parts)}")
    v = parts[0]
    if v.dim() != 3 or v.shape[0] != B or v.shape[2] != width:
        raise ValueError(f"sparse_decode: {name} values must be [{B}, rows, {width}], got {tuple(v.shape)}")
    if code == 0:
        return v, v
    s = parts[1]
    if tuple(s.shape) != (B, v.shape[1], D // _BLOCK[code]):
        raise ValueError(f"sparse_decode: {name} scales must be [{B}, {v.shape[1]}, {D // _BLOCK[code]}], "
                         f"got {tuple(s.shape)}")
    as_bytes = [t.view(torch.uint8) if t.dtype != torch.uint8 else t for t in (v, s)]
    return as_bytes[0], as_bytes[1]


def sparse_decode(q: torch.Tensor, window_kv: tuple, window_fmt: str, positions: torch.Tensor,
                  swa_start: torch.Tensor, window: int, main_kv: tuple | None, main_fmt: str | None,
                  ids: torch.Tensor | None, sink: torch.Tensor, *, num_splits: int | None = None,
                  heads_per_program: int | None = None) -> torch.Tensor:
    """q [B, H, D] (one query per request, at position positions[b]); window_kv the SWA ring's buffers [B, R, ...];
    swa_start [B] the first window position a request keeps; main_kv the main-KV store's buffers [B, N, ...] and ids
    [B, K] int32 the selected entries (None, None: an SWA-only layer); sink [H] fp32. Returns [B, H, D] in q's dtype.
    num_splits: programs per request and head group (None: DECODE_CONFIG's heuristic), heads_per_program (None:
    at most DECODE_CONFIG["HEADS"]): they change the speed, not the result beyond fp32 rounding."""
    if q.dim() != 3:
        raise ValueError(f"sparse_decode: q must be [B, H, D], got {tuple(q.shape)}")
    B, H, D = q.shape
    wv, ws = _check_store("window", window_kv, window_fmt, B, D)
    R = wv.shape[1]
    if not 1 <= window <= R:
        raise ValueError(f"sparse_decode: window must be in [1, ring rows {R}], got {window}")
    if positions.shape != (B,) or swa_start.shape != (B,):
        raise ValueError(f"sparse_decode: positions and swa_start must be [{B}], got {tuple(positions.shape)} and "
                         f"{tuple(swa_start.shape)}")
    if sink.shape != (H,) or sink.dtype != torch.float32:
        raise ValueError(f"sparse_decode: sink must be fp32 [{H}], got {sink.dtype} {tuple(sink.shape)}")
    if main_kv is None:
        mv, ms, main_code, N, K = wv, ws, 0, 0, 0
        ids = torch.empty(B, 0, dtype=torch.int32, device=q.device)
    else:
        mv, ms = _check_store("main", main_kv, main_fmt, B, D)
        main_code, N = STORE_FMT[main_fmt], mv.shape[1]
        if ids is None or ids.dim() != 2 or ids.shape[0] != B or ids.dtype != torch.int32:
            raise ValueError(f"sparse_decode: ids must be int32 [{B}, K], got "
                             f"{None if ids is None else (ids.dtype, tuple(ids.shape))}")
        K = ids.shape[1]
    q, ids = q.contiguous(), ids.contiguous()
    check_device("q, stores, positions, ids and sink", "sparse_decode", q, wv, ws, mv, ms, positions, swa_start,
                 ids, sink)
    cfg = DECODE_CONFIG
    BN = cfg["BLOCK_N"]
    G = min(H, heads_per_program or cfg["HEADS"])
    HG = triton.cdiv(H, G)
    steps = triton.cdiv(window, BN) + triton.cdiv(K, BN)
    if num_splits is None:
        num_splits = triton.cdiv(cfg["waves"] * num_sms(q.device), B * HG)
    chunk = BN * triton.cdiv(steps, max(1, min(num_splits, steps)))
    NW, NK = triton.cdiv(window, chunk), triton.cdiv(K, chunk)
    NS = NW + NK
    BH, BD = max(16, triton.next_power_of_2(G)), triton.next_power_of_2(D)
    m = torch.empty(B, NS, H, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(B, NS, H, D, dtype=torch.float32, device=q.device)
    _decode_partial[(B, NS, HG)](
        q, wv, ws, mv, ms, positions, swa_start, ids, m, l, acc, R, N, K, window, NW, D ** -0.5 * _LOG2E,
        H=H, G=G, D=D, BLOCK_H=BH, BLOCK_D=BD, BLOCK_N=BN, CHUNK=chunk, WIN_FMT=STORE_FMT[window_fmt],
        MAIN_FMT=main_code, PREC=dot_prec(q.dtype), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    out = torch.empty_like(q)
    _decode_combine[(B, HG)](m, l, acc, sink, out, NS, H=H, G=G, D=D, BLOCK_H=BH, BLOCK_D=BD,
                             num_warps=cfg["num_warps"])
    return out


# -- the plain-PyTorch reference ---------------------------------------------------------------------------------------
def decode_rows(parts: tuple, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    """A store's buffers [..., *] -> the decoded rows [..., D] in dtype, as model.cache.Store.decode does."""
    if STORE_FMT[fmt] == 0:
        return parts[0].to(dtype)
    if fmt == "fp8":
        return fp8.dequantize_fp8(parts[0], parts[1], 32).to(dtype)
    return fp4.dequantize(parts[0], parts[1], 16 if fmt == "fp4" else 32).to(dtype)


def sparse_decode_reference(q, window_kv, window_fmt, positions, swa_start, window, main_kv, main_fmt, ids, sink):
    """`sparse_decode` by decoding every row it reads, then `model.csa2.attend`'s operations for one query."""
    B, H, D = q.shape
    b = torch.arange(B, device=q.device)[:, None]
    R = window_kv[0].shape[1]
    j = positions[:, None] - window + 1 + torch.arange(window, device=q.device)  # [B, W]
    ok = (j >= swa_start[:, None].clamp(min=0)) & (j >= 0)
    keys = decode_rows(tuple(t[b, j % R] for t in window_kv), window_fmt, q.dtype)  # [B, W, D]
    if main_kv is not None:
        N = main_kv[0].shape[1]
        sel = (ids >= 0) & (ids < N)
        rows = decode_rows(tuple(t[b, torch.where(sel, ids, 0).long()] for t in main_kv), main_fmt, q.dtype)
        keys, ok = torch.cat((keys, rows), 1), torch.cat((ok, sel), 1)
    logits = torch.einsum("bhd,bsd->bhs", q, keys).float() * D ** -0.5
    logits = logits.masked_fill(~ok[:, None], float("-inf"))
    sink_col = sink.float()[None, :, None].expand(B, H, 1)
    probs = torch.cat((logits, sink_col), -1).softmax(-1)[..., :-1]
    return torch.einsum("bhs,bsd->bhd", probs.to(keys.dtype), keys).to(q.dtype)
