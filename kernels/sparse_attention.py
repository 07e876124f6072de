"""Sparse shared-KV (MQA) attention with a per-head sink: the public entry point `sparse_attention`, its launch
configs, host wrappers and autograd Functions over the Triton kernels (forward in kernels/sparse_attention_fwd.py,
backward in kernels/sparse_attention_bwd.py), and the gather-based reference (kernels/sparse_attention_ref.py).

Contract: each query attends to its window keys of kv_win and the kv_cmp entries its topk_idx selects, K = V, with
the sink in the softmax max and denominator only (a row with no visible key gives out = 0), as
`model.csa2.attend` does. Quantised inference-cache inputs (FP8 kv_win, FP4 kv_cmp) are forward only: they are
dequantised first, and a gradient through one raises. Caller contract: topk_idx holds distinct entries per query
(duplicates would be counted twice, unlike the one-hot mask of `attend`); -1 marks an empty slot; any index outside
[0, E) is treated as empty (the kernel never reads out of bounds), whereas the reference raises on it.

Design and reasoning: docs/kernels.md#sparse-attention
"""

from __future__ import annotations

import contextlib
import math

import torch
import triton

from kernels import fp4, fp8
from kernels.sparse_attention_bwd import bwd_dkv, bwd_dq, bwd_probs
from kernels.sparse_attention_fwd import sparse_attn_fwd
from kernels.sparse_attention_ref import sparse_attention_reference, topk_to_mask  # noqa: F401 (re-exported)
from kernels.triton_common import dot_prec, interpreting, num_sms

__all__ = ["sparse_attention", "sparse_attention_reference", "topk_to_mask"]

_IMPLS = ("reference", "triton")
_LOG2E = math.log2(math.e)

FP8_BLOCK = 32
"""channels per float8_e8m0fnu scale of the FP8 window KV (SPEC 1.4; `kernels.fp8.quantize_fp8(x, block=32)`)"""
FP4_BLOCK = 16
"""channels per float8_e4m3fn scale of the FP4 compressed KV (SPEC 1.4; `kernels.fp4.quantize(x, 16, "e4m3")`)"""
# Per quantised argument: (format name, values dtype, channels per values element, scales dtype, block).
_QUANT_FORMATS = {
    "kv_win": ("FP8", torch.float8_e4m3fn, 1, torch.float8_e8m0fnu, FP8_BLOCK),
    "kv_cmp": ("FP4", torch.uint8, 2, torch.float8_e4m3fn, FP4_BLOCK),
}

# Launch parameters, measured for H=64, D=512 on an H200 (bench/kernel_cases/sparse_attention.py): the [64, 512]
# fp32 accumulator is 128 registers a thread at 8 warps, and q (and dO) take 64 KB of shared memory each, so key
# blocks stay at 64 rows. Per kernel (num_warps, num_stages); BLOCK_N is shared by the three backward kernels (it
# sets the scratch layout); the scratch for P and dS is bounded by processing the queries in chunks. They are read
# at call time (tests and the benchmark sweep patch them).
# H200 sweep 2026-11-30 (BENCHMARKS.md): no forward variant beat the default loop (PIPE 15.8 ms, SPLIT_D 18.6+ ms
# against 11.5 ms); the unchained key-gradient launch took the backward from 43.0 to 38.2 ms, the key-centric window
# launch made it slower (44.3 ms). The slower variants were removed (the kernel modules' docstrings describe them).
FWD_CONFIG = {"BLOCK_N": 64, "fwd": (8, 2)}
BWD_CONFIG = {"BLOCK_N": 64, "probs": (8, 1), "dq": (8, 2), "dkv": (8, 2), "scratch_bytes": 1 << 30,
              "stacked_probs": False, "split_loads": False, "probs_block_n": 64,
              "dkv_overlap": False, "dkv_sm_share": 0.5}
