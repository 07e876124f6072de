"""Proves the Triton FP4 / FP8 block-quantisation kernels (kernels/fp4_triton.py, kernels/fp8_triton.py) are
bit-identical to the PyTorch references in kernels/fp4.py and kernels/fp8.py:

- FP4 quantize (e4m3 scale per 16, ue8m0 scale per 32): codes and scale bytes equal the reference's for bf16, fp16,
  fp32 and fp64 inputs with awkward leading dims, wide dynamic range, all-zero and -0 blocks, exact grid ties,
  amax that makes the e4m3 scale round down, and amax beyond the 2688 clamp;
- the e4m3-scale quotient (reciprocal + one fma correction instead of a division) rounds like the reference at
  every code threshold and its fp32 neighbours, for every e4m3 scale;
- FP4 dequantize equals the reference on every code byte and every finite scale byte; fake_quant equals
  dequant(quant(x)) of the reference in x's dtype, in one pass;

The rest of what it proves: docs/testing.md#triton-fp4-and-fp8-kernels
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports the kernels

from kernels import fp4, fp8  # noqa: E402
from kernels import fp4_triton as ft  # noqa: E402
from kernels import fp8_triton as f8t  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FMTS = [("e4m3", 16), ("ue8m0", 32)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]


@pytest.fixture
def poisoned(monkeypatch):
    """Every torch.empty / empty_like returns NaN-filled floats and 0x88-filled integers (a byte the quantisers never
    write: it would be two FP4 "-0" codes), so an element a kernel forgets to write cannot match the reference."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(0x88 if t.dtype == torch.uint8 else -77)

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(real_empty_like(*a, **k)))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Compare floats by their bit patterns (so -0 vs +0 and NaN payloads count)."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    diff = (_bits(a) != _bits(b)).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} elements differ, first at {diff[0].tolist()}: {a[tuple(diff[0])]} vs " \
                              f"{b[tuple(diff[0])]}"


