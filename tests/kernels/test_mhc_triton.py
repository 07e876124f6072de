"""Proves the Triton single-pass mHC step (kernels/mhc_triton.py, with the coefficient kernel of
kernels/mhc_coeffs_triton.py, composed as model.kernels.mhc_single_pass does) computes model.mhc.single_pass, forward
and backward:

- S', x and the next site's coefficients (pre, post, Sinkhorn comb, from the in-kernel sum of squares and fn
  projection) match the reference for fp32 and bf16 streams, with n = 4 and n = 3 streams, token counts and model
  dims that are not multiples of the tiles, and without a next site (the last layer);
- in fp32 the raw statistics match to ~1e-5 relative (the bf16x3 split projection), and S', x to fp32 rounding;
  in bf16, S' and x are within one bf16 rounding of the reference (the kernel rounds the fp32 result once);
- gradients w.r.t. y, S, post, comb, the lagged pre and the next site's fn / base / scale match the reference's
  autograd (fp32: ~1e-5 relative; bf16: a few bf16 roundings), also when only some outputs carry gradient;
- every output and gradient element is written (allocations are NaN-poisoned), explicit out= buffers are honoured;

The rest of what it proves: docs/testing.md#triton-mhc-step
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports the kernels

from kernels import mhc_coeffs_triton, mhc_triton  # noqa: E402
from model import kernels as kern  # noqa: E402
from model import mhc  # noqa: E402
from model.config import MHCConfig  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def poisoned(monkeypatch):
    """Every torch.empty / empty_like returns NaN-filled floats (and junk integers), so unwritten elements show."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-77)

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(real_empty_like(*a, **k)))


def _site(dim: int, n: int, seed: int) -> mhc.HCSite:
    """A site with O(1) logits (not the near-zero init) so sigmoids and Sinkhorn are exercised away from 0.5."""
    site = mhc.HCSite(dim, MHCConfig(num_streams=n), norm_eps=1e-20).to(DEVICE)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        site.fn.copy_(torch.randn(site.fn.shape, generator=g) * 0.3)
        site.base.copy_(torch.randn(site.base.shape, generator=g) * 0.5)
        site.scale.copy_(torch.rand(3, generator=g) + 0.5)
    return site