# The backward's switches (issue 41; stacked_probs and split_loads both False is the kernel measured at 179-182
# TFLOP/s on the H200). Timed on an H100 (2026-12-07, `bench/kernels.py --only sparse_attention/bwd`, H=64, D=512,
# BENCHMARKS.md issue 41 session 23): none pays: the previous kernel 164.2 TFLOP/s, both switches on 161.4,
# stacked_probs alone 162.6, split_loads alone 161.2, dkv in one stage 163.9, probs_block_n 32 152.9, dkv_overlap
# on half / a third of the SMs 161.3 / 125.9; so the defaults stay the previous kernel's (the key gradient's fp32
# atomics, ~43 GB at that shape, bound it, not the loads or the tiles). What the sm_90 compile on a CPU host
# reported (bench/sparse_attention_sm90.py, Triton 3.9, H=64, D=512, launch-time pointer alignment):
# - stacked_probs: `bwd_probs` takes the logits and dO.V of a key block from one [2H, D] x [D, BN] dot instead of
#   two [H, D] x [D, BN] dots. With 64 heads and 8 warps the two dots split BN = 64 between the warpgroups: m64n32
#   tiles, which need ~190 B/clk of shared memory per SM at the tensor cores' rate against 128 available; the
#   stacked dot gives each warpgroup one of them whole (m64n64, ~125 B/clk). 192 KB of shared memory either way.
# - split_loads: `bwd_dkv` reads [q; dO] and [dS; P] through two masked loads each instead of one load through a
#   per-row pointer select, which the compiler could not prove aligned: 16-bit loads (256 a thread per query for
#   [q; dO], 32 per key block for [dS; P]) become 16-byte ones, and the [dS; P] tile of each key block becomes an
#   asynchronous copy pipelined over two stages (224 KB of shared memory, 180 registers; was 208 KB and 218).
# - probs_block_n: the key block of `bwd_probs` (a divisor of BLOCK_N). 64 with one stage (the keys are a plain
#   load each block: two stages of 64 keys need 272 KB); 32 with two stages pipelines the key loads (200 KB) at
#   m64n32 tiles.
# - dkv_overlap (off until timed): `bwd_dkv` of each chunk on a high-priority side stream, as a persistent grid of
#   dkv_sm_share of the SMs, beside the next chunk's `bwd_probs` and `bwd_dq` (two scratch buffers of half the
#   size take turns). The key gradient's fp32 atomics (T x (W + K) x D x 4 bytes, 43 GB at the benchmark's shape)
#   are a memory-system cost and the other two launches a tensor-core one; in order, their times add up.
#   Not for CUDA-graph capture as is (the side stream is created at the first call).
# `python3 bench/kernels.py --only sparse_attention/bwd` times the settings side by side.
# Few heads (a head tile of at most FEW_HEADS rows: v41_small's 16 heads of 256): a [16, D] accumulator is a quarter
# of the register file's worth of the flagship's, and 8 warps over 16 rows mostly wait. Measured on an H100
# (bench/sparse_attention_shapes.py --model v41_small, 2026-12-06, BENCHMARKS.md): 4 warps and two stages everywhere;
# forward 0.603 -> 0.406 ms (top-256 of 1,024 entries) and 0.607 -> 0.527 ms (of 2,048), backward 2.14 -> 1.85-1.89
# and 2.17 -> 2.02-2.04 ms.
FEW_HEADS = 16
FWD_CONFIG_FEW_HEADS = {"BLOCK_N": 128, "fwd": (4, 2)}
BWD_CONFIG_FEW_HEADS = {"BLOCK_N": 64, "probs": (4, 1), "dq": (4, 2), "dkv": (4, 2), "scratch_bytes": 1 << 30,
                        "stacked_probs": False, "split_loads": False, "probs_block_n": 64,
                        "dkv_overlap": False, "dkv_sm_share": 0.5}


def launch_config(direction: str, block_h: int) -> dict:
    """The launch parameters of `direction` ("fwd" / "bwd") for a head tile of block_h rows (read at call time, so
    tests and sweeps may patch the dicts above)."""
    few = block_h <= FEW_HEADS
    if direction == "fwd":
        return FWD_CONFIG_FEW_HEADS if few else FWD_CONFIG
    return BWD_CONFIG_FEW_HEADS if few else BWD_CONFIG


