"""Proves the Triton indexer kernels (`kernels.indexer`, run by the Triton CPU interpreter) equal their PyTorch
references and the model's own indexer functions (`model.csa2`):

- dense scores: equal to `model.csa2.index_scores` masked by `visible_mask` (ratio 1 and 2), and to the reference
  with a query offset (a chunk of queries deep in the sequence), at awkward sizes (T, E not multiples of the tiles,
  Hi = 3, Di = 24); invisible scores are exactly -inf;
- their backward: dq, dw, dk equal autograd through the reference, and gradients arriving at invisible positions
  are ignored;
- candidate pool: the block ids, as an entry mask, equal `model.csa2.candidate_pool` (block max, newest block
  forced, top blocks with a finite score), also when there are fewer blocks than requested;

The rest of what it proves: docs/testing.md#triton-indexer-kernels
"""

from __future__ import annotations

import os

import importlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is first imported: the kernels then run on the CPU
import triton.runtime.interpreter as interpreter  # noqa: E402

import kernels.indexer as ix  # noqa: E402
import kernels.sparse_attention as sa  # noqa: E402
from model import csa2  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
if INTERPRET and not isinstance(ix._scores_fwd, interpreter.InterpretedFunction):
    # imported earlier without the interpreter: rebuild the kernels (and the dot helper they share) under it
    sa = importlib.reload(sa)
    ix = importlib.reload(ix)
topk_to_mask = sa.topk_to_mask

NEG_INF = float("-inf")


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """Small tiles keep the interpreter fast and make every case span several tiles."""
    tiles = {"BLOCK_T": 16, "BLOCK_E": 16, "num_warps": 4, "num_stages": 1}
    monkeypatch.setattr(ix, "SCORES_CONFIG", {"fwd": tiles, "bwd_qw": tiles, "bwd_k": tiles})
    pool = {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    monkeypatch.setattr(ix, "POOL_CONFIG", {"fwd": pool, "bwd": pool})


@pytest.fixture
def poison(monkeypatch):
    """torch.empty / empty_like return NaN-filled float tensors, so an element a kernel forgets shows up as NaN."""
    real_empty, real_like = torch.empty, torch.empty_like

    def fill(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(real_like(*a, **k)))


def make_inputs(B, T, Hi, Di, E, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, Hi, Di, generator=g).to(DEVICE), torch.randn(B, T, Hi, generator=g).to(DEVICE),
            torch.randn(B, E, Di, generator=g).to(DEVICE))


