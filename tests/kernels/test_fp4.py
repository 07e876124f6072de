"""Proves the plain-PyTorch FP4 / FP8 block-quantisation references in `kernels.fp4` / `kernels.fp8` follow
REFERENCE A9 and B2 exactly:

- FP4 E2M1: every representable signed value round-trips bit-exactly at several scales; every midpoint tie
  goes to the even code; |x| beyond 6*scale clamps; random data matches an independent brute-force
  nearest-grid oracle, stays within half a grid step * scale, and dequant(quant(x)) is idempotent; the
  nibble layout matches a hand-made example; -0 and all-zero blocks encode as code 0.
- Scales: e4m3 = torch's own float8_e4m3fn cast of max(amax, 6*2^-9)/6 (and it can round down);
  ue8m0 scales are exact powers of two equal to 2^ceil(log2(amax/6)).
- FP8 E4M3 (SWA KV): round trip, scale rule 2^ceil(log2(max(amax, 1e-4)/448)), RNE values.
- fake_quant / fake_quant_fp8 equal dequant(quant(x)) in x's dtype and have identity (straight-through)
  gradients; bad shapes/dtypes raise naming the problem; impl="triton" raises NotImplementedError;
  record_bytes gives the B2 / A13 record sizes (288, 68, 528 B).
(FP8 lives in kernels/fp8.py but is tested here because kernels.fp4 re-exports it as part of one contract.)
"""

from __future__ import annotations

import pytest
import torch

from kernels.fp4 import (
    FP4_GRID,
    dequantize,
    dequantize_fp8,
    fake_quant,
    fake_quant_fp8,
    quantize,
    quantize_fp8,
    record_bytes,
)

GRID = torch.tensor(FP4_GRID, dtype=torch.float64)
FMTS = [("e4m3", 16), ("ue8m0", 32)]
# Scales each format can represent exactly (e4m3: 3 mantissa bits, subnormals down to 2^-9, max 448).
E4M3_SCALES = [2.0**-9, 3 * 2.0**-9, 0.0703125, 1.0, 1.75, 13.0, 448.0]
UE8M0_SCALES = [2.0**-126, 2.0**-20, 0.125, 1.0, 2.0**10, 2.0**100]


def _unpack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., D//2] -> nibbles [..., D] (even element from the low nibble)."""
    return torch.stack([codes & 0xF, codes >> 4], dim=-1).flatten(-2)


def _block_with_scale(values: list[float], scale: float, block: int) -> torch.Tensor:
    """One block whose amax is 6*scale (so the quantiser picks exactly `scale`), holding `values` * scale."""
    assert len(values) < block
    row = [6.0] + list(values) + [0.0] * (block - 1 - len(values))
    return torch.tensor(row, dtype=torch.float64).mul(scale).float()


def _oracle_codes(v: torch.Tensor) -> torch.Tensor:
    """Independent rounding: nearest grid magnitude by brute force in float64, ties to the even code."""
    mag = v.double().abs().clamp_max(6.0).unsqueeze(-1)
    dist = (mag - GRID).abs()  # [..., 8]
    best = dist.min(dim=-1, keepdim=True).values
    tied = dist == best
    # Prefer an even code among the nearest; exactly one nearest code when not a tie.
    even_bonus = (torch.arange(8) % 2 == 0).to(torch.float64)
    code = (tied.double() * (1.0 + even_bonus)).argmax(dim=-1).to(torch.uint8)
    sign = ((v < 0) & (code > 0)).to(torch.uint8) << 3
    return code | sign


@pytest.mark.parametrize("scale_fmt,block", FMTS)
def test_every_representable_value_round_trips(scale_fmt: str, block: int) -> None:
    signed = [g for g in FP4_GRID[1:]] + [-g for g in FP4_GRID[1:]] + [0.0]  # 14 nonzero + 0
    expect_codes = list(range(1, 8)) + list(range(9, 16)) + [0]
    scales = E4M3_SCALES if scale_fmt == "e4m3" else UE8M0_SCALES
    for scale in scales:
        x = _block_with_scale(signed, scale, block)
        codes, scales_q = quantize(x, block, scale_fmt)
        assert scales_q.float().item() == scale
        assert _unpack(codes)[1 : 1 + len(signed)].tolist() == expect_codes
        assert torch.equal(dequantize(codes, scales_q, block), x), scale