# ------------------------------------------------------------------------------------------------------------------
# Host wrappers
# ------------------------------------------------------------------------------------------------------------------
def _check_kv(name: str, kv, B: int, rows: int | None, D: int, dtype: torch.dtype) -> int:
    """Validate kv_win ([B, T, D], rows = T) or kv_cmp ([B, E, D], rows = None: any E), either a plain tensor in q's
    dtype or its quantised (values, scales) pair (`_QUANT_FORMATS`); return its row count (T or E)."""
    if isinstance(kv, torch.Tensor):
        if kv.dim() != 3 or kv.shape[0] != B or kv.shape[2] != D or (rows is not None and kv.shape[1] != rows):
            want = f"[B, T, D] = {(B, rows, D)}" if rows is not None else f"[B, E, D] with B={B}, D={D}"
            raise ValueError(f"sparse_attention: {name} must be {want}, got {tuple(kv.shape)}")
        if kv.dtype != dtype:
            raise TypeError(f"sparse_attention: {name} must have q's dtype {dtype}, got {kv.dtype}")
        return kv.shape[1]
    fmt, values_dtype, per_value, scales_dtype, block = _QUANT_FORMATS[name]
    pair = f"an {fmt} (values {values_dtype}, scales {scales_dtype}) tuple"
    if not (isinstance(kv, tuple) and len(kv) == 2 and all(isinstance(t, torch.Tensor) for t in kv)):
        raise TypeError(f"sparse_attention: {name} must be a tensor or {pair}, got {type(kv).__name__}")
    values, scales = kv
    if values.dtype != values_dtype or scales.dtype != scales_dtype:
        raise TypeError(f"sparse_attention: quantised {name} must be {pair}, got ({values.dtype}, {scales.dtype})")
    if D % block != 0:
        raise ValueError(f"sparse_attention: {fmt} {name} needs D divisible by its scale block {block}, got D={D}")
    n = rows if rows is not None else (values.shape[1] if values.dim() == 3 else "E")
    want_values, want_scales = (B, n, D // per_value), (B, n, D // block)
    if tuple(values.shape) != want_values or tuple(scales.shape) != want_scales:
        raise ValueError(f"sparse_attention: {fmt} {name} must be values {want_values} and scales {want_scales}, "
                         f"got {tuple(values.shape)} and {tuple(scales.shape)}")
    return n


def _kv_tensors(name: str, kv) -> dict[str, torch.Tensor]:
    """The tensors behind a kv argument, named for error messages ({} for None)."""
    if kv is None:
        return {}
    if isinstance(kv, torch.Tensor):
        return {name: kv}
    return {f"{name} values": kv[0], f"{name} scales": kv[1]}


def _check_inputs(q, kv_win, kv_cmp, topk_idx, sink, window) -> tuple[int, int, int, int, int, int]:
    """Validate shapes, dtypes and devices; return (B, T, H, D, E, K)."""
    name = "sparse_attention"
    if q.dim() != 4:
        raise ValueError(f"{name}: q must be [B, T, H, D], got shape {tuple(q.shape)}")
    B, T, H, D = q.shape
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{name}: q must be bf16/fp16/fp32, got {q.dtype}")
    _check_kv("kv_win", kv_win, B, T, D, q.dtype)
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"{name}: window must be a positive int, got {window!r}")
    if tuple(sink.shape) != (H,) or sink.dtype != torch.float32:
        raise ValueError(f"{name}: sink must be fp32 [H] = [{H}], got {sink.dtype} {tuple(sink.shape)}")
    E = K = 0
    tensors = {"q": q, "sink": sink, **_kv_tensors("kv_win", kv_win), **_kv_tensors("kv_cmp", kv_cmp)}
    if kv_cmp is not None:
        E = _check_kv("kv_cmp", kv_cmp, B, None, D, q.dtype)
        if topk_idx is None or topk_idx.dim() != 3 or tuple(topk_idx.shape[:2]) != (B, T):
            got = None if topk_idx is None else tuple(topk_idx.shape)
            raise ValueError(f"{name}: topk_idx must be [B, T, K] = [{B}, {T}, K], got {got}")
        if topk_idx.dtype != torch.int32:
            raise TypeError(f"{name}: topk_idx must be int32 (-1 = empty slot), got {topk_idx.dtype}")
        K = topk_idx.shape[2]
        tensors["topk_idx"] = topk_idx
    for n, t in tensors.items():
        if t.device != q.device:
            raise ValueError(f"{name}: {n} is on {t.device}, q on {q.device}")
    return B, T, H, D, E, K


