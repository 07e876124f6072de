"""Proves the Triton sparse shared-KV attention (`kernels.sparse_attention`) equals its PyTorch references:

- forward: equal to the gather-based reference and to `model.csa2.attend` given the equivalent masks (window
  mask from positions, cmp_mask = one-hot of topk_idx), with the per-head sink, at awkward sizes (T not a multiple
  of the key block, H / D / K / E / W not powers of two, W not a multiple of the block, W > T, early tokens whose
  window starts before token 0, rows whose top-k slots are all empty);
- backward: dq, dkv_win, dkv_cmp (scatter-added over selected entries) and dsink equal autograd through the
  reference, also when the backward's scratch is split into many chunks of queries (windows straddling them);
- window-only use (kv_cmp None, or K = 0) works both ways;
- the optional head-summed top-k probabilities (the indexer's KL target) equal `attend`'s p_cmp summed over heads
  at the selected entries;
- every output element is written: outputs and scratch come from NaN-poisoned allocations;

The rest of what it proves: docs/testing.md#triton-sparse-attention
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is first imported: the kernels then run on the CPU

import importlib  # noqa: E402

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402

import kernels.sparse_attention as sa  # noqa: E402
import kernels.sparse_attention_bwd as sa_bwd  # noqa: E402
import kernels.sparse_attention_fwd as sa_fwd  # noqa: E402
from kernels import fp4, fp8  # noqa: E402
from model.csa2 import attend  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
if INTERPRET and not isinstance(sa_fwd.sparse_attn_fwd, interpreter.InterpretedFunction):
    # imported earlier without the interpreter: rebuild the kernels under it (the public module picks them up anew)
    sa_fwd = importlib.reload(sa_fwd)
    sa_bwd = importlib.reload(sa_bwd)
    sa = importlib.reload(sa)
DEVICE = "cpu" if INTERPRET else "cuda"

# (B, T, H, D, E, K, W)
CASES = [
    (1, 37, 5, 24, 19, 7, 8),
    (2, 15, 3, 16, 30, 13, 50),  # window longer than the sequence
    (2, 18, 4, 32, 9, 9, 5),  # K = E: every entry selectable
]


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """16-key blocks keep the interpreter fast and make every case span several blocks."""
    fwd = {"BLOCK_N": 16, "fwd": (4, 1)}
    bwd = {"BLOCK_N": 16, "probs": (4, 1), "dq": (4, 1), "dkv": (4, 1), "scratch_bytes": 1 << 30,
           "stacked_probs": True, "split_loads": True, "probs_block_n": 16,
           "dkv_overlap": False, "dkv_sm_share": 0.5}
    # the same dicts for every head count, so a test that patches one entry reaches every launch
    for name, cfg in (("FWD_CONFIG", fwd), ("FWD_CONFIG_FEW_HEADS", fwd), ("BWD_CONFIG", bwd),
                      ("BWD_CONFIG_FEW_HEADS", bwd)):
        monkeypatch.setattr(sa, name, cfg)


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
    return tuple(t.to(DEVICE) for t in (q, kv_win, kv_cmp, idx, sink))


def window_mask(T, W):
    p = torch.arange(T, device=DEVICE)
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


# (stacked_probs, split_loads, probs_block_n, dkv_overlap): the previous kernels (the default: none of the switches
# was faster on an H100), each switch alone, both, bwd_probs on half-width key blocks with either dot, the key-gradient launch as a persistent grid beside
# the next chunk (on the CPU: in order, one program looping over the chunk's queries)
SWITCHES = [(False, False, 16, False), (True, False, 16, False), (False, True, 16, False), (True, True, 16, False),
            (True, True, 8, False), (False, True, 8, False), (True, True, 16, True), (False, False, 16, True)]


@pytest.mark.parametrize("switches", SWITCHES)
@pytest.mark.parametrize("case", [CASES[0], (1, 21, 3, 32, 12, 9, 6)])
def test_backward_switches_match_reference(case, switches, monkeypatch, poison):
    """Every setting of the backward's switches gives autograd's gradients, at a padded D (24 in a 32-wide tile)
    and a full one."""
    for key, value in zip(("stacked_probs", "split_loads", "probs_block_n", "dkv_overlap"), switches):
        monkeypatch.setitem(sa.BWD_CONFIG, key, value)
    B, T, H, D, E, K, W = case
    q, kv_win, kv_cmp, idx, sink = make_inputs(*case, seed=4)
    inputs = [t.requires_grad_() for t in (q, kv_win, kv_cmp, sink)]
    out = sa.sparse_attention(q, kv_win, kv_cmp, idx, sink, W, impl="triton")
    g = torch.randn_like(out)
    want = grads(sa.sparse_attention_reference(q, kv_win, kv_cmp, idx, sink, W), inputs, g)
    for name, a, b in zip(("dq", "dkv_win", "dkv_cmp", "dsink"), grads(out, inputs, g), want):
        assert not a.isnan().any(), name
        torch.testing.assert_close(a, b, atol=5e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("heads", [2, 17])
def test_shipped_launch_configs_match_reference(heads, monkeypatch):
    """The launch configs as shipped, not the fixture's 16-key blocks: the few-heads config (128-key forward
    blocks) for a head tile of 16, the flagship's for a tile of 32; window and top-k rows longer than a 64-key
    block."""
    monkeypatch.undo()
    assert sa.launch_config("fwd", 16) is sa.FWD_CONFIG_FEW_HEADS and sa.launch_config("bwd", 32) is sa.BWD_CONFIG
    case = (1, 40, heads, 16, 80, 70, 70)  # B, T, H, D, E, K, W
    q, kv_win, kv_cmp, idx, sink = make_inputs(*case, seed=3)
    inputs = [t.requires_grad_() for t in (q, kv_win, kv_cmp, sink)]
    out = sa.sparse_attention(q, kv_win, kv_cmp, idx, sink, case[-1], impl="triton")
    want = sa.sparse_attention_reference(q, kv_win, kv_cmp, idx, sink, case[-1])
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)
    g = torch.randn_like(out)
    for name, a, b in zip(("dq", "dkv_win", "dkv_cmp", "dsink"), grads(out, inputs, g), grads(want, inputs, g)):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=1e-4, msg=name)


# (case, queries per chunk): 3 chunks, the last one partial; 6 chunks, windows (W = 20) reaching back over several
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("case,per_chunk", [((1, 11, 2, 16, 6, 3, 4), 4), ((1, 40, 2, 16, 6, 3, 20), 7)])
def test_backward_in_chunks_equals_one_chunk(case, per_chunk, overlap, monkeypatch):
    """Also with dkv_overlap: two scratch buffers taking turns (half the queries per chunk) and the persistent
    key-gradient grid."""
    monkeypatch.setitem(sa.BWD_CONFIG, "dkv_overlap", overlap)
    B, T, H, D, E, K, W = case
    q, kv_win, kv_cmp, idx, sink = make_inputs(*case, seed=2)
    inputs = [t.requires_grad_() for t in (q, kv_win, kv_cmp, sink)]
    out = sa.sparse_attention(q, kv_win, kv_cmp, idx, sink, W, impl="triton")
    g = torch.randn_like(out)
    whole = grads(out, inputs, g)
    # scratch (P and dS, fp32, NW = W rounded up to the 16-key block, + K slots) for per_chunk queries at a time
    monkeypatch.setitem(sa.BWD_CONFIG, "scratch_bytes", per_chunk * 2 * B * H * (triton.cdiv(W, 16) * 16 + K) * 4)
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


# ------------------------------------------------------------------------------------------------------------------
# Quantised inference-cache inputs: FP8 kv_win, FP4 kv_cmp
# ------------------------------------------------------------------------------------------------------------------
# (B, T, H, D, E, K, W): D = 96 pads the tiles (3 of 4 FP8 scale blocks, 48 of 64 code bytes), D = 64 fills them
QCASES = [
    (2, 15, 3, 96, 30, 13, 50),  # window longer than the sequence
    (1, 37, 5, 64, 19, 7, 8),
]
COMBOS = ["fp4_cmp", "fp8_win", "both"]


def quantised_inputs(case, combo, seed, dtype=torch.float32):
    """make_inputs with rows of magnitudes 1e-3 .. 10 (small rows get subnormal e4m3 scales), some rows all zero, and
    the chosen KV quantised; also returns the dequantised KV in q's dtype, what the reference should see."""
    q, kv_win, kv_cmp, idx, sink = make_inputs(*case, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    for kv in (kv_win, kv_cmp):
        kv.mul_((10.0 ** (4 * torch.rand(*kv.shape[:2], 1, generator=g) - 3)).to(DEVICE))
        kv[:, 1] = 0.0
    win = fp8.quantize_fp8(kv_win, 32) if combo in ("fp8_win", "both") else kv_win.to(dtype)
    cmp = fp4.quantize(kv_cmp, 16, "e4m3") if combo in ("fp4_cmp", "both") else kv_cmp.to(dtype)
    win_deq = fp8.dequantize_fp8(*win, 32).to(dtype) if isinstance(win, tuple) else win
    cmp_deq = fp4.dequantize(*cmp, 16).to(dtype) if isinstance(cmp, tuple) else cmp
    return q.to(dtype), win, cmp, idx, sink, win_deq, cmp_deq


@pytest.mark.parametrize("combo", COMBOS)
@pytest.mark.parametrize("case", QCASES)
def test_quantised_forward_matches_reference_on_dequantised(case, combo, poison):
    B, T, H, D, E, K, W = case
    q, win, cmp, idx, sink, win_deq, cmp_deq = quantised_inputs(case, combo, seed=7)
    out = sa.sparse_attention(q, win, cmp, idx, sink, W, impl="triton")
    assert not out.isnan().any()
    want = sa.sparse_attention_reference(q, win_deq, cmp_deq, idx, sink, W)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-5)
    # the Triton path dequantises (bit-exactly) and then runs the plain kernel
    torch.testing.assert_close(out, sa.sparse_attention(q, win_deq, cmp_deq, idx, sink, W, impl="triton"),
                               atol=0, rtol=0)
    # the reference path dequantises first and then is exactly the plain reference
    torch.testing.assert_close(sa.sparse_attention(q, win, cmp, idx, sink, W), want, atol=0, rtol=0)


