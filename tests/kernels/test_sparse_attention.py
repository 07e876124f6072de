"""Proves the Triton sparse shared-KV attention (`kernels.sparse_attention`, run by the Triton CPU interpreter) equals
its PyTorch references:

- forward: equal to the gather-based reference and to `model.attention.attend` given the equivalent masks (window
  mask from positions, cmp_mask = one-hot of topk_idx), with the per-head sink, at awkward sizes (T not a multiple
  of the key block, H / D / K / E / W not powers of two, W not a multiple of the block, W > T, early tokens whose
  window starts before token 0, rows whose top-k slots are all empty);
- backward: dq, dkv_win, dkv_cmp (scatter-added over selected entries) and dsink equal autograd through the
  reference, also when the backward's scratch is split into many chunks of queries;
- window-only use (kv_cmp None, or K = 0) works both ways;
- the optional head-summed top-k probabilities (the indexer's KL target) equal `attend`'s p_cmp summed over heads
  at the selected entries;
- every output element is written: outputs and scratch come from NaN-poisoned allocations;
- bad inputs raise errors that name the problem.
The same kernels were run on an H200 in bf16 (see the kernels report); CUDA cannot run here, the interpreter can.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is first imported: the kernels then run on the CPU

import importlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402

import kernels.sparse_attention as sa  # noqa: E402
from model.attention import attend  # noqa: E402

if not isinstance(sa._sparse_attn_fwd, interpreter.InterpretedFunction):
    sa = importlib.reload(sa)  # imported earlier without the interpreter: rebuild the kernels under it

# (B, T, H, D, E, K, W)
CASES = [
    (1, 37, 5, 24, 19, 7, 8),
    (2, 15, 3, 16, 30, 13, 50),  # window longer than the sequence
    (2, 18, 4, 32, 9, 9, 5),  # K = E: every entry selectable
]


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """16-key blocks keep the interpreter fast and make every case span several blocks."""
    monkeypatch.setattr(sa, "FWD_CONFIG", {"BLOCK_N": 16, "fwd": (4, 1)})
    monkeypatch.setattr(sa, "BWD_CONFIG", {"BLOCK_N": 16, "probs": (4, 1), "dq": (4, 1), "dkv": (4, 1),
                                           "scratch_bytes": 1 << 30})


@pytest.fixture
def poison(monkeypatch):
    """torch.empty / empty_like return NaN-filled float tensors, so an element a kernel forgets shows up as NaN."""
    real_empty, real_like = torch.empty, torch.empty_like

    def fill(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(real_like(*a, **k)))


def make_inputs(B, T, H, D, E, K, W, seed=0, empty_frac=0.3):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g)
    kv_win = torch.randn(B, T, D, generator=g)
    kv_cmp = torch.randn(B, E, D, generator=g)
    sink = torch.randn(H, generator=g)
    # distinct entries per row, some slots empty, and the first rows fully empty
    idx = torch.argsort(torch.rand(B, T, E, generator=g), dim=-1)[..., :K].int()
    idx[torch.rand(B, T, K, generator=g) < empty_frac] = -1
    idx[:, :2] = -1
    return q, kv_win, kv_cmp, idx, sink


def window_mask(T, W):
    p = torch.arange(T)
    return (p[None, :] <= p[:, None]) & (p[None, :] > p[:, None] - W)


def grads(out, inputs, g):
    return torch.autograd.grad(out, inputs, g)


@pytest.mark.parametrize("case", CASES)
def test_forward_matches_reference_and_attend(case, poison):
    B, T, H, D, E, K, W = case
    q, kv_win, kv_cmp, idx, sink = make_inputs(*case)
    out = sa.sparse_attention(q, kv_win, kv_cmp, idx, sink, W, impl="triton")
    assert not out.isnan().any()
    ref = sa.sparse_attention_reference(q, kv_win, kv_cmp, idx, sink, W)
    model_out, _ = attend(q, kv_win, kv_cmp, window_mask(T, W), sa.topk_to_mask(idx, E), sink)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(out, model_out, atol=2e-5, rtol=1e-5)


def test_topk_probs_are_attends_head_summed_probabilities(poison):
    B, T, H, D, E, K, W = CASES[2]
    q, kv_win, kv_cmp, idx, sink = make_inputs(B, T, H, D, E, K, W, seed=6)
    _, p_cmp = attend(q, kv_win, kv_cmp, window_mask(T, W), sa.topk_to_mask(idx, E), sink)  # [B, H, T, E]
    want = p_cmp.sum(1).gather(-1, idx.clamp(min=0).long()).masked_fill(idx < 0, 0.0)  # [B, T, K]
    for impl in ("triton", "reference"):
        out, probs = sa.sparse_attention(q, kv_win, kv_cmp, idx, sink, W, return_topk_probs=True, impl=impl)
        assert not probs.requires_grad
        torch.testing.assert_close(probs, want, atol=1e-6, rtol=1e-5, msg=impl)
        torch.testing.assert_close(out, sa.sparse_attention(q, kv_win, kv_cmp, idx, sink, W, impl=impl))


@pytest.mark.parametrize("case", CASES[:2])
def test_backward_matches_reference(case, poison):
    B, T, H, D, E, K, W = case
    q, kv_win, kv_cmp, idx, sink = make_inputs(*case, seed=1)
    inputs = [t.requires_grad_() for t in (q, kv_win, kv_cmp, sink)]
    out = sa.sparse_attention(q, kv_win, kv_cmp, idx, sink, W, impl="triton")
    g = torch.randn_like(out)
    got = grads(out, inputs, g)
    want = grads(sa.sparse_attention_reference(q, kv_win, kv_cmp, idx, sink, W), inputs, g)
    for name, a, b in zip(("dq", "dkv_win", "dkv_cmp", "dsink"), got, want):
        assert not a.isnan().any(), name
        torch.testing.assert_close(a, b, atol=5e-5, rtol=1e-4, msg=name)
    # entries no query selected get exactly zero gradient
    unused = ~sa.topk_to_mask(idx, E).any(1)  # [B, E]
    assert (got[2][unused] == 0).all()


def test_backward_in_chunks_equals_one_chunk(monkeypatch):
    case = (1, 11, 2, 16, 6, 3, 4)
    B, T, H, D, E, K, W = case
    q, kv_win, kv_cmp, idx, sink = make_inputs(*case, seed=2)
    inputs = [t.requires_grad_() for t in (q, kv_win, kv_cmp, sink)]
    out = sa.sparse_attention(q, kv_win, kv_cmp, idx, sink, W, impl="triton")
    g = torch.randn_like(out)
    whole = grads(out, inputs, g)
    # scratch (P and dS, fp32, NW = 16 window slots + K) for 4 queries at a time: 3 chunks, the last one partial
    monkeypatch.setitem(sa.BWD_CONFIG, "scratch_bytes", 4 * 2 * B * H * (16 + K) * 4)
    chunked = grads(sa.sparse_attention(q, kv_win, kv_cmp, idx, sink, W, impl="triton"), inputs, g)
    for a, b in zip(chunked, whole):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("variant", ["no_kv_cmp", "k_zero"])
def test_window_only(variant, poison):
    B, T, H, D, W = 2, 14, 3, 16, 6
    q, kv_win, kv_cmp, idx, sink = make_inputs(B, T, H, D, 5, 3, W, seed=3)
    if variant == "no_kv_cmp":
        kv_cmp = idx = None
    else:
        idx = idx[..., :0].contiguous()
    inputs = [t.requires_grad_() for t in (q, kv_win, sink)]
    out = sa.sparse_attention(q, kv_win, kv_cmp, idx, sink, W, impl="triton")
    model_out, _ = attend(q, kv_win, None, window_mask(T, W), None, sink)
    torch.testing.assert_close(out, model_out, atol=2e-5, rtol=1e-5)
    g = torch.randn_like(out)
    for a, b in zip(grads(out, inputs, g), grads(model_out, inputs, g)):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=1e-4)


def test_bf16_matches_fp32_reference():
    """bf16 inputs, as in training (fp32 softmax inside): within bf16 rounding of the fp32 reference."""
    B, T, H, D, E, K, W = 1, 19, 3, 32, 11, 5, 6
    q, kv_win, kv_cmp, idx, sink = make_inputs(B, T, H, D, E, K, W, seed=5)
    low = [t.bfloat16().requires_grad_() for t in (q, kv_win, kv_cmp)] + [sink.requires_grad_()]
    out = sa.sparse_attention(low[0], low[1], low[2], idx, low[3], W, impl="triton")
    assert out.dtype == torch.bfloat16
    ref_in = [t.detach().float().requires_grad_() for t in low]
    ref = sa.sparse_attention_reference(ref_in[0], ref_in[1], ref_in[2], idx, ref_in[3], W)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    g = torch.randn_like(ref)
    for a, b in zip(grads(out, low, g.bfloat16()), grads(ref, ref_in, g)):
        torch.testing.assert_close(a.float(), b, atol=5e-2, rtol=5e-2)


def test_empty_topk_rows_attend_to_the_window_only():
    B, T, H, D, E, K, W = 1, 20, 2, 16, 10, 4, 4
    q, kv_win, kv_cmp, idx, sink = make_inputs(B, T, H, D, E, K, W, seed=4)
    idx[:, 5:9] = -1
    out = sa.sparse_attention(q, kv_win, kv_cmp, idx, sink, W, impl="triton")
    win_only = sa.sparse_attention(q, kv_win, None, None, sink, W, impl="triton")
    torch.testing.assert_close(out[:, 5:9], win_only[:, 5:9], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(out[:, 10:], win_only[:, 10:])


def test_topk_to_mask():
    idx = torch.tensor([[[2, -1, 0], [-1, -1, -1]]], dtype=torch.int32)
    want = torch.tensor([[[True, False, True, False], [False, False, False, False]]])
    assert torch.equal(sa.topk_to_mask(idx, 4), want)


def test_bad_inputs_raise():
    q, kv_win, kv_cmp, idx, sink = make_inputs(1, 8, 2, 16, 5, 3, 4)
    call = sa.sparse_attention
    with pytest.raises(ValueError, match="impl"):
        call(q, kv_win, kv_cmp, idx, sink, 4, impl="cuda")
    with pytest.raises(ValueError, match="q must be"):
        call(q[0], kv_win, kv_cmp, idx, sink, 4, impl="triton")
    with pytest.raises(ValueError, match="kv_win must be"):
        call(q, kv_win[:, :4], kv_cmp, idx, sink, 4, impl="triton")
    with pytest.raises(TypeError, match="topk_idx must be int32"):
        call(q, kv_win, kv_cmp, idx.long(), sink, 4, impl="triton")
    with pytest.raises(ValueError, match="sink must be fp32"):
        call(q, kv_win, kv_cmp, idx, sink.half(), 4, impl="triton")
    with pytest.raises(ValueError, match="window"):
        call(q, kv_win, kv_cmp, idx, sink, 0, impl="triton")
    with pytest.raises(TypeError, match="kv_cmp must have q's dtype"):
        call(q, kv_win, kv_cmp.double(), idx, sink, 4, impl="triton")
    with pytest.raises(ValueError, match="contiguous"):
        call(q.transpose(1, 2).contiguous().transpose(1, 2), kv_win, kv_cmp, idx, sink, 4, impl="triton")