def _check_triton(tensors: dict[str, torch.Tensor]) -> None:
    for n, t in tensors.items():
        if t is None:
            continue
        if not t.is_contiguous():
            raise ValueError(f"sparse_attention(impl='triton'): {n} must be contiguous (call .contiguous())")
        if t.device.type != "cuda" and not interpreting():
            raise RuntimeError(f"sparse_attention(impl='triton'): {n} is on {t.device}; the Triton kernel needs "
                               "CUDA tensors (or TRITON_INTERPRET=1 for the CPU interpreter)")


def _tiles(H: int, D: int) -> tuple[int, int]:
    # tensor-core tiles need every dim >= 16; padded heads/channels are masked to zero
    return max(16, triton.next_power_of_2(H)), max(16, triton.next_power_of_2(D))


def _stack_keys(q, kv_win, kv_cmp, topk_idx, window: int, block_n: int):
    """Stack the keys as [kv_win (B*T rows); kv_cmp (B*E rows)] (a copy 1/H the size of q) and return
    (keys, idx, E, K, NW): K = 0 when nothing is selected (the kernels then never read idx), NW = W rounded up to
    BLOCK_N."""
    B, T, D = kv_win.shape
    has_cmp = kv_cmp is not None and kv_cmp.shape[1] > 0 and topk_idx.shape[2] > 0
    E = kv_cmp.shape[1] if kv_cmp is not None else 0
    if has_cmp:
        keys, idx, K = torch.cat((kv_win.reshape(B * T, D), kv_cmp.reshape(B * E, D))), topk_idx, topk_idx.shape[2]
    else:
        keys, idx, K = kv_win, torch.empty(1, device=q.device, dtype=torch.int32), 0
    return keys, idx, E, K, triton.cdiv(window, block_n) * block_n


def _launch(cfg: dict, name: str) -> dict:
    warps, stages = cfg[name]
    return {"num_warps": warps, "num_stages": stages}


def _forward_triton(q, kv_win, kv_cmp, topk_idx, sink, window, topk_probs: bool = False):
    B, T, H, D, E, K = _check_inputs(q, kv_win, kv_cmp, topk_idx, sink, window)
    _check_triton({"q": q, "kv_win": kv_win, "kv_cmp": kv_cmp, "topk_idx": topk_idx, "sink": sink})
    BLOCK_H, BLOCK_D = _tiles(H, D)
    cfg = launch_config("fwd", BLOCK_H)
    has_cmp = kv_cmp is not None and E > 0 and K > 0
    E, K = (E, K) if has_cmp else (0, 0)
    out = torch.empty_like(q)
    lse = torch.empty(B, T, H, device=q.device, dtype=torch.float32)
    probs = torch.empty(B, T, K, device=q.device, dtype=torch.float32) if topk_probs else lse
    placeholder_idx = torch.empty(1, device=q.device, dtype=torch.int32)
    # with K = 0 the top-k loop never runs: kv_win and an empty index stand in for kv_cmp and topk_idx
    sparse_attn_fwd[(T, B)](
        q, kv_win, kv_cmp if has_cmp else kv_win, topk_idx if has_cmp else placeholder_idx, sink, out, lse, probs,
        T, E, K, window, D ** -0.5 * _LOG2E,
        H=H, D=D, BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D, BLOCK_N=cfg["BLOCK_N"], PREC=dot_prec(q.dtype),
        TOPK_PROBS=topk_probs, **_launch(cfg, "fwd"),
    )
    if topk_probs and not has_cmp:
        probs = torch.zeros(B, T, 0 if topk_idx is None else topk_idx.shape[2], device=q.device)
    return out, lse, (probs if topk_probs else None)