def assert_scores_equal(a, b):
    """Same -inf pattern, finite values within fp32 rounding."""
    assert not a.isnan().any()
    assert torch.equal(a == NEG_INF, b == NEG_INF)
    torch.testing.assert_close(a.nan_to_num(neginf=0.0), b.nan_to_num(neginf=0.0), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("ratio", [1, 2])
def test_scores_match_model(ratio, poison):
    B, T, Hi, Di = 2, 37, 3, 24
    E = T // ratio
    q, w, k = make_inputs(B, T, Hi, Di, E)
    got = ix.index_scores(q, w, k, ratio, impl="triton")
    want = csa2.index_scores(q, w, k).masked_fill(~csa2.visible_mask(T, E, ratio, DEVICE), NEG_INF)
    assert_scores_equal(got, want)


def test_scores_with_query_offset(poison):
    B, T, Hi, Di, ratio, offset = 1, 19, 2, 16, 2, 23
    E = (T + offset) // ratio + 3  # a few entries no query of the chunk can see yet
    q, w, k = make_inputs(B, T, Hi, Di, E, seed=1)
    got = ix.index_scores(q, w, k, ratio, q_offset=offset, impl="triton")
    assert_scores_equal(got, ix.index_scores_reference(q, w, k, ratio, q_offset=offset))
    # the first query (absolute position 23) sees entries 0..11 at ratio 2
    assert (got[0, 0, :12] > NEG_INF).all() and (got[0, 0, 12:] == NEG_INF).all()


@pytest.mark.parametrize("ratio,offset", [(1, 0), (2, 7)])
def test_scores_backward(ratio, offset, poison):
    B, T, Hi, Di = 2, 29, 3, 24
    E = (T + offset) // ratio
    inputs = [t.requires_grad_() for t in make_inputs(B, T, Hi, Di, E, seed=2)]
    out = ix.index_scores(*inputs, ratio, q_offset=offset, impl="triton")
    g = torch.randn_like(out)  # nonzero at the -inf positions too: those must be ignored
    got = torch.autograd.grad(out, inputs, g)
    want = torch.autograd.grad(ix.index_scores_reference(*inputs, ratio, q_offset=offset), inputs, g)
    for name, a, b in zip(("dq", "dw", "dk"), got, want):
        assert not a.isnan().any(), name
        torch.testing.assert_close(a, b, atol=5e-5, rtol=1e-4, msg=name)


def test_bf16_scores_and_gradients():
    """bf16 inputs, as in training: fp32 scores within bf16 input rounding of the fp32 reference on the same values."""
    B, T, Hi, Di, ratio = 1, 21, 2, 32, 1
    q, w, k = make_inputs(B, T, Hi, Di, T, seed=9)
    q16, k16 = q.bfloat16().requires_grad_(), k.bfloat16().requires_grad_()
    w = w.requires_grad_()
    got = ix.index_scores(q16, w, k16, ratio, impl="triton")
    ref_in = [q16.detach().float().requires_grad_(), w.detach().clone().requires_grad_(),
              k16.detach().float().requires_grad_()]
    want = ix.index_scores_reference(*ref_in, ratio)
    assert torch.equal(got == NEG_INF, want == NEG_INF)
    torch.testing.assert_close(got.nan_to_num(neginf=0.0), want.nan_to_num(neginf=0.0), atol=1e-4, rtol=1e-4)
    g = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, (q16, w, k16), g), torch.autograd.grad(want, ref_in, g)):
        # dq, dk come back in bf16 (their accumulation is fp32; the dd operand is rounded to bf16 for the dot)
        torch.testing.assert_close(a.float(), b, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("block_size,topk_blocks", [(4, 3), (8, 100)])
def test_candidate_pool_matches_model(block_size, topk_blocks):
    B, T, Hi, Di, ratio = 2, 45, 2, 16, 1
    q, w, k = make_inputs(B, T, Hi, Di, T, seed=3)
    scores = ix.index_scores_reference(q, w, k, ratio)
    # Two heads leave exact ties (0 where both ReLUs are 0), which torch.topk and the Triton top-k break differently
    # (both valid pools); a small jitter makes the pool unique. -inf (invisible) stays -inf.
    scores = scores + 1e-3 * torch.rand(scores.shape, generator=torch.Generator().manual_seed(0)).to(scores.device)
    want = csa2.candidate_pool(scores, ratio, block_size, topk_blocks)
    for impl in ("triton", "reference"):
        pool = ix.candidate_pool(scores, ratio, block_size, topk_blocks, impl=impl)
        assert pool.dtype == torch.int32 and pool.shape[-1] == min(topk_blocks, -(-T // block_size))
        assert torch.equal(ix.pool_to_mask(pool, T, block_size), want), impl


def test_candidate_pool_with_query_offset():
    B, T, E, ratio, offset = 1, 12, 30, 2, 40
    g = torch.Generator().manual_seed(4)
    scores = torch.randn(B, T, E, generator=g).to(DEVICE).masked_fill(~ix._visible(T, E, ratio, offset, DEVICE),
                                                                      NEG_INF)
    got = ix.candidate_pool(scores, ratio, 4, 2, q_offset=offset, impl="triton")
    want = ix.candidate_pool_reference(scores, ratio, 4, 2, q_offset=offset)
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)
    newest_block = ((torch.arange(T, device=DEVICE) + offset + 1) // ratio - 1) // 4
    assert (got == newest_block[None, :, None]).any(-1).all()  # the newest block is always in the pool


def pool_case(seed=5):
    B, T, Hi, Di, ratio, bs = 2, 33, 3, 16, 1, 4
    E = T + 2  # entries past the last query: never visible
    q, w, k = make_inputs(B, T, Hi, Di, E, seed=seed)
    dense = ix.index_scores_reference(q, w, k, ratio)
    pool = ix.candidate_pool_reference(dense, ratio, bs, 3)
    pool[0, 5, -1] = -1  # an empty pool slot
    return q, w, k, pool, dense, ratio, bs


def test_pool_scores_match_references(poison):
    q, w, k, pool, dense, ratio, bs = pool_case()
    got = ix.index_scores_pool(q, w, k, pool, ratio, bs, impl="triton")
    assert_scores_equal(got, ix.index_scores_pool_reference(q, w, k, pool, ratio, bs))
    # each slot holds the dense score of its entry (or -inf)
    ent = ix._pool_entries(pool, bs)
    from_dense = dense.gather(-1, ent.clamp(0, dense.shape[-1] - 1)).masked_fill(ent < 0, NEG_INF)
    assert_scores_equal(got, from_dense)


def test_pool_scores_backward(poison):
    q, w, k, pool, _, ratio, bs = pool_case(seed=6)
    inputs = [t.requires_grad_() for t in (q, w, k)]
    out = ix.index_scores_pool(*inputs, pool, ratio, bs, impl="triton")
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, inputs, g)
    want = torch.autograd.grad(ix.index_scores_pool_reference(*inputs, pool, ratio, bs), inputs, g)
    for name, a, b in zip(("dq", "dw", "dk"), got, want):
        assert not a.isnan().any(), name
        torch.testing.assert_close(a, b, atol=5e-5, rtol=1e-4, msg=name)


def test_pool_topk_selects_the_reindex_domain():
    q, w, k, pool, dense, ratio, bs = pool_case(seed=7)
    E = k.shape[1]
    got = ix.select_topk(ix.index_scores_pool(q, w, k, pool, ratio, bs, impl="triton"), 5, pool=pool,
                         block_size=bs)
    domain = ix.pool_to_mask(pool, E, bs) & csa2.visible_mask(q.shape[1], E, ratio, DEVICE)
    want = csa2.select_topk(dense.masked_fill(~domain, NEG_INF), 5)
    assert torch.equal(topk_to_mask(got, E), want)


def test_select_topk_matches_model():
    B, T, Hi, Di, ratio = 1, 20, 2, 16, 2
    q, w, k = make_inputs(B, T, Hi, Di, T // ratio, seed=8)
    scores = ix.index_scores(q, w, k, ratio, impl="triton")
    # the scores tie (relu zeros): the kernel and the model both keep the lowest ids among ties at the 4th value
    idx = ix.select_topk(scores, 4, impl="triton")
    assert idx.shape == (B, T, 4) and idx.dtype == torch.int32
    assert torch.equal(topk_to_mask(idx, T // ratio), csa2.select_topk(scores, 4))
    assert (idx[0, 0] == -1).all()  # query 0 sees no entry at ratio 2
    assert (idx[0, 3] >= 0).sum() == 2  # query 3 sees entries 0 and 1 only


def test_bad_inputs_raise():
    q, w, k = make_inputs(1, 8, 2, 16, 8)
    with pytest.raises(ValueError, match="impl"):
        ix.index_scores(q, w, k, 1, impl="cuda")
    with pytest.raises(ValueError, match="w must be fp32"):
        ix.index_scores(q, w.double(), k, 1, impl="triton")
    with pytest.raises(ValueError, match="k must be"):
        ix.index_scores(q, w, k[..., :8], 1, impl="triton")
    with pytest.raises(ValueError, match="ratio"):
        ix.index_scores(q, w, k, 0, impl="triton")
    with pytest.raises(ValueError, match="q_offset"):
        ix.index_scores(q, w, k, 1, q_offset=-1, impl="triton")
    with pytest.raises(ValueError, match="contiguous"):
        ix.index_scores(q[..., ::2], w, k[..., ::2].contiguous(), 1, impl="triton")
    with pytest.raises(ValueError, match="pool must be int32"):
        ix.index_scores_pool(q, w, k, torch.zeros(1, 8, 2, dtype=torch.int64), 1, 4, impl="triton")
    with pytest.raises(ValueError, match="power of two"):
        ix.candidate_pool(torch.zeros(1, 8, 8), 1, 3, 2, impl="triton")
