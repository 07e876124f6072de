"""Proves model/mhc.py computes REFERENCE A6 (mHC, single pass):

- `sinkhorn` follows A6 steps 6-8 step for step (softmax + eps, column-normalise, then row/column pairs, last step
  a column normalisation), is non-negative and column-stochastic for any logits (extreme ones included), and
  doubly stochastic within 1e-5 where 20 iterations suffice (moderate or permutation-like logits). It does not
  claim rows within 1e-5 after 20 iterations for arbitrary large logits: A6's fixed 20 steps do not get there
  (Sinkhorn converges slowly on near-decomposable matrices); the test shows rows keep converging with more steps.
- `HCSite` matches a literal per-token transcription of A6 steps 1-8 (slicing of the 2n + n^2 logits, row-major
  comb), returns fp32 coefficients with pre > 0 and 0 < post < 2 for fp32 and bf16 streams, keeps fp32
  parameters, builds on the meta device and initialises as A6 "Init" says.
- `collapse` / `expand` match hand-computed values; `init_streams` + `first_pre` give back the embedding.

The rest of what it proves: docs/testing.md#mhc
"""

from __future__ import annotations

import pytest
import torch

from model.config import MHCConfig
from model.mhc import (
    Coeffs,
    HCSite,
    collapse,
    enter,
    expand,
    first_pre,
    init_streams,
    mhc_step,
    single_pass,
    sinkhorn,
    unfused_step,
)

EPS = 1e-6
NORM_EPS = 1e-20


def _site(dim: int, n: int, seed: int, std: float = 0.1) -> HCSite:
    """A site with non-trivial base and scale, so that every slice of the logits matters."""
    site = HCSite(dim, MHCConfig(num_streams=n), norm_eps=NORM_EPS)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        site.fn.copy_(torch.randn(site.fn.shape, generator=g) * std)
        site.base.copy_(torch.randn(site.base.shape, generator=g) * 0.5)
        site.scale.copy_(1.0 + 0.3 * torch.randn(3, generator=g))
    return site


def _coeffs(B: int, T: int, n: int, seed: int) -> Coeffs:
    g = torch.Generator().manual_seed(seed)
    pre = torch.sigmoid(torch.randn(B, T, n, generator=g)) + EPS
    post = 2 * torch.sigmoid(torch.randn(B, T, n, generator=g))
    comb = sinkhorn(torch.randn(B, T, n, n, generator=g), 20, EPS)
    return Coeffs(pre, post, comb)


# ----------------------------------------------------------------------------------------------- sinkhorn