class _KeyGradientStream:
    """Where `bwd_dkv` runs when BWD_CONFIG["dkv_overlap"] is set on a GPU: a high-priority side stream, so the
    key-gradient launch of one chunk (bound by its fp32 atomics) runs beside the next chunk's probability and dq
    launches (bound by the tensor cores). Events order it: a chunk's `bwd_dkv` waits for its `bwd_probs`; the
    `bwd_probs` that rewrites a scratch buffer waits for the `bwd_dkv` that read it; the caller's stream waits for
    the side stream at the end (so every tensor the side stream used outlives its use). Without overlap, or on the
    CPU interpreter, everything runs in order on the current stream."""

    _streams: dict = {}

    def __init__(self, device: torch.device, overlap: bool):
        self.on = overlap and device.type == "cuda"
        if self.on:
            if device not in self._streams:
                self._streams[device] = torch.cuda.Stream(device, priority=-1)
            self.main, self.side = torch.cuda.current_stream(device), self._streams[device]
            self.freed: dict[int, torch.cuda.Event] = {}

    def before_writing(self, buf: int) -> None:
        if self.on and buf in self.freed:
            self.main.wait_event(self.freed.pop(buf))

    @contextlib.contextmanager
    def launch(self, buf: int):
        if not self.on:
            yield
            return
        self.side.wait_stream(self.main)
        with torch.cuda.stream(self.side):
            yield
        self.freed[buf] = self.side.record_event()

    def join(self) -> None:
        if self.on:
            self.main.wait_stream(self.side)