def test_quantised_bf16_matches_reference_on_dequantised(poison):
    """bf16 q, both KV quantised (the serving case): the dequantised KV is exact in bf16, so the kernel equals its
    own plain path on the dequantised bf16 KV, and the reference within bf16 rounding."""
    case = QCASES[0]
    B, T, H, D, E, K, W = case
    q, win, cmp, idx, sink, win_deq, cmp_deq = quantised_inputs(case, "both", seed=8, dtype=torch.bfloat16)
    out = sa.sparse_attention(q, win, cmp, idx, sink, W, impl="triton")
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    plain = sa.sparse_attention(q, win_deq, cmp_deq, idx, sink, W, impl="triton")
    torch.testing.assert_close(out, plain, atol=0, rtol=0)
    ref = sa.sparse_attention_reference(q.float(), win_deq.float(), cmp_deq.float(), idx, sink, W)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_quantised_topk_probs_and_window_only(poison):
    case = QCASES[1]
    B, T, H, D, E, K, W = case
    q, win, cmp, idx, sink, win_deq, cmp_deq = quantised_inputs(case, "both", seed=9)
    out, probs = sa.sparse_attention(q, win, cmp, idx, sink, W, return_topk_probs=True, impl="triton")
    want, want_probs = sa.sparse_attention_reference(q, win_deq, cmp_deq, idx, sink, W, return_topk_probs=True)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(probs, want_probs, atol=1e-6, rtol=1e-5)
    # window only: no kv_cmp at all
    out = sa.sparse_attention(q, win, None, None, sink, W, impl="triton")
    torch.testing.assert_close(out, sa.sparse_attention_reference(q, win_deq, None, None, sink, W),
                               atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_no_gradient_through_quantised_inputs(impl):
    case = (1, 9, 2, 32, 6, 3, 4)
    B, T, H, D, E, K, W = case
    q, win, cmp, idx, sink, win_deq, cmp_deq = quantised_inputs(case, "both", seed=10)
    q.requires_grad_()
    out = sa.sparse_attention(q, win, cmp, idx, sink, W, impl=impl)  # the forward itself is fine
    with pytest.raises(RuntimeError, match="no backward through quantised"):
        out.sum().backward()
    with torch.no_grad():
        assert not sa.sparse_attention(q, win, cmp, idx, sink, W, impl=impl).requires_grad
    # a plain kv_cmp asking for a gradient next to a quantised kv_win gets the same answer
    out = sa.sparse_attention(q.detach(), win, cmp_deq.requires_grad_(), idx, sink, W, impl=impl)
    with pytest.raises(RuntimeError, match="no backward through quantised"):
        torch.autograd.grad(out.sum(), cmp_deq)
    values = win[0].detach().requires_grad_()  # fp8 tensors can require grad; nothing could reach them
    with pytest.raises(RuntimeError, match="quantised kv_win requires grad"):
        sa.sparse_attention(q, (values, win[1]), cmp, idx, sink, W, impl=impl)


def test_bad_quantised_inputs_raise():
    case = (1, 8, 2, 32, 5, 3, 4)
    q, win, cmp, idx, sink, _, _ = quantised_inputs(case, "both", seed=11)
    call = sa.sparse_attention
    with pytest.raises(TypeError, match="kv_win must be an FP8"):
        call(q, cmp, None, None, sink, 4, impl="triton")  # FP4 where the FP8 window belongs
    with pytest.raises(TypeError, match="kv_cmp must be an FP4"):
        call(q, win, fp4.quantize(q[:, :, 0], 32, "ue8m0"), idx, sink, 4, impl="triton")  # power-of-two scales
    with pytest.raises(TypeError, match="kv_cmp must be a tensor or an FP4"):
        call(q, win, list(cmp), idx, sink, 4, impl="triton")
    with pytest.raises(ValueError, match=r"FP4 kv_cmp must be values \(1, 5, 16\) and scales \(1, 5, 2\)"):
        call(q, win, (cmp[0], cmp[1][..., :1].contiguous()), idx, sink, 4, impl="triton")
    with pytest.raises(ValueError, match=r"FP8 kv_win must be values \(1, 8, 32\)"):
        call(q, (win[0][:, :4].contiguous(), win[1][:, :4].contiguous()), cmp, idx, sink, 4, impl="triton")
    q48 = torch.randn(1, 8, 2, 48, device=DEVICE)
    with pytest.raises(ValueError, match="FP8 kv_win needs D divisible by its scale block 32, got D=48"):
        call(q48, fp8.quantize_fp8(torch.randn(1, 8, 48, device=DEVICE), 16), None, None, sink, 4, impl="triton")
    with pytest.raises(ValueError, match="kv_cmp scales must be contiguous"):
        strided = torch.empty(1, 5, 4, dtype=torch.float8_e4m3fn, device=DEVICE)[..., ::2]
        strided.copy_(cmp[1])
        call(q, win, (cmp[0], strided), idx, sink, 4, impl="triton")