@pytest.mark.parametrize("scale_fmt,block", FMTS)
def test_ties_round_to_even_code(scale_fmt: str, block: int) -> None:
    # midpoint -> (lower neighbour's code, upper neighbour's code); a tie takes whichever is even
    ties = {0.25: (0, 1), 0.75: (1, 2), 1.25: (2, 3), 1.75: (3, 4), 2.5: (4, 5), 3.5: (5, 6), 5.0: (6, 7)}
    even = [lo if lo % 2 == 0 else hi for lo, hi in ties.values()]
    mids = list(ties) + [-t for t in ties]
    want = even + [c | 8 if c else 0 for c in even]
    for scale in [1.0, 0.125] + ([1.75, 13.0] if scale_fmt == "e4m3" else [2.0**-30]):
        x = _block_with_scale(mids, scale, block)
        got = _unpack(quantize(x, block, scale_fmt)[0])[1 : 1 + len(mids)]
        assert got.tolist() == want, scale
        # Just off each tie, the nearer neighbour wins on either side.
        off = [t - 1e-3 for t in ties] + [t + 1e-3 for t in ties]
        near = [lo for lo, _ in ties.values()] + [hi for _, hi in ties.values()]
        y = _block_with_scale(off, scale, block)
        assert _unpack(quantize(y, block, scale_fmt)[0])[1 : 1 + len(off)].tolist() == near, scale


@pytest.mark.parametrize("scale_fmt,block", FMTS)
def test_top_of_grid(scale_fmt: str, block: int) -> None:
    # The block's amax (6) fixes the scale at 1; values between 5 and 6 round to the top code.
    x = _block_with_scale([-6.0, 5.9, -5.5, 5.0 + 1e-3], 1.0, block)
    codes, _ = quantize(x, block, scale_fmt)
    assert _unpack(codes)[:5].tolist() == [7, 15, 7, 15, 7]


def test_beyond_six_clamps() -> None:
    # Only e4m3 scales can leave |x| / scale > 6 (ue8m0 rounds the scale up, so it never does).
    # Rounding down: amax/6 = 1.0625 ties to e4m3 1.0 (even mantissa), so 6.375 / 1 clamps to 6.
    x = torch.zeros(16)
    x[3], x[4], x[5] = 6.375, -6.2, 6.0
    codes, scales_q = quantize(x, 16, "e4m3")
    assert scales_q.float().item() == 1.0
    assert _unpack(codes)[3:6].tolist() == [7, 15, 7]
    assert dequantize(codes, scales_q, 16)[3:6].tolist() == [6.0, -6.0, 6.0]
    # Huge amax saturates the e4m3 scale at 448 (not NaN), and every value clamps to +-6 * 448.
    x = torch.tensor([1e6, -3e3] * 8)
    codes, scales_q = quantize(x, 16, "e4m3")
    assert scales_q.float().item() == 448.0
    assert torch.equal(dequantize(codes, scales_q, 16), x.sign() * 6 * 448.0)


RANDOM_CASES = [
    ("e4m3", 16, (7, 48)),
    ("e4m3", 16, (3, 5, 80)),
    ("e4m3", 16, (2, 512)),
    ("ue8m0", 32, (7, 96)),
    ("ue8m0", 32, (3, 5, 160)),
    ("ue8m0", 32, (2, 128)),
]


