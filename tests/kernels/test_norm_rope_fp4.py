"""Proves the fused RMSNorm + RoPE + block-quantisation kernels (kernels/norm_rope_fp4.py) compute the model's three
passes (model.common.RMSNorm, model.rope.apply_rope, kernels.fp4 / kernels.fp8 fake-quant or quantise):

- forward, bit for bit: the fake-quantised rows and the pre-RoPE normed rows equal the reference composition for
  bf16, fp16 and fp32 rows, every site format (FP4 e4m3/16 main KV, FP4 ue8m0/32 indexer, FP8 SWA KV, none), with
  [B, T, D] rows and [B, T, H, D] heads sharing a token's tables, on rows whose sum of squares is exact in any order
  (the one rounding the kernel does not reproduce is the order of that D-term fp32 sum, see the kernel's docstring);
- on any other rows the normed output is within one rounding of x's dtype of the reference and everything after
  it (RoPE, quantiser) is bit-exact given it; without a norm (indexer queries) any input is bit-exact, including
  blocks built for the quantisers' corner cases (zeros, -0, exact grid ties, 40 binades, e4m3 scale round-down);
- the inference record (FP4 codes + e4m3/ue8m0 scales, FP8 values + scales) equals kernels.fp4.quantize /
  kernels.fp8.quantize_fp8 of the reference's rotated rows;

The rest of what it proves: docs/testing.md#fused-rmsnorm-rope-and-quantisation-kernels
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports the kernels

from kernels import fp4, fp8  # noqa: E402
from kernels import norm_rope_fp4 as nr  # noqa: E402
from model.common import RMSNorm  # noqa: E402
from model.rope import apply_rope  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
QUANTS = [None, "fp4", "fp4_ue8m0", "fp8"]
RPP = 32  # rows per program in most tests: the interpreter's cost is per program; the default has its own test


@pytest.fixture
def poisoned(monkeypatch):
    """Every torch.empty / empty_like returns NaN-filled floats and 0x88-filled integers (never written by the
    quantisers), so an element a kernel forgets to write cannot match the reference."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() and t.element_size() == 1:  # fp8 storage: 0xFF is NaN in e4m3fn and e8m0fnu
            t.view(torch.uint8).fill_(0xFF)
            return t
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(0x88 if t.dtype == torch.uint8 else -77)

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(real_empty_like(*a, **k)))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _assert_same_bits(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    diff = (_bits(a) != _bits(b)).nonzero()
    assert diff.numel() == 0, f"{what}: {diff.shape[0]} elements differ, first at {diff[0].tolist()}: " \
                              f"{a[tuple(diff[0])]} vs {b[tuple(diff[0])]}"


def _exact_rows(shape, seed: int, binades: int = 20) -> torch.Tensor:
    """Rows whose fp32 sum of squares is exact in any order: integers |m| <= 15 times 2^(0..2) times a per-row power
    of two in [2^-binades, 2^binades) (every partial sum fits fp32's 24 bits), so the reference's and the kernel's
    statistics agree to the bit and the whole forward can be compared bitwise. The norm's weight and rstd make y
    generic."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randint(-15, 16, shape, generator=g).double()
    e = torch.randint(0, 3, shape, generator=g) + torch.randint(-binades, binades, (*shape[:-1], 1), generator=g)
    return (m * torch.exp2(e.double())).to(DEVICE)


def _norm(norm: RMSNorm | None) -> dict:
    """An RMSNorm module as the kernels take it: its weight and eps (nothing without a norm)."""
    return {} if norm is None else dict(weight=norm.weight, eps=norm.eps)


def _setup(shape, dtype, seed, *, with_norm=True, rope_dim=64, exact=True, eps=1e-6):
    """x, an RMSNorm with a random weight (or None), and rope tables [T, rope_dim / 2] rounded to x's dtype."""
    g = torch.Generator().manual_seed(seed + 1)
    if exact:
        x = _exact_rows(shape, seed, 8 if dtype == torch.float16 else 20)  # fp16: stay finite
    else:
        x = (torch.randn(shape, generator=g) * 3).to(DEVICE)
    norm = None
    if with_norm:
        norm = RMSNorm(shape[-1], eps).to(DEVICE)
        with torch.no_grad():
            norm.weight.copy_(torch.rand(shape[-1], generator=g) * 1.5 + 0.25)
    ang = torch.rand(shape[1], rope_dim // 2, generator=g, dtype=torch.float64) * 40
    cos, sin = ang.cos().float().to(dtype).to(DEVICE), ang.sin().float().to(dtype).to(DEVICE)
    return x.to(dtype), norm, cos, sin


@pytest.mark.parametrize("dtype,quant", [(d, q) for d in (torch.bfloat16, torch.float32) for q in QUANTS]
                         + [(torch.float16, None), (torch.float16, "fp4")])
def test_forward_bit_exact(poisoned, dtype, quant):
    x, norm, cos, sin = _setup((2, 151, 512), dtype, seed=3)
    q, y = nr.norm_rope_fake_quant(x, cos, sin, **_norm(norm), quant=quant, return_normed=True, impl="triton",
                                   rows_per_prog=RPP)
    ref_q, ref_y = nr.norm_rope_fake_quant(x, cos, sin, **_norm(norm), quant=quant, return_normed=True)
    _assert_same_bits(y, ref_y, "normed")
    _assert_same_bits(q, ref_q, "fake quant")
    if quant is not None:  # the reference side really is the model's passes
        block, fmt = nr.QUANTS[quant]
        rotated = apply_rope(norm(x), cos, sin)
        direct = fp8.fake_quant_fp8(rotated, 32) if quant == "fp8" else fp4.fake_quant(rotated, block, fmt)
        _assert_same_bits(q, direct, "vs model passes")


@pytest.mark.parametrize("quant", ["fp4", "fp4_ue8m0", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_record_bit_exact(poisoned, dtype, quant):
    x, norm, cos, sin = _setup((1, 203, 512), dtype, seed=5)
    codes, scales, y = nr.norm_rope_quantize(x, cos, sin, **_norm(norm), quant=quant, return_normed=True,
                                             impl="triton", rows_per_prog=RPP)
    ref_codes, ref_scales, ref_y = nr.norm_rope_quantize(x, cos, sin, **_norm(norm), quant=quant, return_normed=True)
    _assert_same_bits(codes, ref_codes, "codes")
    _assert_same_bits(scales, ref_scales, "scales")
    _assert_same_bits(y, ref_y, "normed")
    # and the record decodes to the fake-quantised rows
    fake = nr.norm_rope_fake_quant(x, cos, sin, **_norm(norm), quant=quant, impl="triton", rows_per_prog=RPP)
    deq = fp8.dequantize_fp8(codes, scales) if quant == "fp8" else fp4.dequantize(codes, scales, nr.QUANTS[quant][0])
    _assert_same_bits(deq.to(dtype), fake, "dequantised record")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_generic_rows_differ_only_in_the_norm_statistic(dtype):
    """Gaussian rows: the normed output is within a few fp32 ulps / one bf16 rounding of the reference (the sum order);
    given the kernel's own y, RoPE and the quantiser are bit-exact."""
    x, norm, cos, sin = _setup((2, 97, 512), dtype, seed=7, exact=False)
    for quant in ("fp4", "fp8"):
        q, y = nr.norm_rope_fake_quant(x, cos, sin, **_norm(norm), quant=quant, return_normed=True, impl="triton",
                                       rows_per_prog=RPP)
        ref_y = norm(x)
        # two fp32 sums of 512 squares differ by a few ulps, rstd by half that: fp32 y moves by a few ulps, bf16 y by
        # at most one bf16 rounding
        tol = (4 if dtype == torch.float32 else 1) * torch.finfo(dtype).eps * ref_y.float().abs()
        assert ((y.float() - ref_y.float()).abs() <= tol).all()
        _assert_same_bits(q, nr.norm_rope_fake_quant(y, cos, sin, quant=quant), f"{quant} given y")


def _grads(x, norm, cos, sin, quant, dq, impl, wrt_x=True, rows_per_prog=RPP):
    x = x.detach().clone().requires_grad_(wrt_x)
    if norm is not None:
        norm.weight.grad = None
    q = nr.norm_rope_fake_quant(x, cos, sin, **_norm(norm), quant=quant, impl=impl, rows_per_prog=rows_per_prog)
    q.backward(dq)
    return x.grad, None if norm is None else norm.weight.grad.clone()


def _hard_rows(shape, block: int, seed: int) -> torch.Tensor:
    """Blocks over ~40 binades plus the quantisers' corner cases (as tests/kernels/test_fp4_triton.py)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(-20, 20, (*shape[:-1], shape[-1] // block, 1), generator=g)).repeat_interleave(
        block, -1).reshape(shape)
    flat = x.reshape(-1, block)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    mids = (grid[1:] + grid[:-1]) / 2
    flat[0], flat[1] = 0.0, -0.0
    flat[2, : len(mids)], flat[2, -1] = mids, 6.0  # exact ties at scale 1
    flat[3, : len(mids)], flat[3, -1] = -mids * 0.125, -0.75
    flat[4] = torch.linspace(-1, 1, block, dtype=torch.float64) * 3000.0  # past the e4m3 ratio clamp
    flat[5, 0], flat[5, 1:] = 6.0 * 1.0703125, torch.linspace(-6.4, 6.4, block - 1, dtype=torch.float64)
    flat[6] = flat[6] * 1e-30  # below both scale floors
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_no_norm_heads_any_input_bit_exact(poisoned, dtype):
    """Indexer queries [B, T, H, D]: RoPE + quantiser only, each head rotated by its token's table row; the corner
    blocks sit in the first channels (RoPE leaves them alone) and the token's first rows are identity rotations."""
    B, T, H, D = 2, 13, 5, 128
    x = _hard_rows((B, T, H, D), 32, seed=11).to(dtype).to(DEVICE)
    _, _, cos, sin = _setup((B, T, D), dtype, seed=11, with_norm=False)
    cos[:2], sin[:2] = 1.0, 0.0
    for quant in QUANTS:
        q = nr.norm_rope_fake_quant(x, cos, sin, quant=quant, impl="triton", rows_per_prog=16)
        _assert_same_bits(q, nr.norm_rope_fake_quant(x, cos, sin, quant=quant), str(quant))
    codes, scales = nr.norm_rope_quantize(x, cos, sin, quant="fp4_ue8m0", impl="triton", rows_per_prog=16)
    ref_codes, ref_scales = fp4.quantize(apply_rope(x, cos, sin), 32, "ue8m0")
    _assert_same_bits(codes, ref_codes, "codes")
    _assert_same_bits(scales, ref_scales, "scales")
    # backward: each head's gradient rotated back by its token's table row, exactly
    dq = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEVICE)
    dx, _ = _grads(x, None, cos, sin, "fp4_ue8m0", dq, "triton", rows_per_prog=16)
    _assert_same_bits(dx, _grads(x, None, cos, sin, "fp4_ue8m0", dq, "reference")[0], "dx")


@pytest.mark.parametrize("quant", [None, "fp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_matches_autograd(poisoned, dtype, quant):
    """Straight-through quantiser, RoPE's transpose and RMSNorm's backward; 302 rows in 10 tiles of 32 rows spread
    over the interpreter's 8 programs (CUDA: 4 per SM), so the dw partials come from a grid-stride loop."""
    x, norm, cos, sin = _setup((2, 151, 512), dtype, seed=13, exact=False)
    dq = torch.randn(x.shape, generator=torch.Generator().manual_seed(0)).to(dtype).to(DEVICE)
    dx, dw = _grads(x, norm, cos, sin, quant, dq, "triton")
    ref_dx, ref_dw = _grads(x, norm, cos, sin, quant, dq, "reference")
    assert dx.dtype == dtype and dw.dtype == norm.weight.dtype
    # fp32: rounding of the same sums in another order; bf16: dx rounded once more, so within one bf16 rounding
    rtol = 1e-5 if dtype == torch.float32 else 2.0**-7
    torch.testing.assert_close(dx, ref_dx, rtol=rtol, atol=1e-6 * ref_dx.abs().max().item())
    torch.testing.assert_close(dw, ref_dw, rtol=1e-5, atol=1e-5 * ref_dw.abs().max().item())
    # without the norm (indexer queries) the gradient is RoPE's transpose only: exact
    dx, _ = _grads(x, None, cos, sin, quant, dq, "triton")
    _assert_same_bits(dx, _grads(x, None, cos, sin, quant, dq, "reference")[0], "dx without norm")


def test_backward_weight_only_and_normed_output_has_no_gradient():
    x, norm, cos, sin = _setup((1, 37, 128), torch.float32, seed=17, exact=False)
    dq = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    x_grad, dw = _grads(x, norm, cos, sin, "fp4_ue8m0", dq, "triton", wrt_x=False)
    assert x_grad is None
    torch.testing.assert_close(dw, _grads(x, norm, cos, sin, "fp4_ue8m0", dq, "reference", wrt_x=False)[1],
                               rtol=1e-5, atol=1e-6)
    xg = x.clone().requires_grad_()
    q, y = nr.norm_rope_fake_quant(xg, cos, sin, **_norm(norm), quant="fp4_ue8m0", return_normed=True,
                                   impl="triton")
    assert q.requires_grad and not y.requires_grad


@pytest.mark.parametrize("dim,rope_dim,quant", [(96, 96, "fp4"), (96, 2, "fp4_ue8m0"), (512, 64, "fp8")])
def test_default_tiles_awkward_dims(poisoned, dim, rope_dim, quant):
    """Default rows per program (2048 / D: partial last tile), a padded block axis (D = 96: 6 or 3 blocks), RoPE
    over every channel or one pair, forward and backward."""
    x, norm, cos, sin = _setup((3, 7, dim), torch.bfloat16, seed=19, rope_dim=rope_dim)
    q, y = nr.norm_rope_fake_quant(x, cos, sin, **_norm(norm), quant=quant, return_normed=True, impl="triton")
    ref_q, ref_y = nr.norm_rope_fake_quant(x, cos, sin, **_norm(norm), quant=quant, return_normed=True)
    _assert_same_bits(y, ref_y, "normed")
    _assert_same_bits(q, ref_q, "fake quant")
    dq = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).to(DEVICE)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    nr.norm_rope_fake_quant(x1, cos, sin, **_norm(norm), quant=quant, impl="triton").backward(dq)
    dw = norm.weight.grad.clone()
    norm.weight.grad = None
    nr.norm_rope_fake_quant(x2, cos, sin, **_norm(norm), quant=quant).backward(dq)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=2.0**-7, atol=1e-6 * x2.grad.abs().max().item())
    torch.testing.assert_close(dw, norm.weight.grad, rtol=1e-5, atol=1e-5 * norm.weight.grad.abs().max().item())


def test_no_rows():
    """A Full layer before its first group closes compresses nothing: E = 0 rows, forward and backward."""
    x, norm, cos, sin = _setup((2, 0, 128), torch.bfloat16, seed=29, exact=False)
    x.requires_grad_()
    q, y = nr.norm_rope_fake_quant(x, cos, sin, **_norm(norm), quant="fp4", return_normed=True, impl="triton")
    assert q.shape == y.shape == x.shape
    q.sum().backward()
    assert x.grad.shape == x.shape and torch.equal(norm.weight.grad, torch.zeros_like(norm.weight))
    codes, scales = nr.norm_rope_quantize(x, cos, sin, **_norm(norm), quant="fp4", impl="triton")
    assert codes.shape == (2, 0, 64) and scales.shape == (2, 0, 8)


def test_bad_arguments_raise():
    x, norm, cos, sin = _setup((2, 4, 64), torch.float32, seed=23, rope_dim=16)
    run = nr.norm_rope_fake_quant
    with pytest.raises(ValueError, match="quant must be one of"):
        run(x, cos, sin, **_norm(norm), quant="fp6", impl="triton")
    with pytest.raises(ValueError, match="impl must be one of"):
        run(x, cos, sin, **_norm(norm), quant="fp4", impl="cuda")
    with pytest.raises(ValueError, match="must be contiguous"):
        run(x.transpose(0, 1), cos[:2], sin[:2], **_norm(norm), quant="fp4", impl="triton")
    with pytest.raises(ValueError, match="cos and sin must both be"):
        run(x, cos[:3], sin[:3], **_norm(norm), quant="fp4", impl="triton")
    with pytest.raises(ValueError, match="divisible by the fp4_ue8m0 block"):
        run(x[..., :48].contiguous(), cos, sin, **_norm(RMSNorm(48, 1e-6).to(DEVICE)), quant="fp4_ue8m0",
            impl="triton")
    with pytest.raises(TypeError, match="x must be a bf16, fp16 or fp32"):
        run(x.double(), cos, sin, **_norm(norm), quant="fp4", impl="triton")
    with pytest.raises(ValueError, match="weight must be"):
        run(x, cos, sin, **_norm(RMSNorm(32, 1e-6).to(DEVICE)), quant="fp4", impl="triton")
    with pytest.raises(ValueError, match="quant must be 'fp4'"):
        nr.norm_rope_quantize(x, cos, sin, **_norm(norm), quant=None, impl="triton")