def _inputs(B, T, n, D, dtype, seed, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    S = torch.randn(B, T, n, D, generator=g).to(dtype)
    y = torch.randn(B, T, D, generator=g).to(dtype)
    post = torch.rand(B, T, n, generator=g) * 2
    comb = torch.softmax(torch.randn(B, T, n, n, generator=g), dim=-1)
    pre_lag = torch.rand(B, T, n, generator=g) + 1e-6
    out = [t.to(DEVICE).requires_grad_(requires_grad) for t in (y, S, post, comb, pre_lag)]
    return out


def _step_inputs(dtype, seed):
    """mhc_step_fwd's flat inputs y [N, D], S [N, n, D], mix [N, n+1, n+1], fn [M, n*D] at N = 37, n = 4, D = 72:
    partial tiles in tokens and channels, and partial D chunks when D is split."""
    N, n, D = 37, 4, 72
    g = torch.Generator().manual_seed(seed)
    S = torch.randn(N, n, D, generator=g).to(dtype).to(DEVICE)
    y = torch.randn(N, D, generator=g).to(dtype).to(DEVICE)
    mix = torch.randn(N, n + 1, n + 1, generator=g).to(DEVICE)
    fn = torch.randn(2 * n + n * n, n * D, generator=g).to(DEVICE)
    return y, S, mix, fn


def _assert_close_rel(a: torch.Tensor, b: torch.Tensor, rel: float, what: str, floor: float = 0.0) -> None:
    """max |a - b| <= rel * max(max |b|, floor)."""
    a, b = a.detach().double(), b.detach().double()
    assert torch.isfinite(a).all(), f"{what}: non-finite values (unwritten?)"
    err = (a - b).abs().max().item() / max(b.abs().max().item(), floor, 1e-30)
    assert err <= rel, f"{what}: max error {err:.3g} (relative to max(max |ref|, {floor:.3g})) > {rel}"


def _token_term_sizes(site, raw: torch.Tensor, sumsq: torch.Tensor, g_comb: torch.Tensor, n: int, D: int):
    """For the comb-only gradients of `scale` and `base`, sums over the tokens: the largest sum of |each token's term|,
    the size their rounding is relative to (the terms cancel, so the sum's own size is not)."""
    sizes = [torch.zeros_like(site.scale), torch.zeros_like(site.base)]
    for t in range(raw.shape[0]):
        m = raw[t:t + 1].detach() * torch.rsqrt(sumsq[t:t + 1, None].detach() / (n * D) + site.norm_eps)
        for size, g in zip(sizes, torch.autograd.grad(site.coeffs_from_logits(m)[2], (site.scale, site.base),
                                                      g_comb[t:t + 1])):
            size += g.detach().abs()
    return {"scale": sizes[0].max().item(), "base": sizes[1].max().item()}


@pytest.mark.parametrize("n", [4, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_matches_reference(poisoned, n, dtype):
    B, T, D = 2, 9, 40  # N = 18 and D = 40: partial tiles in both dims
    y, S, post, comb, pre_lag = _inputs(B, T, n, D, dtype, seed=n)
    coeffs = mhc.Coeffs(None, post, comb)
    nxt = _site(D, n, seed=1)
    ref = mhc.single_pass(y, S, coeffs, pre_lag, nxt)
    got = kern.mhc_single_pass(y, S, coeffs, pre_lag, nxt)
    assert got[0].dtype == dtype and got[1].dtype == dtype
    # fp32: rounding of a differently ordered fp32 sum; bf16: at most one bf16 rounding step apart.
    rel = 1e-6 if dtype == torch.float32 else 2.0**-7
    _assert_close_rel(got[0], ref[0], rel, "S'")
    _assert_close_rel(got[1], ref[1], rel, "x")
    if dtype == torch.bfloat16:  # almost all elements are bit-identical
        assert (got[0] == ref[0]).float().mean() > 0.99
    for name, a, b in zip(("pre", "post", "comb"), got[2], ref[2]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernel_statistics_and_tiles(poisoned, dtype):
    """The raw kernel outputs, at tile sizes that leave partial tiles in tokens and channels."""
    y, S, mix, fn = _step_inputs(dtype, seed=0)
    n = S.shape[1]
    s_new, x, sumsq, raw = mhc_triton.mhc_step_fwd(y, S, mix, fn, block_t=16, block_d=32, num_warps=4)
    out = mix[:, :, :1] * y.float()[:, None] + mix[:, :, 1:] @ S.float()  # [N, n+1, D] in fp32
    ref_s = out[:, :n].to(dtype)
    _assert_close_rel(s_new, ref_s, 1e-6 if dtype == torch.float32 else 2.0**-7, "S'")
    _assert_close_rel(x, out[:, n].to(dtype), 1e-6 if dtype == torch.float32 else 2.0**-7, "x")
    u = s_new.float().flatten(1)  # the statistics are of the stored S'
    _assert_close_rel(sumsq, u.square().sum(1), 1e-6, "sum_sq")
    _assert_close_rel(raw, u.double() @ fn.double().t(), 3e-5, "raw")
    # Explicit out= buffers are written in place, element for element.
    bufs = tuple(torch.full_like(t, float("nan")) for t in (s_new, x, sumsq, raw))
    again = mhc_triton.mhc_step_fwd(y, S, mix, fn, block_t=16, block_d=32, num_warps=4, out=bufs)
    for a, b in zip(again, (s_new, x, sumsq, raw)):
        assert torch.equal(a, b)
    assert all(a is b for a, b in zip(again, bufs))


def test_last_layer_has_no_next_site(poisoned):
    y, S, post, comb, pre_lag = _inputs(1, 5, 4, 24, torch.float32, seed=3)
    coeffs = mhc.Coeffs(None, post, comb)
    ref = mhc.single_pass(y, S, coeffs, pre_lag, None)
    got = kern.mhc_single_pass(y, S, coeffs, pre_lag, None)
    assert got[2] is None
    _assert_close_rel(got[0], ref[0], 1e-6, "S'")
    _assert_close_rel(got[1], ref[1], 1e-6, "x")


def _grads(step, dtype, n, with_stats_loss=True):
    B, T, D = 2, 9, 40
    y, S, post, comb, pre_lag = _inputs(B, T, n, D, dtype, seed=11, requires_grad=True)
    nxt = _site(D, n, seed=2)
    s_new, x, c = step(y, S, mhc.Coeffs(None, post, comb), pre_lag, nxt)
    g = torch.Generator().manual_seed(5)
    loss = (s_new.float() * torch.randn(s_new.shape, generator=g).to(DEVICE)).sum()
    loss = loss + (x.float() * torch.randn(x.shape, generator=g).to(DEVICE)).sum()
    if with_stats_loss:
        loss = loss + sum((t * torch.randn(t.shape, generator=g).to(DEVICE)).sum() for t in c)
    loss.backward()
    leaves = (y, S, post, comb, pre_lag, nxt.fn, nxt.base, nxt.scale)
    return {name: (t.grad if t.grad is not None else torch.zeros_like(t))
            for name, t in zip(("y", "S", "post", "comb", "pre_lag", "fn", "base", "scale"), leaves)}


@pytest.mark.parametrize("n", [4, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_matches_reference(poisoned, n, dtype):
    ref = _grads(mhc.single_pass, dtype, n)
    got = _grads(kern.mhc_single_pass, dtype, n)
    for name in ref:
        assert got[name].dtype == ref[name].dtype, name
        # y, S gradients are stored in bf16 for bf16 streams: a few roundings apart (the reference rounds
        # its two contributions separately). Everything in fp32 agrees to the bf16x3 projection's ~1e-5.
        rel = 2.0**-6 if dtype == torch.bfloat16 and name in ("y", "S", "post", "comb") else 5e-5
        _assert_close_rel(got[name], ref[name], rel, f"grad {name}")


def test_backward_without_gradient_on_coefficients(poisoned):
    """Only S' and x carry gradient: the statistics' gradients arrive as None and count as zero."""
    ref = _grads(mhc.single_pass, torch.float32, 4, with_stats_loss=False)
    got = _grads(kern.mhc_single_pass, torch.float32, 4, with_stats_loss=False)
    for name in ref:
        _assert_close_rel(got[name], ref[name], 5e-5, f"grad {name}")
    assert got["fn"].abs().max() == 0 and got["y"].abs().max() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_split_over_channels_matches_one_program(poisoned, dtype):
    """The backward with each token block's channels spread over 2 or 3 programs (the last chunk partial): input
    gradients bit-equal, the mix gradient (partial sums added on the host) to fp32 rounding."""
    y, S, mix, fn = _step_inputs(dtype, seed=5)
    s_new = mhc_triton.mhc_step_fwd(y, S, mix, fn)[0]
    g = torch.Generator().manual_seed(6)
    g_s, g_x = (torch.randn(t.shape, generator=g).to(S.dtype).to(DEVICE) for t in (S, y))
    g_sumsq = torch.randn(S.shape[0], generator=g).to(DEVICE)
    g_raw = torch.randn(S.shape[0], fn.shape[0], generator=g).to(DEVICE)
    args = (y, S, mix, fn, s_new, g_s, g_x, g_sumsq, g_raw)
    one = mhc_triton.mhc_step_bwd(*args, block_d=16)
    for split in (2, 3):
        got = mhc_triton.mhc_step_bwd(*args, block_d=16, split_d=split)
        assert torch.equal(got[0], one[0]) and torch.equal(got[1], one[1]) and torch.equal(got[3], one[3])
        _assert_close_rel(got[2], one[2], 1e-6, f"grad mix, split_d={split}")


def test_bad_inputs():
    y, S, post, comb, pre_lag = _inputs(1, 3, 4, 16, torch.float32, seed=4)
    S3, y3 = S.reshape(3, 4, 16), y.reshape(3, 16)
    mix = torch.zeros(3, 5, 5, device=DEVICE)
    with pytest.raises(ValueError, match="y must be"):
        mhc_triton.mhc_step_fwd(y3[:2], S3, mix, None)
    with pytest.raises(ValueError, match="mix must be"):
        mhc_triton.mhc_step_fwd(y3, S3, mix[:, :4], None)
    with pytest.raises(ValueError, match="fn must be"):
        mhc_triton.mhc_step_fwd(y3, S3, mix, torch.zeros(24, 60, device=DEVICE))
    with pytest.raises(TypeError, match="bfloat16 or float32"):
        mhc_triton.mhc_step_fwd(y3.half(), S3, mix, None)
    with pytest.raises(ValueError, match="contiguous"):
        mhc_triton.mhc_step_fwd(y3, S3.transpose(0, 1).contiguous().transpose(0, 1), mix, None)
    site = _site(16, 4, seed=4)
    kw = dict(dim=16, norm_eps=site.norm_eps, eps=site.eps, sinkhorn_iters=site.sinkhorn_iters)
    raw, sumsq = torch.zeros(3, 24, device=DEVICE), torch.ones(3, device=DEVICE)
    with pytest.raises(ValueError, match="base must be"):
        mhc_coeffs_triton.next_coeffs(raw, sumsq, site.scale, site.base[:23], **kw)
    with pytest.raises(ValueError, match="raw must be"):
        mhc_coeffs_triton.next_coeffs(raw[:, :15], sumsq, site.scale, site.base, **kw)


def test_forward_configs_reach_every_switch():
    """The kept configurations include the default and turn on each code path of the kernel at least once."""
    cfgs = mhc_triton.FWD_CONFIGS
    assert mhc_triton.FWD_DEFAULT in cfgs
    assert any(c.get("split_d", 1) > 1 for c in cfgs.values()), "split_d"
    assert any(c.get("stream") for c in cfgs.values()), "stream"
    assert any(c.get("sq_tile") for c in cfgs.values()), "sq_tile"


@pytest.mark.parametrize("config", list(mhc_triton.FWD_CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_forward_config_matches_default(poisoned, dtype, config):
    """Each named tile configuration, at sizes that leave partial tiles and D chunks (D = 72 split 2 ways)."""
    y, S, mix, fn = _step_inputs(dtype, seed=7)
    ref = mhc_triton.mhc_step_fwd(y, S, mix, fn)  # FWD_DEFAULT
    got = mhc_triton.mhc_step_fwd(y, S, mix, fn, config=config)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])  # same fp32 arithmetic per element
    _assert_close_rel(got[2], ref[2], 1e-6, "sum_sq")
    _assert_close_rel(got[3], ref[3], 1e-6, "raw")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_keywords_override_config(poisoned, dtype):
    """Keywords override the named configuration: all switches at once, D = 72 split 3 ways in 16-wide tiles. S' and
    x within 1e-6 relative, not bit-equal: on the H200 this combination's fp32 outputs differed from the default's
    in the last bits (compiled arithmetic contracts differently; every named configuration is bit-equal above)."""
    y, S, mix, fn = _step_inputs(dtype, seed=7)
    ref = mhc_triton.mhc_step_fwd(y, S, mix, fn)
    got = mhc_triton.mhc_step_fwd(y, S, mix, fn, block_t=16, block_d=16, split_d=3, stream=True, sq_tile=True)
    for i, what in enumerate(("keywords S'", "keywords x")):
        print(what, "max |diff|", (got[i].float() - ref[i].float()).abs().max().item())
        _assert_close_rel(got[i], ref[i], 1e-6, what)
    _assert_close_rel(got[2], ref[2], 1e-6, "keywords sum_sq")
    _assert_close_rel(got[3], ref[3], 1e-6, "keywords raw")
    with pytest.raises(ValueError, match="config"):
        mhc_triton.mhc_step_fwd(y, S, mix, fn, config="t1_d1")


@pytest.mark.parametrize("n", [4, 3])
def test_coefficient_kernel_matches_site(poisoned, n):
    D, N = 24, 70  # N: one full and one partial token block
    site = _site(D, n, seed=n)
    g = torch.Generator().manual_seed(9)
    raw = (torch.randn(N, 2 * n + n * n, generator=g) * 3).to(DEVICE).requires_grad_()
    sumsq = (torch.rand(N, generator=g) * n * D + 1).to(DEVICE).requires_grad_()
    got = mhc_coeffs_triton.next_coeffs(raw, sumsq, site.scale, site.base, dim=site.dim, norm_eps=site.norm_eps,
                                        eps=site.eps, sinkhorn_iters=site.sinkhorn_iters)
    ref = site.coeffs_from_logits(raw * torch.rsqrt(sumsq[:, None] / (n * D) + site.norm_eps))
    for name, a, b in zip(("pre", "post", "comb"), got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    g_out = [torch.randn(t.shape, generator=g).to(DEVICE) for t in ref]
    leaves = (raw, sumsq, site.scale, site.base)
    got_g = torch.autograd.grad(got, leaves, g_out, retain_graph=True)
    ref_g = torch.autograd.grad(ref, leaves, g_out, retain_graph=True)
    for name, a, b in zip(("raw", "sum_sq", "scale", "base"), got_g, ref_g):
        _assert_close_rel(a, b, 1e-5, f"grad {name}")
    # Only comb carries gradient: the others arrive as None.
    got_g = torch.autograd.grad(got[2], leaves, g_out[2])
    ref_g = torch.autograd.grad(ref[2], leaves, g_out[2])
    # The comb-only gradients of `scale` and `base` are sums over tokens that cancel: measured against the sum of
    # their terms' sizes (another CPU's summation order moved scale's by 1.6e-4 of its own size). On a GPU the
    # kernel's exp (ex2.approx) and summation order differ from torch's; through 20 Sinkhorn steps the comb-only
    # gradient of `scale` then differs by up to ~7e-5 of its size.
    rel = 1e-5 if DEVICE == "cpu" else 2e-4
    terms = _token_term_sizes(site, raw, sumsq, g_out[2], n, D)
    for name, a, b in zip(("raw", "sum_sq", "scale", "base"), got_g, ref_g):
        _assert_close_rel(a, b, rel, f"comb-only grad {name}", terms.get(name, 0.0))


def test_pytorch_coefficient_path_still_matches():
    y, S, post, comb, pre_lag = _inputs(1, 5, 4, 24, torch.float32, seed=6)
    coeffs, nxt = mhc.Coeffs(None, post, comb), _site(24, 4, seed=3)
    a = kern.mhc_single_pass(y, S, coeffs, pre_lag, nxt, coeff_kernel=False)[2]
    b = kern.mhc_single_pass(y, S, coeffs, pre_lag, nxt)[2]
    for name, u, v in zip(("pre", "post", "comb"), a, b):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-6, msg=name)


def test_compiled_step_calls_the_operators_and_matches_eager():
    """Under torch.compile the fused step is the two opaque operators (cedar::mhc_step_fwd / _bwd), one graph, no
    break; gradients equal the eager kernels'. (Traced as user Triton kernels, their inline PTX would make Inductor
    copy every input before each launch.) coeff_kernel=False: the coefficient kernel is traced as a user kernel,
    which the interpreter cannot be."""
    from torch._dynamo.testing import CompileCounterWithBackend

    def step(y, S, coeffs, pre_lag, nxt):
        return kern.mhc_single_pass(y, S, coeffs, pre_lag, nxt, coeff_kernel=False)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    try:
        got = _grads(compiled, torch.float32, 4)
        # the autograd.Function is a higher-order operator: its forward and backward are subgraphs
        ops = {str(n.target) for g in counter.graphs for m in g.modules() if isinstance(m, torch.fx.GraphModule)
               for n in m.graph.nodes if n.op == "call_function"}
    finally:
        torch._dynamo.reset()
    ref = _grads(step, torch.float32, 4)
    assert counter.frame_count == 1 and {"cedar.mhc_step_fwd.default", "cedar.mhc_step_bwd.default"} <= ops, \
        sorted(ops)
    for name in ref:
        _assert_close_rel(got[name], ref[name], 1e-6, f"grad {name}")
