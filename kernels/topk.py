"""Row-wise top-k selection (unsorted) by radix select: the indexer's top-512 and the candidate pool's top-2048 blocks
(SPEC 1.2-1.3, REFERENCE A4 and B4). `impl="reference"` is torch.topk.

Shape legend: R rows (all leading dims flattened, B * T for the indexer), N entries per row, K picks per row.

Contract: `topk(x, k)` returns (values [..., K] fp32, indices [..., K] int32) of the K largest entries of each row,
in no particular order. The SET of indices equals torch.topk's whenever the K-th largest value is not tied; when it
is, the Triton kernel takes every entry above it plus the LOWEST indices among the entries equal to it (torch.topk's
own choice among ties is unspecified). -0.0 and +0.0 are equal (a tie), and -inf is an ordinary value: a row with
fewer than K finite entries returns its finite ones plus -inf ones by the same rule. NaN is out of contract (a
positive-signed NaN ranks above +inf, as in torch.topk; a negative-signed one below -inf).

Kernel (`_topk_kernel`, one program per row, looping over the row in chunks of BLOCK_N):
- Keys: the fp32 bits as uint32 with the sign bit flipped for non-negative values and every bit flipped for negative
  ones, so that unsigned key order is float order (-0.0 is first made +0.0 so the two tie, as they compare).
- Radix select of the K-th largest key, RADIX_BITS bits per pass from the top (8 bits: 4 passes; 11 or 12: 3; 6: 6;
  5 to 12 allowed, wider histograms spill): each pass histograms the next digit of the keys that still match the
  prefix found so far (tl.histogram, 2^RADIX_BITS bins), and the bin where the count from the top reaches the
  remaining rank extends the prefix. After the last pass the prefix is the exact K-th key `thr`, and the remaining
  rank is the number of ties at `thr` to keep.
- One more pass writes, in index order, every entry with key > thr and the first `ties` entries with key == thr;
  output slots come from a running count plus tl.cumsum over the chunk, so exactly K are written.
The row is read (passes + 1) times; at the indexer's sizes (a row of 64-128 KB) the later passes mostly hit L2. The
cost is the histogram, not the bytes: Triton 3.6 lowers it to per-warp ballots and popcounts (work per element grows
with the bin count), Triton 3.9 to one shared-memory atomic per unmasked element (cost grows with same-bin
collisions), hence the radix width is a tuning knob.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["topk", "topk_reference", "TOPK_CONFIG"]

_IMPLS = ("reference", "triton")
# Default launch parameters, not yet tuned on an H200: bench/kernel_cases/topk.py sweeps them (sweep=True).
TOPK_CONFIG = {"BLOCK_N": 2048, "RADIX_BITS": 8, "num_warps": 8}


@triton.jit
def _keys(x):
    """fp32 -> uint32 keys in float order (-0.0 and +0.0 share +0.0's key)."""
    u = tl.where(x == 0.0, 0.0, x).to(tl.uint32, bitcast=True)
    return tl.where((u >> 31) != 0, ~u, u | 0x80000000)


@triton.jit
def _topk_kernel(x_ptr, val_ptr, idx_ptr, N, K, BLOCK_N: tl.constexpr, RADIX_BITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * N
    offs = tl.arange(0, BLOCK_N)
    NUM_BINS: tl.constexpr = 1 << RADIX_BITS
    NUM_PASSES: tl.constexpr = (32 + RADIX_BITS - 1) // RADIX_BITS
    bins = tl.arange(0, NUM_BINS)

    # Radix select: `prefix` holds the K-th largest key's bits above the current digit, `rank` its rank (1 = the
    # largest) among the keys that share that prefix.
    prefix = tl.full((), 0, tl.uint32)
    rank = K
    for p in tl.static_range(NUM_PASSES):
        hi = 32 - RADIX_BITS * p  # (constexpr) bits at and above `hi` are fixed by `prefix`
        if hi > RADIX_BITS:
            shift = hi - RADIX_BITS
        else:
            shift = 0
        hist = tl.zeros([NUM_BINS], dtype=tl.int32)
        for start in range(0, N, BLOCK_N):
            n = start + offs
            ok = n < N
            key = _keys(tl.load(x_row + n, mask=ok, other=0.0))
            if hi < 32:  # a uint32 shift by 32 is undefined; the first pass takes every key
                ok = ok & ((key >> hi) == (prefix >> hi))
            digit = ((key >> shift) & (NUM_BINS - 1)).to(tl.int32)
            hist += tl.histogram(digit, NUM_BINS, mask=ok)
        at_or_above = tl.cumsum(hist, 0, reverse=True)  # keys whose digit is >= the bin's
        # counts from the top are non-increasing in the bin, so the bins reaching `rank` are a leading run
        digit_k = tl.sum((at_or_above >= rank).to(tl.int32)) - 1
        rank -= tl.sum(tl.where(bins == digit_k, at_or_above - hist, 0))
        prefix = prefix | (digit_k.to(tl.uint32) << shift)

    # Write pass: keys above the threshold, then the lowest-index `rank` keys equal to it.
    out = row * K
    written = 0
    ties_seen = 0
    for start in range(0, N, BLOCK_N):
        n = start + offs
        ok = n < N
        x = tl.load(x_row + n, mask=ok, other=0.0)
        key = _keys(x)
        tie = ok & (key == prefix)
        tie_i = tie.to(tl.int32)
        take = (ok & (key > prefix)) | (tie & (ties_seen + tl.cumsum(tie_i, 0) <= rank))
        take_i = take.to(tl.int32)
        slot = out + written + tl.cumsum(take_i, 0) - 1
        tl.store(idx_ptr + slot, n, mask=take)
        tl.store(val_ptr + slot, x, mask=take)
        written += tl.sum(take_i)
        ties_seen += tl.sum(tie_i)


def topk(x: torch.Tensor, k: int, *, impl: str = "reference", block_n: int | None = None,
         radix_bits: int | None = None, num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., N] fp32 -> (values [..., k] fp32, indices [..., k] int32) of each row's k largest, unsorted.

    See the module docstring for the tie rule (Triton: lowest indices among ties at the k-th value). `block_n`,
    `radix_bits` and `num_warps` override TOPK_CONFIG (the benchmark's sweep)."""
    if impl not in _IMPLS:
        raise ValueError(f"topk: impl must be one of {list(_IMPLS)}, got {impl!r}")
    if x.dtype != torch.float32 or x.dim() < 1:
        raise ValueError(f"topk: x must be fp32 [..., N], got {x.dtype} {tuple(x.shape)}")
    N = x.shape[-1]
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= N:
        raise ValueError(f"topk: k must be an int in [0, N={N}], got {k!r}")
    if impl == "reference":
        return topk_reference(x, k)
    if not x.is_contiguous():
        raise ValueError("topk(impl='triton'): x must be contiguous (call .contiguous())")
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise RuntimeError(f"topk(impl='triton'): x is on {x.device}; the Triton kernel needs CUDA tensors "
                           "(or TRITON_INTERPRET=1 for the CPU interpreter)")
    if N >= 2 ** 31:
        raise ValueError(f"topk(impl='triton'): rows of {N} entries overflow the int32 indices")
    cfg = dict(TOPK_CONFIG)
    for name, v in (("BLOCK_N", block_n), ("RADIX_BITS", radix_bits), ("num_warps", num_warps)):
        if v is not None:
            cfg[name] = v
    if cfg["BLOCK_N"] & (cfg["BLOCK_N"] - 1) or not 5 <= cfg["RADIX_BITS"] <= 12:
        raise ValueError(f"topk(impl='triton'): BLOCK_N must be a power of two and RADIX_BITS in [5, 12], got {cfg}")
    values = torch.empty(*x.shape[:-1], k, device=x.device, dtype=torch.float32)
    indices = torch.empty(*x.shape[:-1], k, device=x.device, dtype=torch.int32)
    rows = x.numel() // N if N else 0
    if k and rows:
        _topk_kernel[(rows,)](x, values, indices, N, k, **cfg)
    return values, indices


def topk_reference(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk, unsorted, with int32 indices."""
    values, indices = x.topk(k, dim=-1, sorted=False)
    return values, indices.to(torch.int32)
