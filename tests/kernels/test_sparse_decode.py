"""Proves the decode attention kernel (`kernels.sparse_decode`) equals its plain-PyTorch reference on the same stored
bytes, to fp32 rounding: every store format (FP8 / FP4 rows dequantised in the kernel, raw rows), rings with a
speculation headroom (R > W) and window starts cut by swa_start or position 0, empty and out-of-range top-k slots,
an SWA-only layer (no main KV), awkward sizes (H, K, W not powers of two, K not a multiple of the key block), one
split and many (the partial softmaxes merged with the sink), and an output allocation poisoned with NaN."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports the kernels

import pytest  # noqa: E402

from kernels import fp4, fp8  # noqa: E402
from kernels.sparse_decode import sparse_decode, sparse_decode_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def stored(fmt: str, B: int, N: int, D: int, gen: torch.Generator) -> tuple:
    """Random rows of a store in format fmt, as its buffers."""
    x = torch.randn(B, N, D, generator=gen) * 2.0
    if fmt == "fp8":
        return tuple(t.to(DEVICE) for t in fp8.quantize_fp8(x, 32))
    if fmt in ("fp4", "fp4_ue8m0"):
        return tuple(t.to(DEVICE) for t in fp4.quantize(x, 16 if fmt == "fp4" else 32,
                                                         "e4m3" if fmt == "fp4" else "ue8m0"))
    return (x.to(DEVICE),)


def case(B=3, H=5, D=64, R=23, W=20, N=37, K=13, win_fmt="fp8", main_fmt="fp4", seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, D, generator=gen).to(DEVICE)
    win = stored(win_fmt, B, R, D, gen)
    main = stored(main_fmt, B, N, D, gen) if main_fmt else None
    positions = torch.tensor([5, 40, 61][:B], dtype=torch.long)
    swa_start = torch.tensor([0, 30, 0][:B], dtype=torch.long)  # row 1's window cut at 30, row 0's at position 0
    ids = torch.stack([torch.randperm(N, generator=gen)[:K].to(torch.int32) for _ in range(B)])
    ids[0, ::3] = -1  # empty slots
    ids[1, 2] = N + 4  # out of range: empty, never read
    ids[B - 1] = -1  # a row with no selected entry
    sink = torch.randn(H, generator=gen)
    return (q, win, win_fmt, positions.to(DEVICE), swa_start.to(DEVICE), W, main, main_fmt,
            ids.to(DEVICE) if main_fmt else None, sink.to(DEVICE))


@pytest.mark.parametrize("win_fmt,main_fmt", [("fp8", "fp4"), ("none", "none"), ("fp8", "fp8"),
                                              ("none", "fp4_ue8m0"), ("fp8", None)])
@pytest.mark.parametrize("num_splits,heads", [(1, None), (7, 2)])
def test_sparse_decode_equals_the_reference(win_fmt, main_fmt, num_splits, heads):
    """One split and all heads in a program; 7 splits and heads in groups of 2 (the last group short)."""
    args = case(win_fmt=win_fmt, main_fmt=main_fmt)
    want = sparse_decode_reference(*args)
    got = sparse_decode(*args, num_splits=num_splits, heads_per_program=heads)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_sparse_decode_writes_every_output(monkeypatch):
    """The output comes from a NaN-poisoned allocation: every element is written."""
    real_empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: real_empty_like(t, **kw).fill_(float("nan")))
    args = case(B=2, H=3, D=32, R=9, W=9, N=11, K=6, seed=3)
    got = sparse_decode(*args, num_splits=2, heads_per_program=2)
    assert not got.isnan().any()
    torch.testing.assert_close(got, sparse_decode_reference(*args), rtol=1e-5, atol=1e-6)


def test_sparse_decode_rejects_bad_input():
    args = list(case(B=2))
    with pytest.raises(ValueError, match="format"):
        sparse_decode(*args[:2], "fp16", *args[3:])
    with pytest.raises(ValueError, match="ids must be int32"):
        sparse_decode(*args[:8], args[8].long(), args[9])
    with pytest.raises(ValueError, match="window must be in"):
        sparse_decode(*args[:5], 99, *args[6:])
