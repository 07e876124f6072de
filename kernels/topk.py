"""Row-wise top-k selection (unsorted): the indexer's top-512 and the candidate pool's top-2048 blocks (SPEC 1.2-1.3,
REFERENCE A4 and B4). `impl="reference"` is torch.topk; `impl="triton"` has two kernels, picked by `variant`.

Contract: `topk(x, k)` returns (values [..., K] fp32, indices [..., K] int32) of the K largest entries of each row,
in no particular order. The SET of indices equals torch.topk's whenever the K-th largest value is not tied; when it
is, the Triton kernel takes every entry above it plus the LOWEST indices among the entries equal to it (torch.topk's
own choice among ties is unspecified). -0.0 and +0.0 are equal (a tie), and -inf is an ordinary value: a row with
fewer than K finite entries returns its finite ones plus -inf ones by the same rule. NaN is out of contract.
`variant`: "auto" (default: "resident" when the row has at most RESIDENT_MAX_N entries, torch.topk otherwise, so
longer rows keep torch.topk's choice among ties), "resident", or "radix" (any N, only when asked for by name).

Design and reasoning: docs/kernels.md#top-k-selection
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import interpreting

__all__ = ["topk", "topk_reference", "TOPK_CONFIG"]

_IMPLS = ("reference", "triton")
_VARIANTS = ("auto", "resident", "radix")
# variant="radix" launch parameters; bench/kernel_cases/topk.py sweeps them (sweep=True).
TOPK_CONFIG = {"BLOCK_N": 2048, "RADIX_BITS": 8, "num_warps": 8}
# variant="resident": the longest row held in registers, and the keys per thread the default warp count aims at
# (RESIDENT_MAX_N / (32 * 16 warps) = 64 registers of keys).
RESIDENT_MAX_N = 32768
_RESIDENT_KEYS_PER_THREAD = 64


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


@triton.jit
def _count(mask):
    """Number of true entries of a [COLS, ROWS] mask: axis 1 first (within each thread), then across threads."""
    return tl.sum(tl.sum(mask.to(tl.int32), 1), 0)


# N is not specialised on divisibility: a 16-divisible N would let the first load vectorise (4 entries a thread) while
# the scattered stores cannot, and the layout conversion between the two goes through shared memory (more than an
# H200 has at N = 32768). Unvectorised, every op keeps the load's layout.
@triton.jit(do_not_specialize=["N"])
def _topk_resident_kernel(x_ptr, val_ptr, idx_ptr, N, K, COLS: tl.constexpr, ROWS: tl.constexpr):
    # The row as one [COLS, ROWS] tile, entry c + r * COLS: COLS (= the threads) along axis 0 and ROWS in each
    # thread's registers, so sums and the scan along axis 1 need no communication.
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * N
    offs = tl.arange(0, COLS)[:, None] + tl.arange(0, ROWS)[None, :] * COLS  # [COLS, ROWS] entry index
    ok = offs < N
    # padding keys are 0, below every in-contract key (0 is a negative-signed NaN's), so no search step counts them
    key = tl.where(ok, _keys(tl.load(x_row + offs, mask=ok, other=0.0)), 0)  # [COLS, ROWS] uint32, resident

    # Bitwise search from the MSB for the largest `thr` with at least K keys >= thr (the K-th largest key), stopping
    # once exactly K keys are >= thr. Invariant: num_ge = #keys >= thr >= K.
    thr = tl.full((), 0, tl.uint32)
    num_ge = N
    step = tl.full((), 0x80000000, tl.uint32)
    while (step != 0) & (num_ge != K):
        cand = thr | step
        cnt = _count(key >= cand)
        thr = tl.where(cnt >= K, cand, thr)
        num_ge = tl.where(cnt >= K, cnt, num_ge)
        step = step >> 1

    # Take every key > thr (fewer than K unless the search stopped early) and the `rank` lowest-index keys equal to
    # thr: those at an index below `cut`, found by a second bitwise search (over the index) only when there are more
    # ties than `rank`. Invariant: num_below = #ties at an index < cut <= rank.
    above = key > thr
    tie_at = tl.where(ok & (key == thr), offs, ROWS * COLS)  # index of each tie, past the end otherwise
    rank = K - _count(above)
    all_ties = _count(tie_at < ROWS * COLS) == rank
    cut = tl.where(all_ties, ROWS * COLS, 0)
    num_below = tl.where(all_ties, rank, 0)
    step = (ROWS * COLS) // 2
    while (step != 0) & (num_below != rank):
        cnt = _count(tie_at < (cut | step))
        cut = tl.where(cnt <= rank, cut | step, cut)
        num_below = tl.where(cnt <= rank, cnt, num_below)
        step = step >> 1
    take = above | (tie_at < cut)

    # Output slots thread by thread (the contract leaves the order free): a scan along axis 1 within each thread plus
    # an exclusive scan of the thread totals, rather than one scan over the whole row in index order.
    take_i = take.to(tl.int32)
    col_total = tl.sum(take_i, 1)  # [COLS]
    slot = (tl.cumsum(col_total, 0) - col_total)[:, None] + tl.cumsum(take_i, 1) - 1  # [COLS, ROWS]
    tl.store(idx_ptr + row * K + slot, offs, mask=take)
    # The values are re-read (K of them, from L2) rather than kept resident (twice the registers). The offsets are
    # rebuilt from `take` so that the compiler cannot reuse the first load's 64-bit addresses, which it would keep
    # alive (spilled) through the search.
    vals = tl.load(x_row + tl.where(take, offs, 0), mask=take)
    tl.store(val_ptr + row * K + slot, vals, mask=take)


def topk(x: torch.Tensor, k: int, *, impl: str = "reference", variant: str = "auto", block_n: int | None = None,
         radix_bits: int | None = None, num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., N] fp32 -> (values [..., k] fp32, indices [..., k] int32) of each row's k largest, unsorted.

    See the module docstring for the tie rule (Triton: lowest indices among ties at the k-th value). `variant` picks
    the Triton kernel: "resident" (rows of N <= RESIDENT_MAX_N), "radix" (any N), or "auto" (resident when the row
    fits, torch.topk otherwise: the radix kernel is the slower of the two there). `block_n` and `radix_bits` (radix only) and `num_warps` override TOPK_CONFIG / the resident default of
    one warp per 2048 padded entries, 4 to 16 (the benchmark's sweep)."""
    if impl not in _IMPLS:
        raise ValueError(f"topk: impl must be one of {list(_IMPLS)}, got {impl!r}")
    if variant not in _VARIANTS:
        raise ValueError(f"topk: variant must be one of {list(_VARIANTS)}, got {variant!r}")
    if x.dtype != torch.float32 or x.dim() < 1:
        raise ValueError(f"topk: x must be fp32 [..., N], got {x.dtype} {tuple(x.shape)}")
    N = x.shape[-1]
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= N:
        raise ValueError(f"topk: k must be an int in [0, N={N}], got {k!r}")
    if impl == "reference":
        return topk_reference(x, k)
    if not x.is_contiguous():
        raise ValueError("topk(impl='triton'): x must be contiguous (call .contiguous())")
    if x.device.type != "cuda" and not interpreting():
        raise RuntimeError(f"topk(impl='triton'): x is on {x.device}; the Triton kernel needs CUDA tensors "
                           "(or TRITON_INTERPRET=1 for the CPU interpreter)")
    if N >= 2 ** 31:
        raise ValueError(f"topk(impl='triton'): rows of {N} entries overflow the int32 indices")
    block = max(triton.next_power_of_2(N), 16)
    if variant == "auto":
        if block > RESIDENT_MAX_N:
            if block_n is not None or radix_bits is not None or num_warps is not None:
                raise ValueError(f"topk(variant='auto'): rows of N={N} entries go to torch.topk, which takes no "
                                 "block_n, radix_bits or num_warps; pass variant='radix' to tune the radix kernel")
            return topk_reference(x, k)
        variant = "resident"
    if variant == "resident":
        if block > RESIDENT_MAX_N:
            raise ValueError(f"topk(variant='resident'): rows of N={N} entries exceed RESIDENT_MAX_N={RESIDENT_MAX_N}; "
                             "use variant='radix'")
        if block_n is not None or radix_bits is not None:
            raise ValueError("topk(variant='resident'): block_n and radix_bits are variant='radix' settings")
        if num_warps is None:
            # one warp per 2048 entries, at least 16 from 16K up: on the H200 16 warps took the 16K-entry pool
            # selection from 1.19 to 0.87 ms (bench/kernel_cases/topk.py sweep)
            num_warps = 16 if block >= 16384 else min(max(block // (32 * _RESIDENT_KEYS_PER_THREAD), 4), 16)
        cols = min(block, 32 * num_warps)  # one entry a thread: each thread holds a whole "column" of the tile
        cfg = {"COLS": cols, "ROWS": block // cols, "num_warps": num_warps}
    else:
        cfg = dict(TOPK_CONFIG)
        for name, v in (("BLOCK_N", block_n), ("RADIX_BITS", radix_bits), ("num_warps", num_warps)):
            if v is not None:
                cfg[name] = v
        if cfg["BLOCK_N"] & (cfg["BLOCK_N"] - 1) or not 5 <= cfg["RADIX_BITS"] <= 12:
            raise ValueError(f"topk(variant='radix'): BLOCK_N must be a power of two and RADIX_BITS in [5, 12], "
                             f"got {cfg}")
    values = torch.empty(*x.shape[:-1], k, device=x.device, dtype=torch.float32)
    indices = torch.empty(*x.shape[:-1], k, device=x.device, dtype=torch.int32)
    rows = x.numel() // N if N else 0
    if k and rows:
        kernel = _topk_resident_kernel if variant == "resident" else _topk_kernel
        kernel[(rows,)](x, values, indices, N, k, **cfg)
    return values, indices


def topk_reference(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk, unsorted, with int32 indices."""
    values, indices = x.topk(k, dim=-1, sorted=False)
    return values, indices.to(torch.int32)