@pytest.mark.parametrize("shape", [(1, 1), (5, 2, 2), (3, 7, 3, 3), (64, 4, 4), (2, 3, 7, 7)])
@pytest.mark.parametrize("kind", ["normal", "large", "one_column", "huge"])
def test_sinkhorn_nonnegative_and_column_stochastic(shape, kind):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(shape, generator=g)
    if kind == "large":
        logits = logits * 30
    elif kind == "huge":
        logits = logits * 1e4
    elif kind == "one_column":  # every row wants column 0: the worst case for the row constraint
        logits = torch.full(shape, -1e4)
        logits[..., 0] = 1e4
    c = sinkhorn(logits, 20, EPS)
    assert c.dtype == torch.float32 and c.shape == logits.shape
    assert torch.isfinite(c).all()
    assert (c >= 0).all()
    torch.testing.assert_close(c.sum(-2), torch.ones(shape[:-1]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_sinkhorn_doubly_stochastic_on_moderate_logits(n):
    logits = torch.randn(500, n, n, generator=torch.Generator().manual_seed(n)) * 0.5
    c = sinkhorn(logits, 20, EPS)
    torch.testing.assert_close(c.sum(-1), torch.ones(500, n), atol=1e-5, rtol=0)
    torch.testing.assert_close(c.sum(-2), torch.ones(500, n), atol=1e-5, rtol=0)


@pytest.mark.parametrize("n", [2, 4, 5])
def test_sinkhorn_permutation_logits_give_the_permutation(n):
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(n))
    P = torch.eye(n)[perm]
    c = sinkhorn(1e4 * (2 * P - 1), 20, EPS)  # extreme logits, but a consistent pattern
    torch.testing.assert_close(c, P, atol=1e-5, rtol=0)
    torch.testing.assert_close(c.sum(-1), torch.ones(n), atol=1e-5, rtol=0)
    torch.testing.assert_close(c.sum(-2), torch.ones(n), atol=1e-5, rtol=0)


def test_sinkhorn_rows_keep_converging_on_extreme_logits():
    logits = torch.randn(200, 4, 4, generator=torch.Generator().manual_seed(3)) * 1e4
    errs = [(sinkhorn(logits, it, EPS).sum(-1) - 1).abs().max().item() for it in (20, 200, 2000)]
    assert errs[0] > errs[1] > errs[2]
    assert errs[2] < 1e-3


def test_sinkhorn_follows_the_a6_step_order():
    logits = torch.randn(6, 3, 3, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    soft = torch.softmax(logits.float(), -1) + EPS

    def col(c):
        return c / (c.sum(-2, keepdim=True) + EPS)

    def row(c):
        return c / (c.sum(-1, keepdim=True) + EPS)

    # iters counts column normalisations: one alone, then (row, column) pairs
    torch.testing.assert_close(sinkhorn(logits, 1, EPS), col(soft), atol=0, rtol=0)
    torch.testing.assert_close(sinkhorn(logits, 3, EPS), col(row(col(row(col(soft))))), atol=0, rtol=0)
    assert sinkhorn(logits, 1, EPS).dtype == torch.float32


# ----------------------------------------------------------------------------------------------- HCSite


def _site_literal(site: HCSite, S: torch.Tensor) -> Coeffs:
    """A6 steps 1-8 one token at a time, written from the text with explicit indices."""
    n, D = S.shape[-2], S.shape[-1]
    B, T = S.shape[:2]
    pre, post, comb = torch.empty(B, T, n), torch.empty(B, T, n), torch.empty(B, T, n, n)
    for b in range(B):
        for t in range(T):
            u = S[b, t].float().reshape(n * D)  # stream-major flatten
            u = u / torch.sqrt((u * u).mean() + NORM_EPS)
            m = site.fn @ u
            s0, s1, s2 = site.scale
            pre[b, t] = torch.sigmoid(m[0:n] * s0 + site.base[0:n]) + EPS
            post[b, t] = 2 * torch.sigmoid(m[n:2 * n] * s1 + site.base[n:2 * n])
            C = (m[2 * n:] * s2 + site.base[2 * n:]).reshape(n, n)
            for j in range(n):
                for k in range(n):
                    assert C[j, k] == m[2 * n + j * n + k] * s2 + site.base[2 * n + j * n + k]
            comb[b, t] = sinkhorn(C, 20, EPS)
    return Coeffs(pre, post, comb)


@torch.no_grad()
def test_hcsite_matches_literal_a6():
    n, D = 3, 10
    site = _site(D, n, seed=0)
    S = torch.randn(2, 3, n, D, generator=torch.Generator().manual_seed(1))
    got, want = site(S), _site_literal(site, S)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_hcsite_shapes_dtypes_ranges(dtype):
    B, T, n, D = 2, 7, 4, 40
    site = _site(D, n, seed=2, std=1.0)  # large logits, to push pre and post towards their bounds
    S = torch.randn(B, T, n, D, generator=torch.Generator().manual_seed(3)).to(dtype)
    c = site(S)
    assert isinstance(c, Coeffs)
    assert c.pre.shape == (B, T, n) and c.post.shape == (B, T, n) and c.comb.shape == (B, T, n, n)
    assert all(t.dtype == torch.float32 for t in c)
    assert (c.pre > 0).all()
    assert (c.post > 0).all() and (c.post < 2).all()
    assert (c.comb >= 0).all()
    torch.testing.assert_close(c.comb.sum(-2), torch.ones(B, T, n), atol=1e-5, rtol=0)


def test_hcsite_builds_on_meta_and_initialises():
    with torch.device("meta"):
        site = HCSite(64, MHCConfig(num_streams=4), norm_eps=NORM_EPS)
    assert site.fn.is_meta and site.fn.shape == (2 * 4 + 16, 4 * 64)
    assert site.base.shape == (24,) and site.scale.shape == (3,)
    assert all(p.dtype == torch.float32 for p in site.parameters())
    site.to_empty(device="cpu")
    torch.manual_seed(0)
    site.init_weights(init_std=0.02)
    assert abs(site.fn.std().item() - 0.02) < 1e-3 and abs(site.fn.mean().item()) < 1e-3
    assert (site.base == 0).all() and (site.scale == 1).all()


# ----------------------------------------------------------------------------------------------- pure ops


def test_collapse_expand_by_hand():
    S = torch.tensor([[1.0, 0.0], [0.0, 1.0]]).view(1, 1, 2, 2)  # S_0 = (1, 0), S_1 = (0, 1)
    y = torch.tensor([1.0, 2.0]).view(1, 1, 2)
    post = torch.tensor([0.5, 1.5]).view(1, 1, 2)
    comb = torch.tensor([[0.25, 0.5], [0.75, 0.5]]).view(1, 1, 2, 2)  # comb[j, k]; asymmetric on purpose
    out = expand(y, S, post, comb)
    # out_0 = 0.5 y + 0.25 S_0 + 0.75 S_1 ; out_1 = 1.5 y + 0.5 S_0 + 0.5 S_1
    torch.testing.assert_close(out[0, 0], torch.tensor([[0.75, 1.75], [2.0, 3.5]]), atol=0, rtol=0)
    x = collapse(out, torch.tensor([0.25, 0.75]).view(1, 1, 2))
    torch.testing.assert_close(x[0, 0], torch.tensor([1.6875, 3.0625]), atol=0, rtol=0)
    assert expand(y.bfloat16(), S.bfloat16(), post, comb).dtype == torch.bfloat16
    assert collapse(S.bfloat16(), post).dtype == torch.bfloat16


def test_init_streams_and_first_pre_return_the_embedding():
    h = torch.randn(2, 5, 12).bfloat16()
    S = init_streams(h, 4)
    assert S.shape == (2, 5, 4, 12) and S.is_contiguous() and S.dtype == torch.bfloat16
    assert all(torch.equal(S[:, :, k], h) for k in range(4))
    pre = first_pre(4)
    assert pre.dtype == torch.float32 and pre.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert first_pre(4, batch_shape=(2, 5)).shape == (2, 5, 4)
    site = _site(12, 4, seed=0)
    x, c = enter(S, pre, site)
    assert torch.equal(x, h)
    assert torch.equal(c.comb, site(S).comb)


# ----------------------------------------------------------------------------------------------- single pass


@pytest.mark.parametrize("B,T,n,D", [(2, 7, 4, 40), (1, 5, 3, 33), (3, 1, 1, 8)])
@torch.no_grad()
def test_single_pass_equals_unfused_fp32(B, T, n, D):
    g = torch.Generator().manual_seed(B * 100 + D)
    y, S = torch.randn(B, T, D, generator=g), torch.randn(B, T, n, D, generator=g)
    coeffs, pre_lag = _coeffs(B, T, n, seed=1), _coeffs(B, T, n, seed=2).pre
    site = _site(D, n, seed=3)
    S1, x1, c1 = single_pass(y, S, coeffs, pre_lag, site)
    S2, x2, c2 = unfused_step(y, S, coeffs, pre_lag, site)
    # 1e-6 absolute plus 1e-6 relative: |x| reaches ~8, where one fp32 ulp is already 1e-6
    torch.testing.assert_close(S1, S2, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(x1, x2, atol=1e-6, rtol=1e-6)
    for a, b in zip(c1, c2):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    # without a next site (the last layer) only the coefficients are dropped
    S3, x3, c3 = single_pass(y, S, coeffs, pre_lag, None)
    assert c3 is None and torch.equal(S3, S1) and torch.equal(x3, x1)


@torch.no_grad()
def test_single_pass_equals_unfused_bf16():
    B, T, n, D = 2, 7, 4, 40
    g = torch.Generator().manual_seed(7)
    y = torch.randn(B, T, D, generator=g).bfloat16()
    S = torch.randn(B, T, n, D, generator=g).bfloat16()
    coeffs, pre_lag = _coeffs(B, T, n, seed=4), _coeffs(B, T, n, seed=5).pre
    site = _site(D, n, seed=6)
    S1, x1, c1 = single_pass(y, S, coeffs, pre_lag, site)
    S2, x2, c2 = unfused_step(y, S, coeffs, pre_lag, site)
    assert S1.dtype == x1.dtype == torch.bfloat16
    # streams: same fp32 sum, one rounding; x: the single pass skips the rounding of S' (<= a few bf16 ulps)
    torch.testing.assert_close(S1.float(), S2.float(), atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(x1.float(), x2.float(), atol=3e-2, rtol=2e-2)
    # both predict from the same stored (rounded) streams
    for a, b in zip(c1, c2):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_single_pass_gradients_equal_unfused():
    B, T, n, D = 2, 7, 4, 40
    g = torch.Generator().manual_seed(11)
    y0, S0 = torch.randn(B, T, D, generator=g), torch.randn(B, T, n, D, generator=g)
    c0, pre0 = _coeffs(B, T, n, seed=12), _coeffs(B, T, n, seed=13).pre
    w_S, w_x = torch.randn(B, T, n, D, generator=g), torch.randn(B, T, D, generator=g)
    w_c = [torch.randn(t.shape, generator=g) for t in c0]
    site = _site(D, n, seed=14)

    def grads(step):
        y, S = y0.clone().requires_grad_(), S0.clone().requires_grad_()
        post, comb = c0.post.clone().requires_grad_(), c0.comb.clone().requires_grad_()
        pre_lag = pre0.clone().requires_grad_()
        S_new, x, nc = step(y, S, Coeffs(c0.pre, post, comb), pre_lag, site)
        loss = (S_new * w_S).sum() + (x * w_x).sum() + sum((a * w).sum() for a, w in zip(nc, w_c))
        inputs = [y, S, post, comb, pre_lag, site.fn, site.base, site.scale]
        return torch.autograd.grad(loss, inputs)

    names = ["y", "S", "post", "comb", "pre_lag", "fn", "base", "scale"]
    for name, a, b in zip(names, grads(single_pass), grads(unfused_step)):
        assert a.abs().max() > 0, name  # every input actually reaches the loss
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"grad {name}: {m}")


@torch.no_grad()
def test_single_pass_honours_the_lag():
    """Hand-computed: x must be collapsed with pre_lag, not with the pre that the next site predicts."""
    S = torch.tensor([[1.0, 0.0], [0.0, 1.0]]).view(1, 1, 2, 2)
    y = torch.tensor([1.0, 2.0]).view(1, 1, 2)
    coeffs = Coeffs(pre=torch.tensor([0.25, 0.75]).view(1, 1, 2),
                    post=torch.tensor([0.5, 1.5]).view(1, 1, 2),
                    comb=torch.tensor([[0.25, 0.5], [0.75, 0.5]]).view(1, 1, 2, 2))
    site = HCSite(2, MHCConfig(num_streams=2), norm_eps=NORM_EPS)
    site.init_weights(init_std=0.0)  # fn = 0, base = 0: the next site predicts pre = 0.5 + eps everywhere
    for step in (single_pass, unfused_step):
        S_new, x, nc = step(y, S, coeffs, coeffs.pre, site)
        torch.testing.assert_close(S_new[0, 0], torch.tensor([[0.75, 1.75], [2.0, 3.5]]), atol=1e-7, rtol=0)
        # x = 0.25 * (0.75, 1.75) + 0.75 * (2.0, 3.5); the new pre would give 0.5 * sum = (1.375, 2.625)
        torch.testing.assert_close(x[0, 0], torch.tensor([1.6875, 3.0625]), atol=1e-6, rtol=0)
        torch.testing.assert_close(nc.pre, torch.full((1, 1, 2), 0.5 + EPS), atol=1e-7, rtol=0)


def test_mhc_step_dispatch():
    B, T, n, D = 1, 3, 2, 6
    y, S = torch.randn(B, T, D), torch.randn(B, T, n, D)
    coeffs, site = _coeffs(B, T, n, seed=0), _site(D, n, seed=1)
    for impl, fn in (("single_pass", single_pass), ("unfused", unfused_step)):
        got, want = mhc_step(impl, y, S, coeffs, coeffs.pre, site), fn(y, S, coeffs, coeffs.pre, site)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="mhc.impl"):
        mhc_step("fused", y, S, coeffs, coeffs.pre, site)


@torch.no_grad()
def test_unbatched_pre_lag_and_autocast_keep_fp32():
    """first_pre() has no batch dims and must broadcast; a bf16 autocast region must not demote the site."""
    B, T, n, D = 2, 3, 4, 16
    y, S = torch.randn(B, T, D), torch.randn(B, T, n, D)
    coeffs, site = _coeffs(B, T, n, seed=0), _site(D, n, seed=1)
    got, want = single_pass(y, S, coeffs, first_pre(n), site), unfused_step(y, S, coeffs, first_pre(n), site)
    torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        in_autocast = single_pass(y, S, coeffs, coeffs.pre, site)[2]
    outside = single_pass(y, S, coeffs, coeffs.pre, site)[2]
    for a, b in zip(in_autocast, outside):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------- the layer loop


@pytest.mark.parametrize("impl", ["single_pass", "unfused"])
@torch.no_grad()
def test_documented_layer_loop_matches_literal_a6(impl):
    B, T, n, D, L = 2, 5, 4, 24, 3
    g = torch.Generator().manual_seed(21)
    h = torch.randn(B, T, D, generator=g)
    sites = [(_site(D, n, seed=2 * i), _site(D, n, seed=2 * i + 1)) for i in range(L)]
    mats = [torch.randn(D, D, generator=g) / D ** 0.5 for _ in range(2 * L + 1)]
    attn = [lambda x, w=mats[2 * i]: torch.tanh(x @ w) for i in range(L)]  # stand-ins for the sub-blocks
    ffn = [lambda x, w=mats[2 * i + 1]: torch.tanh(x @ w) for i in range(L)]
    engram = {1: lambda S, w=mats[-1]: S + torch.sigmoid(S @ w)}  # acts at layer 1's entry

    # literal A6 "The lag"
    S, pre_prev = init_streams(h, n), first_pre(n)
    for i in range(L):
        if i in engram:
            S = engram[i](S)
        c_a = sites[i][0](S)
        S = expand(attn[i](collapse(S, pre_prev)), S, c_a.post, c_a.comb)
        c_f = sites[i][1](S)
        S = expand(ffn[i](collapse(S, c_a.pre)), S, c_f.post, c_f.comb)
        pre_prev = c_f.pre
    want = collapse(S, pre_prev)

    # the loop documented in model/mhc.py
    S = init_streams(h, n)
    x, c_attn = enter(S, first_pre(n), sites[0][0])
    for i in range(L):
        a = attn[i](x)
        S, x, c_ffn = mhc_step(impl, a, S, c_attn, c_attn.pre, sites[i][1])
        f = ffn[i](x)
        nxt = i + 1 if i + 1 < L else None
        if nxt in engram:
            S = engram[nxt](expand(f, S, c_ffn.post, c_ffn.comb))
            x, c_attn = enter(S, c_ffn.pre, sites[nxt][0])
        else:
            S, x, c_attn = mhc_step(impl, f, S, c_ffn, c_ffn.pre, sites[nxt][0] if nxt is not None else None)
    torch.testing.assert_close(x, want, atol=1e-5, rtol=1e-5)