def _hard_input(shape: tuple[int, ...], block: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random blocks over ~40 binades, plus blocks built to hit the corner cases of both scale formats."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    lo, hi = (-10, 8) if dtype == torch.float16 else (-20, 20)  # stay finite in fp16 (inf is out of contract)
    x = x * torch.exp2(torch.randint(lo, hi, (*shape[:-1], shape[-1] // block, 1), generator=g)).repeat_interleave(
        block, -1).reshape(shape)
    flat = x.reshape(-1, block)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    mids = (grid[1:] + grid[:-1]) / 2
    flat[0] = 0.0
    flat[1] = -0.0
    flat[2, : len(mids)] = mids  # exact ties at scale 1 (amax 6 below)
    flat[2, -1] = 6.0
    flat[3, : len(mids)] = -mids * 0.125
    flat[3, -1] = -0.75  # amax 6 * 2^-3: scale 2^-3 in both formats
    flat[4] = torch.linspace(-1, 1, block, dtype=torch.float64) * 3000.0  # past the e4m3 ratio clamp (2688)
    flat[5, 0] = 6.0 * 1.0703125  # amax / 6 between e4m3 neighbours: the scale rounds down, the clamp bites
    flat[5, 1:] = torch.linspace(-6.4, 6.4, block - 1, dtype=torch.float64)
    flat[6] = flat[6] * 1e-30  # amax below both scale floors
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale_fmt,block", FMTS)
def test_fp4_quantize_bit_exact(poisoned, dtype, scale_fmt, block):
    x = _hard_input((3, 7, 3 * block), block, dtype, seed=block).to(DEVICE)
    codes, scales = ft.quantize(x, block, scale_fmt)
    ref_codes, ref_scales = fp4.quantize(x, block, scale_fmt)
    _assert_same_bits(codes, ref_codes)
    _assert_same_bits(scales, ref_scales)


def test_fp4_e4m3_quotient_rounding_at_every_threshold_and_scale(poisoned):
    """The kernel divides by an e4m3 scale with a reciprocal and one fma correction: check it on the values where
    the rounding of x / s decides the code (each threshold times s and 64 fp32 neighbours on either side, which
    include the inputs where a plain x * RN(1/s) would pick the wrong code), for every scale."""
    thresholds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    steps = torch.arange(-64, 65, dtype=torch.int32)
    blocks = []
    for s in torch.arange(1, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float():  # every positive scale
        vals = ((thresholds * s).view(torch.int32)[:, None] + steps).view(torch.float32).flatten()  # 7 x 129
        vals = vals * torch.tensor([1.0, -1.0]).repeat(len(vals))[: len(vals)]  # both signs
        vals = torch.cat([vals, vals.new_zeros(-len(vals) % 15)]).reshape(-1, 15)
        blocks.append(torch.cat([torch.full((len(vals), 1), 6.0) * s, vals], dim=1))  # amax 6s: scale exactly s
    x = torch.cat(blocks).reshape(-1, 16).to(DEVICE)
    codes, scales = ft.quantize(x, 16, "e4m3")
    ref_codes, ref_scales = fp4.quantize(x, 16, "e4m3")
    _assert_same_bits(scales, ref_scales)
    _assert_same_bits(codes, ref_codes)


@pytest.mark.parametrize("scale_fmt,block", FMTS)
def test_fp4_quantize_into_given_buffers(scale_fmt, block):
    x = torch.randn(5, 2 * block, device=DEVICE)
    codes = torch.full((5, block), 0x88, dtype=torch.uint8, device=DEVICE)
    scales = torch.full((5, 2), float("nan"), device=DEVICE).to(fp4.quantize(x, block, scale_fmt)[1].dtype)
    out = ft.quantize(x, block, scale_fmt, out=(codes, scales))
    assert out[0] is codes and out[1] is scales
    ref = fp4.quantize(x, block, scale_fmt)
    _assert_same_bits(codes, ref[0])
    _assert_same_bits(scales, ref[1])


@pytest.mark.parametrize("scale_fmt,block", FMTS)
def test_fp4_dequantize_every_code_and_scale(poisoned, scale_fmt, block):
    # Rows cycle through all 256 code bytes; scales through every finite scale byte of the format.
    codes = torch.arange(256, dtype=torch.uint8).repeat(3 * block // 2 * 9 // 256 + 1)[: 9 * 3 * block // 2]
    codes = codes.reshape(9, 3 * block // 2)
    if scale_fmt == "e4m3":
        finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
        scales = finite[torch.arange(27) * 9 % len(finite)].view(torch.float8_e4m3fn)
    else:
        scales = torch.arange(0, 255, 9, dtype=torch.uint8)[:27].view(torch.float8_e8m0fnu)
    codes, scales = codes.to(DEVICE), scales.reshape(9, 3).to(DEVICE)
    _assert_same_bits(ft.dequantize(codes, scales, block), fp4.dequantize(codes, scales, block))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale_fmt,block", FMTS)
def test_fp4_fake_quant_equals_reference(poisoned, dtype, scale_fmt, block):
    x = _hard_input((2, 5, 2 * block), block, dtype, seed=7).to(DEVICE)
    _assert_same_bits(ft.fake_quant(x, block, scale_fmt), fp4.fake_quant(x, block, scale_fmt))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_quantize_bit_exact(poisoned, dtype):
    x = _hard_input((3, 5, 96), 32, dtype, seed=3).to(DEVICE)
    values, scales = f8t.quantize_fp8(x)
    ref_values, ref_scales = fp8.quantize_fp8(x)
    _assert_same_bits(values, ref_values)
    _assert_same_bits(scales, ref_scales)
    _assert_same_bits(f8t.fake_quant_fp8(x), fp8.fake_quant_fp8(x))


def test_fp8_rounding_on_every_e4m3_value_and_midpoint(poisoned):
    # Blocks whose amax is 448 get scale 1, so the kernel's e4m3 rounding sees the raw values.
    pos = torch.arange(1, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).double()  # all positive finite values
    mids = (pos[1:] + pos[:-1]) / 2
    below = torch.nextafter(mids.float(), torch.tensor(0.0)).double()
    above = torch.nextafter(mids.float(), torch.tensor(1e9)).double()
    tiny = torch.tensor([2.0**-10, 2.0**-10 * 1.0001, 2.0**-11, 3 * 2.0**-11, 1e-30, 0.0])
    vals = torch.cat([pos, mids, below, above, tiny.double(), (pos[0] / 2).reshape(1)])
    vals = torch.cat([vals, -vals])
    vals = torch.cat([vals, vals.new_zeros(-len(vals) % 31)]).reshape(-1, 31)
    x = torch.cat([torch.full((vals.shape[0], 1), 448.0, dtype=torch.float64), vals], dim=1).float().to(DEVICE)
    values, scales = f8t.quantize_fp8(x)
    ref_values, ref_scales = fp8.quantize_fp8(x)
    assert (scales.float() == 1.0).all()
    _assert_same_bits(values, ref_values)
    _assert_same_bits(scales, ref_scales)


@pytest.mark.filterwarnings("ignore:overflow encountered")  # 448 * 2^127 is inf, in the reference too
def test_fp8_dequantize_every_value_byte(poisoned):
    finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    values = finite.repeat(2)[: 7 * 64].reshape(7, 64).view(torch.float8_e4m3fn).to(DEVICE)
    scales = torch.tensor([0, 1, 100, 127, 128, 200, 254] * 2, dtype=torch.uint8)
    scales = scales.reshape(7, 2).view(torch.float8_e8m0fnu).to(DEVICE)
    _assert_same_bits(f8t.dequantize_fp8(values, scales), fp8.dequantize_fp8(values, scales))


def test_public_functions_route_triton_and_keep_straight_through_gradient():
    x = torch.randn(4, 64, device=DEVICE, requires_grad=True)
    for fmt, block in FMTS:
        c, s = fp4.quantize(x, block, fmt, impl="triton")
        r = fp4.quantize(x, block, fmt)
        _assert_same_bits(c, r[0])
        _assert_same_bits(fp4.dequantize(c, s, block, impl="triton"), fp4.dequantize(*r, block))
        y = fp4.fake_quant(x, block, fmt, impl="triton")
        _assert_same_bits(y.detach(), fp4.fake_quant(x, block, fmt).detach())
        (grad,) = torch.autograd.grad((y * torch.arange(64.0, device=DEVICE)).sum(), x)
        assert torch.equal(grad, torch.arange(64.0, device=DEVICE).expand(4, 64))
    v, s = fp8.quantize_fp8(x, impl="triton")
    _assert_same_bits(fp8.dequantize_fp8(v, s, impl="triton"), fp8.dequantize_fp8(*fp8.quantize_fp8(x)))
    y = fp8.fake_quant_fp8(x, impl="triton")
    (grad,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(grad, torch.ones_like(x))
    with pytest.raises(ValueError, match="impl"):
        fp4.quantize(x, impl="cuda")


def test_empty_input_and_bad_inputs_raise():
    codes, scales = ft.quantize(torch.empty(0, 32, device=DEVICE))
    assert codes.shape == (0, 16) and scales.shape == (0, 2)
    x = torch.randn(4, 64, device=DEVICE)
    with pytest.raises(ValueError, match="contiguous"):
        ft.quantize(x.t().contiguous().t())
    with pytest.raises(ValueError, match="divisible"):
        ft.quantize(torch.randn(4, 40, device=DEVICE), 16)
    with pytest.raises(ValueError, match="power-of-two"):
        f8t.quantize_fp8(torch.randn(4, 48, device=DEVICE), 24)
    with pytest.raises(ValueError, match="scale_fmt"):
        ft.quantize(x, 16, "e5m2")
    with pytest.raises(TypeError, match="uint8"):
        ft.dequantize(x, torch.ones(4, 8, device=DEVICE).to(torch.float8_e4m3fn))
    with pytest.raises(TypeError, match="e8m0fnu"):
        f8t.dequantize_fp8(x.to(torch.float8_e4m3fn), torch.ones(4, 2, device=DEVICE).to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="out codes"):
        ft.quantize(x, 16, out=(torch.empty(4, 31, dtype=torch.uint8, device=DEVICE), torch.empty(4, 4)))


def _edge_input(rows: int, dim: int, block: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """_hard_input plus blocks of edge values: subnormal-ish magnitudes, huge ones, mixed signed zeros, a lone
    nonzero among zeros, and negatives that round to zero beside a large amax."""
    x = _hard_input((rows, dim), block, dtype, seed).double()
    flat = x.view(-1, block)
    big = 60000.0 if dtype == torch.float16 else 1e30
    tiny = 2.0**-24 if dtype == torch.float16 else 2.0**-130
    flat[7] = torch.tensor([0.0, -0.0] * (block // 2), dtype=torch.float64)
    flat[8] = tiny * torch.arange(-(block // 2), block // 2, dtype=torch.float64)
    flat[9] = big * torch.linspace(-1, 1, block, dtype=torch.float64)
    flat[10] = 0.0
    flat[10, block // 3] = -3.0
    flat[11] = -1e-3
    flat[11, 0] = 6.0
    return x.to(dtype)


@pytest.mark.parametrize("variant", list(ft.VARIANTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scale_fmt,block", FMTS)
def test_fp4_every_variant_bit_exact(poisoned, variant, dtype, scale_fmt, block):
    # 13 rows of 5 blocks = 65 blocks: tiles of 4 or 8 leave a partial last tile, and the interpreter's persistent
    # grid (2 SMs) loops over several tiles per program.
    x = _edge_input(13, 5 * block, block, dtype, seed=11).to(DEVICE)
    ref_codes, ref_scales = fp4.quantize(x, block, scale_fmt)
    ref_fake = fp4.fake_quant(x, block, scale_fmt)
    for bpp, warps in ((4, 1), (8, 2)):
        codes, scales = ft.quantize(x, block, scale_fmt, variant=variant, blocks_per_prog=bpp, num_warps=warps)
        _assert_same_bits(codes, ref_codes)
        _assert_same_bits(scales, ref_scales)
        _assert_same_bits(ft.fake_quant(x, block, scale_fmt, variant=variant, blocks_per_prog=bpp, num_warps=warps),
                          ref_fake)


@pytest.mark.parametrize("variant", list(ft.VARIANTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_every_variant_bit_exact(poisoned, variant, dtype):
    x = _edge_input(9, 3 * 32, 32, dtype, seed=5).to(DEVICE)
    ref_values, ref_scales = fp8.quantize_fp8(x)
    for bpp in (4, 8):
        values, scales = f8t.quantize_fp8(x, variant=variant, blocks_per_prog=bpp)
        _assert_same_bits(values, ref_values)
        _assert_same_bits(scales, ref_scales)
        _assert_same_bits(f8t.fake_quant_fp8(x, variant=variant, blocks_per_prog=bpp), fp8.fake_quant_fp8(x))


@pytest.mark.parametrize("variant", list(ft.VARIANTS))
def test_fp4_e4m3_scale_rounds_like_the_division_at_every_boundary(poisoned, variant):
    """amax / 6 decides the e4m3 scale only near e4m3 rounding boundaries: blocks whose amax is 6 x (every
    midpoint between neighbouring e4m3 values, and every e4m3 value) and 16 fp32 neighbours on either side."""
    pos = torch.arange(1, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    points = torch.cat([pos, (pos[1:] + pos[:-1]) / 2])
    amax = (6.0 * points).float().view(torch.int32)[:, None] + torch.arange(-16, 17, dtype=torch.int32)
    amax = amax.view(torch.float32).flatten()
    x = torch.linspace(-1, 1, 16)[None, :] * amax[:, None]  # amax at both ends of every block
    x = x.to(DEVICE)
    codes, scales = ft.quantize(x, 16, "e4m3", variant=variant)
    ref_codes, ref_scales = fp4.quantize(x, 16, "e4m3")
    _assert_same_bits(scales, ref_scales)
    _assert_same_bits(codes, ref_codes)


def test_unknown_variant_raises():
    with pytest.raises(ValueError, match="variant"):
        ft.quantize(torch.randn(2, 32, device=DEVICE), variant="fastest")