@pytest.mark.parametrize("case", range(len(RANDOM_CASES)))
def test_random_data_oracle_error_bound_idempotent(case: int) -> None:
    scale_fmt, block, shape = RANDOM_CASES[case]
    g = torch.Generator().manual_seed(case)
    # Per-block magnitudes over 24 binades (reaching e4m3's subnormal and saturated scales), awkward dims.
    mag = torch.exp2(torch.randint(-12, 12, (*shape[:-1], shape[-1] // block, 1), generator=g).float())
    x = (torch.randn(shape, generator=g).unflatten(-1, (-1, block)) * mag).flatten(-2)
    codes, scales_q = quantize(x, block, scale_fmt)
    assert codes.shape == (*shape[:-1], shape[-1] // 2) and codes.dtype == torch.uint8
    assert scales_q.shape == (*shape[:-1], shape[-1] // block)
    s = scales_q.float().repeat_interleave(block, dim=-1)  # [..., D]
    assert torch.equal(_unpack(codes), _oracle_codes((x / s).clamp(-6, 6)))

    dq = dequantize(codes, scales_q, block)
    assert dq.dtype == torch.float32 and dq.shape == x.shape
    # Within +-6*scale: at most half the local grid step (0.25 below 2, 0.5 below 4, 1 above) * scale.
    v = (x / s).abs()
    inside = v <= 6
    half_step = torch.where(v <= 2, 0.25, torch.where(v <= 4, 0.5, 1.0))
    assert ((dq - x).abs() <= half_step * s * (1 + 1e-6))[inside].all()
    # Beyond it: exactly the clamped value. Only e4m3 gets there, by rounding the scale down: by at
    # most 1/16 in e4m3's normal range (so |x|/scale <= 6.4); more for subnormal or saturated (448) scales.
    assert torch.equal(dq[~inside], 6 * s[~inside] * x[~inside].sign())
    ratio = x.abs().unflatten(-1, (-1, block)).amax(-1).repeat_interleave(block, dim=-1) / 6
    if scale_fmt == "ue8m0":
        assert inside.all()
    else:
        normal = (ratio >= 2.0**-6) & (ratio <= 448)
        assert (v[normal] <= 6.4).all() and not inside.all()

    codes2, scales2 = quantize(dq, block, scale_fmt)
    assert torch.equal(dequantize(codes2, scales2, block), dq)


def test_nibble_layout_hand_example() -> None:
    x = torch.zeros(16)
    x[:6] = torch.tensor([0.5, -1.0, 6.0, 0.0, -3.0, 1.5])
    codes, scales_q = quantize(x, 16, "e4m3")
    # pairs (0.5, -1) -> low 0x1, high 0xA; (6, 0) -> 0x7, 0x0; (-3, 1.5) -> 0xD, 0x3
    assert codes.tolist() == [0xA1, 0x07, 0x3D] + [0] * 5
    assert scales_q.float().item() == 1.0
    hand = torch.tensor([0xA1, 0x07, 0x3D] + [0] * 5, dtype=torch.uint8)
    assert torch.equal(dequantize(hand, scales_q, 16), x)


@pytest.mark.parametrize("scale_fmt,block", FMTS)
def test_negative_zero_and_all_zero_block(scale_fmt: str, block: int) -> None:
    x = torch.zeros(2, 2 * block)
    x[0, 0], x[0, 1] = -0.0, -1e-3  # -1e-3 / scale rounds to magnitude 0: still code 0, not 8
    x[0, 2] = 6.0
    codes, scales_q = quantize(x, block, scale_fmt)
    assert _unpack(codes)[0, :3].tolist() == [0, 0, 7]
    assert codes[1].eq(0).all() and codes[0, block // 2 :].eq(0).all()
    dq = dequantize(codes, scales_q, block)
    assert dq[0, :2].tolist() == [0.0, 0.0] and not torch.signbit(dq).any()
    # All-zero block: floored amax gives the smallest scale, finite and nonzero.
    floor_scale = 2.0**-9 if scale_fmt == "e4m3" else 2.0**-126
    assert scales_q.float()[1].eq(floor_scale).all()


def test_e4m3_scale_matches_torch_cast_and_can_round_down() -> None:
    g = torch.Generator().manual_seed(0)
    amax = torch.exp2(torch.empty(4096).uniform_(-14, 12, generator=g))
    x = torch.zeros(4096, 16)
    x[:, 5] = -amax
    _, scales_q = quantize(x, 16, "e4m3")
    want = (amax.clamp_min(6 * 2.0**-9) / 6).clamp_max(448).to(torch.float8_e4m3fn)
    assert scales_q.dtype == torch.float8_e4m3fn and scales_q.shape == (4096, 1)
    assert torch.equal(scales_q.view(torch.uint8)[:, 0], want.view(torch.uint8))
    assert (scales_q.float()[:, 0] < amax / 6).any(), "RNE must sometimes round the scale down"


def test_ue8m0_scales_are_exact_powers_of_two() -> None:
    g = torch.Generator().manual_seed(1)
    amax = torch.exp2(torch.empty(4096).uniform_(-130, 120, generator=g))
    # Exact multiples of 6 at powers of two must not round up; one ulp above must.
    edges = torch.tensor([6.0, 12.0, 3.0, 6 * 2.0**-40, 6.0 * (1 + 2.0**-20), 6.0 * 2.0**-126, 0.0])
    amax = torch.cat([amax, edges])
    x = torch.zeros(amax.numel(), 32)
    x[:, 31] = amax
    _, scales_q = quantize(x, 32, "ue8m0")
    assert scales_q.dtype == torch.float8_e8m0fnu
    s = scales_q.float()[:, 0].double()
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)
    want = torch.exp2(torch.ceil(torch.log2(amax.double().clamp_min(6 * 2.0**-126) / 6)))
    assert torch.equal(s, want)
    assert s[-7:].tolist() == [1.0, 2.0, 0.5, 2.0**-40, 2.0, 2.0**-126, 2.0**-126]


def test_fp8_round_trip_and_scale_rule() -> None:
    g = torch.Generator().manual_seed(2)
    mag = torch.exp2(torch.randint(-20, 14, (5, 3, 1), generator=g).float())
    x = (torch.randn(5, 3, 32, generator=g) * mag).flatten(-2)  # [5, 96]
    x[0, :32] = 0.0  # all-zero block: scale from the 1e-4 floor
    values, scales_q = quantize_fp8(x)
    assert values.dtype == torch.float8_e4m3fn and values.shape == (5, 96)
    assert scales_q.dtype == torch.float8_e8m0fnu and scales_q.shape == (5, 3)
    amax = x.unflatten(-1, (3, 32)).abs().amax(-1).double()
    want = torch.exp2(torch.ceil(torch.log2(amax.clamp_min(1e-4) / 448)))
    assert torch.equal(scales_q.float().double(), want)
    s = scales_q.float().repeat_interleave(32, dim=-1)
    assert torch.equal(values.view(torch.uint8), (x / s).to(torch.float8_e4m3fn).view(torch.uint8))
    dq = dequantize_fp8(values, scales_q)
    assert dq.dtype == torch.float32
    assert ((dq - x).abs() <= x.abs() * 2.0**-4 + s * 2.0**-10).all()  # RNE half-ulp, subnormals
    v2, s2 = quantize_fp8(dq)
    assert torch.equal(dequantize_fp8(v2, s2), dq)
    # Every e4m3 value times a power-of-two scale survives exactly (amax 448 * 2^-3 pins the scale).
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    every = every[every.isfinite()].reshape(-1, 2, 1).expand(-1, 2, 16).reshape(-1, 32) * 0.125
    every[:, 0] = 448 * 0.125
    v, s3 = quantize_fp8(every)
    assert s3.float().eq(0.125).all() and torch.equal(dequantize_fp8(v, s3), every)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fake_quant_value_and_straight_through_gradient(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(4, 3, 64, generator=g) * 3).to(dtype).requires_grad_()
    upstream = torch.randn(4, 3, 64, generator=g).to(dtype)
    cases = [
        (lambda t: fake_quant(t), lambda t: dequantize(*quantize(t), 16)),
        (lambda t: fake_quant(t, 32, "ue8m0"), lambda t: dequantize(*quantize(t, 32, "ue8m0"), 32)),
        (lambda t: fake_quant_fp8(t), lambda t: dequantize_fp8(*quantize_fp8(t))),
    ]
    for fq, reference in cases:
        x.grad = None
        y = fq(x)
        assert y.dtype == dtype and y.shape == x.shape and y.requires_grad
        assert torch.equal(y.detach(), reference(x.detach()).to(dtype))
        y.backward(upstream)
        assert torch.equal(x.grad, upstream)
    # Same codes whatever the input float dtype (values exactly representable in bf16).
    xb = x.detach()
    assert all(torch.equal(a, b) for a, b in zip(quantize(xb), quantize(xb.double())))


def test_shape_and_dtype_errors() -> None:
    with pytest.raises(ValueError, match="even"):
        quantize(torch.zeros(3, 15), block=5)
    with pytest.raises(ValueError, match="divisible by block=16"):
        quantize(torch.zeros(3, 24))
    with pytest.raises(ValueError, match="divisible by block=32"):
        quantize_fp8(torch.zeros(3, 48))
    with pytest.raises(ValueError, match="divisible by block=32"):
        fake_quant_fp8(torch.zeros(48))
    with pytest.raises(ValueError, match="scale_fmt"):
        quantize(torch.zeros(16), scale_fmt="e5m2")
    with pytest.raises(ValueError, match="block"):
        quantize(torch.zeros(16), block=0)
    with pytest.raises(TypeError, match="floating-point"):
        quantize(torch.zeros(16, dtype=torch.int32))
    codes, scales_q = quantize(torch.randn(2, 32))
    with pytest.raises(ValueError, match="scales shape"):
        dequantize(codes, scales_q[:, :1])
    with pytest.raises(TypeError, match="uint8"):
        dequantize(codes.int(), scales_q)
    with pytest.raises(TypeError, match="float8"):
        dequantize(codes, scales_q.float())
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        dequantize_fp8(torch.zeros(32), torch.ones(1).to(torch.float8_e8m0fnu))


def test_impl_triton_matches_and_unknown_impl_rejected() -> None:
    x = torch.randn(2, 32, device="cuda" if torch.cuda.is_available() else "cpu")
    codes, scales_q = quantize(x)
    values, scales8 = quantize_fp8(x)
    calls = [
        lambda impl: quantize(x, impl=impl),
        lambda impl: dequantize(codes, scales_q, impl=impl),
        lambda impl: fake_quant(x, impl=impl),
        lambda impl: quantize_fp8(x, impl=impl),
        lambda impl: dequantize_fp8(values, scales8, impl=impl),
        lambda impl: fake_quant_fp8(x, impl=impl),
    ]
    for call in calls:
        ref, tri = call("reference"), call("triton")  # the Triton kernels (interpreter on CPU) equal the reference
        for r, t in zip(ref if isinstance(ref, tuple) else (ref,), tri if isinstance(tri, tuple) else (tri,)):
            assert torch.equal(r.view(torch.uint8) if r.element_size() == 1 else r,
                               t.view(torch.uint8) if t.element_size() == 1 else t)
        with pytest.raises(ValueError, match="impl"):
            call("cuda")


def test_record_bytes() -> None:
    assert record_bytes(512, "fp4") == 288
    assert record_bytes(128, "fp4_ue8m0") == 68
    assert record_bytes(512, "fp8") == 528
    assert record_bytes(128, "fp8") == 132
    assert record_bytes(512, "bf16") == 1024
    # SPEC 1.4: 2.5 entries/token of (main + index key) = 890 B/token.
    assert 2.5 * (record_bytes(512, "fp4") + record_bytes(128, "fp4_ue8m0")) == 890
    # Bytes agree with what quantize actually returns.
    codes, scales_q = quantize(torch.randn(512))
    assert codes.numel() + scales_q.numel() * scales_q.element_size() == 288
    with pytest.raises(ValueError, match="fmt"):
        record_bytes(512, "fp6")
    with pytest.raises(ValueError, match="block of 16"):
        record_bytes(40, "fp4")