def _backward_triton(q, kv_win, kv_cmp, topk_idx, sink, window, out, lse, dout):
    B, T, H, D = q.shape
    BLOCK_H, BLOCK_D = _tiles(H, D)
    cfg = launch_config("bwd", BLOCK_H)
    keys, idx, E, K, NW = _stack_keys(q, kv_win, kv_cmp, topk_idx, window, cfg["BLOCK_N"])
    assert cfg["BLOCK_N"] % cfg["probs_block_n"] == 0, "bwd_probs must write every slot the other kernels read"
    NS = NW + K
    dout = dout.contiguous()
    dq = torch.empty_like(q)
    # key gradients in the stacked layout, fp32, accumulated by atomics
    dkv = torch.zeros(B * T + (B * E if K else 0), D, device=q.device, dtype=torch.float32)
    dsink_rows = torch.empty(B, T, H, device=q.device, dtype=torch.float32)
    # P and dS of one chunk of queries at a time, so the scratch stays near cfg["scratch_bytes"] (two buffers of
    # half that when the key-gradient launch overlaps the next chunk)
    overlap = cfg["dkv_overlap"]
    num_bufs = 2 if overlap else 1
    chunk = max(1, min(T, cfg["scratch_bytes"] // (2 * num_bufs * B * H * NS * q.element_size())))
    bufs = [(torch.empty(B * chunk * H, NS, device=q.device, dtype=q.dtype),
             torch.empty(B * chunk * H, NS, device=q.device, dtype=q.dtype)) for _ in range(num_bufs)]
    consts = dict(H=H, D=D, BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D, BLOCK_N=cfg["BLOCK_N"], PREC=dot_prec(q.dtype))
    scale = D ** -0.5
    side = _KeyGradientStream(q.device, overlap)
    # with overlap, a persistent key-gradient grid on a share of the SMs, so the next chunk's launches run beside it
    dkv_rows = max(1, int(num_sms(q.device) * cfg["dkv_sm_share"]) // B) if overlap else None

    def launch_dkv(n_q, t0, p_buf, ds_buf):
        bwd_dkv[(min(n_q, dkv_rows), B) if overlap else (n_q, B)](
            q, dout, idx, p_buf, ds_buf, dkv, B, T, E, K, window, NW, t0, n_q, **consts,
            SPLIT_LOADS=cfg["split_loads"], PERSISTENT=overlap, **_launch(cfg, "dkv"))

    for i, t0 in enumerate(range(0, T, chunk)):
        n_q = min(chunk, T - t0)
        grid = (n_q, B)
        p_buf, ds_buf = bufs[i % num_bufs]
        side.before_writing(i % num_bufs)
        bwd_probs[grid](q, keys, idx, sink, out, dout, lse, p_buf, ds_buf, dsink_rows,
                         B, T, E, K, window, NW, t0, scale, scale * _LOG2E, **consts, STACKED=cfg["stacked_probs"],
                         PROBS_N=cfg["probs_block_n"], **_launch(cfg, "probs"))
        if overlap:  # queued before dq, so its programs take their SMs first
            with side.launch(i % num_bufs):
                launch_dkv(n_q, t0, p_buf, ds_buf)
        bwd_dq[grid](keys, idx, ds_buf, dq, B, T, E, K, window, NW, t0, **consts, **_launch(cfg, "dq"))
        if not overlap:
            launch_dkv(n_q, t0, p_buf, ds_buf)
    side.join()
    dkv_win = dkv[: B * T].view(B, T, D).to(kv_win.dtype)
    if kv_cmp is None:
        return dq, dkv_win, None, dsink_rows.sum((0, 1))
    dkv_cmp = dkv[B * T:].view(B, E, D).to(kv_cmp.dtype) if K else torch.zeros_like(kv_cmp)
    return dq, dkv_win, dkv_cmp, dsink_rows.sum((0, 1))


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv_win, kv_cmp, topk_idx, sink, window, topk_probs):
        out, lse, probs = _forward_triton(q, kv_win, kv_cmp, topk_idx, sink, window, topk_probs)
        ctx.save_for_backward(q, kv_win, kv_cmp, topk_idx, sink, out, lse)
        ctx.window = window
        if probs is None:
            return out
        ctx.mark_non_differentiable(probs)  # a detached target (the indexer learns from it, the backbone does not)
        return out, probs

    @staticmethod
    def backward(ctx, dout, *_):
        q, kv_win, kv_cmp, topk_idx, sink, out, lse = ctx.saved_tensors
        dq, dkv_win, dkv_cmp, dsink = _backward_triton(q, kv_win, kv_cmp, topk_idx, sink, ctx.window, out, lse, dout)
        return dq, dkv_win, dkv_cmp, None, dsink, None, None


_NO_QUANT_GRAD = (
    "sparse_attention: there is no backward through quantised (FP8 kv_win / FP4 kv_cmp) inputs, the inference "
    "cache's formats; run the forward under torch.no_grad() or torch.inference_mode(), or pass dequantised tensors "
    "(kernels.fp8.dequantize_fp8 / kernels.fp4.dequantize) to train"
)


class _QuantisedSparseAttention(torch.autograd.Function):
    """Forward only: quantised KV is the inference cache's format. q, sink and a plain kv argument stay visible to
    autograd, so a gradient asked of them reaches `backward`, which says why there is none (rather than a silent
    zero or a gradient that skips the keys)."""

    @staticmethod
    def forward(ctx, q, kv_win, kv_cmp, topk_idx, sink, window, topk_probs, impl):
        if impl == "triton":
            # the quantised inputs' own checks first, so an error names them rather than the dequantisation's
            _check_triton({"q": q, **_kv_tensors("kv_win", kv_win), **_kv_tensors("kv_cmp", kv_cmp),
                           "topk_idx": topk_idx, "sink": sink})
            out, _, probs = _forward_triton(q, _dequantize(kv_win, q.dtype, "triton"),
                                            _dequantize(kv_cmp, q.dtype, "triton"), topk_idx, sink, window, topk_probs)
        else:
            res = sparse_attention_reference(q, _dequantize(kv_win, q.dtype), _dequantize(kv_cmp, q.dtype), topk_idx,
                                             sink, window, return_topk_probs=topk_probs)
            out, probs = res if topk_probs else (res, None)
        if probs is None:
            return out
        ctx.mark_non_differentiable(probs)
        return out, probs

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(_NO_QUANT_GRAD)


def _dequantize(kv, dtype: torch.dtype, impl: str = "reference"):
    """A separate dequantisation pass: a kv argument -> a plain contiguous tensor in dtype (or None)."""
    if kv is None or isinstance(kv, torch.Tensor):
        return kv
    values, scales = kv
    if values.dtype == torch.uint8:
        return fp4.dequantize(values, scales, FP4_BLOCK, impl=impl).to(dtype).contiguous()
    return fp8.dequantize_fp8(values, scales, FP8_BLOCK, impl=impl).to(dtype).contiguous()


def sparse_attention(
    q: torch.Tensor,
    kv_win: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    kv_cmp: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None,
    topk_idx: torch.Tensor | None,
    sink: torch.Tensor,
    window: int,
    *,
    return_topk_probs: bool = False,
    impl: str = "reference",
):
    """Sparse shared-KV attention: q [B, T, H, D] over the window keys of kv_win [B, T, D] and the entries of
    kv_cmp [B, E, D] selected by topk_idx [B, T, K] int32 (-1 = empty), with sink [H] fp32 -> out [B, T, H, D].

    Differentiable in q, kv_win, kv_cmp and sink for both implementations. kv_cmp may be None (window only).
    With return_topk_probs, returns (out, probs): probs [B, T, K] fp32, detached, the attention probability of each
    top-k slot summed over heads (0 for empty slots), i.e. `attend`'s p_cmp summed over heads at the selected
    entries, the target of the indexer's KL loss.

    Inference-cache formats (SPEC 1.4), each argument independently: kv_win may be FP8 `(values float8_e4m3fn
    [B, T, D], scales float8_e8m0fnu [B, T, D / 32])` (`kernels.fp8.quantize_fp8(x, block=32)`), kv_cmp FP4
    `(codes uint8 [B, E, D / 2], scales float8_e4m3fn [B, E, D / 16])` (`kernels.fp4.quantize(x, 16, "e4m3")`).
    The Triton path dequantises them first, one Triton pass each into q's dtype (bit-exact against the reference
    dequantisers), then runs the plain kernel; the reference dequantises them first too. The result equals the plain
    call on the dequantised tensors cast to q's dtype. Forward only: with a quantised input, a quantised tensor that
    requires grad raises here, and a backward through the output raises."""
    if impl not in _IMPLS:
        raise ValueError(f"sparse_attention: impl must be one of {list(_IMPLS)}, got {impl!r}")
    _check_inputs(q, kv_win, kv_cmp, topk_idx, sink, window)
    quantised = {n: kv for n, kv in (("kv_win", kv_win), ("kv_cmp", kv_cmp)) if isinstance(kv, tuple)}
    if quantised:
        for n, kv in quantised.items():
            # autograd cannot see inside the tuples, so a quantised tensor asking for a gradient is caught here
            if torch.is_grad_enabled() and any(t.requires_grad for t in kv):
                raise RuntimeError(f"{_NO_QUANT_GRAD} (the quantised {n} requires grad)")
        return _QuantisedSparseAttention.apply(q, kv_win, kv_cmp, topk_idx, sink, window, return_topk_probs, impl)
    if impl == "reference":
        return sparse_attention_reference(q, kv_win, kv_cmp, topk_idx, sink, window,
                                          return_topk_probs=return_topk_probs)
    return _SparseAttention.apply(q, kv_win, kv_cmp, topk_idx, sink, window, return_topk_probs)
