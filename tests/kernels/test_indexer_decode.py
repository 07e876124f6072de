"""Proves the decode indexer scoring (`kernels.indexer_decode`) equals its plain-PyTorch reference on the same stored
key bytes, to fp32 rounding: FP4 (UE8M0) keys dequantised in the kernel and raw keys, dense over every slot and
restricted to a pool (empty blocks, a block past the stored entries, visibility cutting a block), per-row positions,
awkward sizes, NaN-poisoned outputs; and that the top-k over the scores picks the reference `select_topk`'s entries,
ties (ReLU zeros) to the lowest entry ids, also through a pool sorted by block id."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports the kernels

import pytest  # noqa: E402

from kernels import fp4  # noqa: E402
from kernels.indexer_decode import index_scores_decode, index_scores_decode_reference, select_decode_topk  # noqa: E402
from model.csa2 import select_topk  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def case(B=3, Hi=5, Di=64, N=45, fmt="fp4_ue8m0", ratio=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = fp4.fake_quant(torch.randn(B, Hi, Di, generator=gen), 32, "ue8m0")
    w = torch.randn(B, Hi, generator=gen)
    k = torch.randn(B, N, Di, generator=gen)
    keys = fp4.quantize(k, 32, "ue8m0") if fmt == "fp4_ue8m0" else (k,)
    positions = torch.tensor([9, 2 * N + 5, 40][:B])  # row 0 sees 5 entries, row 1 all of them
    return q.to(DEVICE), w.to(DEVICE), tuple(t.to(DEVICE) for t in keys), fmt, positions.to(DEVICE), ratio


@pytest.mark.parametrize("fmt", ["fp4_ue8m0", "none"])
def test_dense_scores_equal_the_reference(fmt):
    args = case(fmt=fmt)
    want = index_scores_decode_reference(*args)
    got = index_scores_decode(*args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert (got[0, 5:] == float("-inf")).all() and (got[0, :5] > float("-inf")).all()


def test_pool_scores_equal_the_reference():
    args = case()
    pool = torch.tensor([[0, 1, 7, -1], [2, 5, 11, 12], [-1, -1, 3, 4]], dtype=torch.int32, device=DEVICE)
    want = index_scores_decode_reference(*args, pool=pool, block_size=4)
    got = index_scores_decode(*args, pool=pool, block_size=4)
    assert got.shape == (3, 16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert (got[1, 12:] == float("-inf")).all()  # block 12 holds entries 48.. past the 45 stored


def test_scores_write_every_output(monkeypatch):
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: real_empty(*a, **kw).fill_(float("nan")))
    got = index_scores_decode(*case(B=2, Hi=3, Di=32, N=70))
    assert not got.isnan().any()


def test_topk_picks_the_reference_entries_with_ties_to_the_lowest_ids():
    """Scores with ties at the k-th value (zeros, as the ReLU makes them): dense, and through a sorted pool."""
    s = torch.tensor([[0.0, 3.0, 0.0, float("-inf"), 0.0, 2.0, 0.0, 0.0],
                      [1.0, float("-inf"), float("-inf"), float("-inf"), 0.5, float("-inf"), float("-inf"),
                       float("-inf")]], device=DEVICE)
    ids = select_decode_topk(s, 4)
    want = select_topk(s[:, None], 4)[:, 0]
    for b in range(2):
        got = sorted(i for i in ids[b].tolist() if i >= 0)
        assert got == want[b].nonzero().flatten().tolist()
    # pool blocks [1, 3] of 2 entries sorted by id: slots (2, 3, 6, 7) -> the lowest tied entries first
    pool = torch.tensor([[1, 3], [0, 2]], dtype=torch.int32, device=DEVICE)
    slot_scores = torch.stack([s[b, (pool[b, :, None] * 2 + torch.arange(2, device=DEVICE)).flatten()]
                               for b in range(2)])
    ids = select_decode_topk(slot_scores, 2, pool=pool, block_size=2)
    assert sorted(ids[0].tolist()) == [2, 6] and sorted(ids[1].tolist()) == [0, 4]
