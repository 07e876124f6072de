"""Proves model/moe.py computes REFERENCE A7's MoE and balances load.

- Router: scores are sqrt(softplus(logits)); the bias (text or image) changes which experts are picked but not
  their weights; weights sum to routed_scale.
- Dispatch/combine round trip is exact; their row gathers' gradients (a gather through the inverse permutation, not
  index_select's scatter-add) equal index_select's: exactly for a permutation, to fp32 rounding for k copies, and
  closer to the fp64 sum than a bf16 scatter-add; dispatch+experts+combine (loop and grouped-GEMM paths) and the full
  forward match a naive per-token loop at awkward sizes; the SwiGLU clamps are active on large inputs.
- Aux-loss-free balancing: load counters split by modality; update_bias moves a skewed router toward balance.
- Sequence-wise balance loss has its hand-computed value and trains the router.
- Gradients reach every weight but not the balancing biases; the module builds on the meta device.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from model.config import MoEConfig
from model.moe import MoE, clamped_swiglu, gather_rows, inverse_permutation


def make_moe(dim=24, num_experts=5, k=2, hidden=10, shared=1, seed=0, std=0.2, **kw) -> MoE:
    cfg = MoEConfig(num_experts=num_experts, num_shared_experts=shared, experts_per_token=k,
                    expert_dim=hidden, **kw)
    torch.manual_seed(seed)
    moe = MoE(dim, cfg, init_std=std)
    moe.init_weights()
    return moe


def naive_hidden(x, w1, w3, limit):
    """One token's clamped SwiGLU hidden activation [F], written out independently of the module."""
    g, u = w1 @ x, w3 @ x
    return F.silu(torch.minimum(g, torch.tensor(limit))) * torch.clamp(u, -limit, limit)


def naive_routed(moe: MoE, x_flat: torch.Tensor, weights, idx) -> torch.Tensor:
    """Token by token, pick by pick: sum_k w_k * w2[e] (silu(clamp(w1[e] x)) * clamp(w3[e] x))."""
    ex = moe.experts
    out = torch.zeros_like(x_flat)
    for n in range(x_flat.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[n, j])
            a = naive_hidden(x_flat[n], ex.w1[e], ex.w3[e], moe.cfg.swiglu_limit)
            out[n] += ex.w2[e] @ (weights[n, j] * a)
    return out


def naive_shared(moe: MoE, x_flat: torch.Tensor) -> torch.Tensor:
    s = moe.shared_experts
    rows = []
    for n in range(x_flat.shape[0]):
        rows.append(s.w2.weight @ naive_hidden(x_flat[n], s.w1.weight, s.w3.weight, moe.cfg.swiglu_limit))
    return torch.stack(rows)


def identity_router_moe(num_experts=4, k=2, scale=1.5) -> MoE:
    """dim == E and gate.weight = I, so the router logits are x itself."""
    moe = make_moe(dim=num_experts, num_experts=num_experts, k=k, routed_scale=scale)
    with torch.no_grad():
        moe.gate.weight.copy_(torch.eye(num_experts))
    return moe


def test_router_scores_and_bias_affects_selection_only():
    moe = identity_router_moe()
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    scores = F.softplus(logits).sqrt()
    w, idx, s = moe.gate(logits)
    torch.testing.assert_close(s, scores, rtol=0, atol=0)
    assert sorted(idx[0].tolist()) == [0, 1]
    # A bias on expert 3 flips the second pick from expert 1 to expert 3 ...
    moe.gate.bias[3] = 5.0
    w, idx, _ = moe.gate(logits)
    order = idx[0].argsort()
    assert idx[0][order].tolist() == [0, 3]
    # ... but the weights are the unbiased scores of {0, 3}, normalised, times routed_scale.
    expect = scores[0, [0, 3]] / scores[0, [0, 3]].sum() * 1.5
    torch.testing.assert_close(w[0][order], expect, rtol=1e-6, atol=0)


def test_weights_sum_to_routed_scale():
    moe = make_moe(routed_scale=2.5)
    x = torch.randn(7, 24)
    w, idx, _ = moe.gate(x)
    torch.testing.assert_close(w.sum(-1), torch.full((7,), 2.5), rtol=1e-6, atol=0)
    assert w.dtype == torch.float32 and idx.shape == (7, 2)
    assert (idx[:, 0] != idx[:, 1]).all()


def test_image_tokens_use_bias_image():
    moe = identity_router_moe()
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]] * 4)
    image = torch.tensor([False, True, False, True])
    moe.gate.bias_image[2] = 5.0  # only image tokens are pushed to expert 2
    _, idx, _ = moe.gate(logits, image)
    for n in range(4):
        assert (2 in idx[n].tolist()) == bool(image[n])
    # The loads split by modality: text picks {0, 1} twice, image picks {0, 2} twice. A forward returns them and
    # leaves the counters alone; add_load (what the trainer's forward does) counts them.
    _, load, _ = moe(logits.view(1, 4, 4), image.view(1, 4))
    assert torch.equal(load, torch.tensor([[2, 2, 0, 0], [2, 0, 2, 0]]))
    assert moe.load_text.sum() == 0 and moe.load_image.sum() == 0
    moe.add_load(load)
    assert moe.load_text.tolist() == [2, 2, 0, 0]
    assert moe.load_image.tolist() == [2, 0, 2, 0]
    torch.testing.assert_close(moe.load_counts(), torch.tensor([[2, 2, 0, 0], [2, 0, 2, 0]]))


def test_dispatch_combine_round_trip_is_exact():
    moe = make_moe()
    x = torch.randn(7, 24)
    w, idx, _ = moe.gate(x)
    xs, ws, tpe, order = moe.dispatch(x, idx, w)
    assert tpe.dtype == torch.int64 and tpe.sum() == 14 and tpe.shape == (5,)
    # Rows are grouped by expert, in expert order.
    assert torch.equal(idx.reshape(-1)[order], torch.repeat_interleave(torch.arange(5), tpe))
    # Identity experts: each copy returns weight * x, and combine sums a token's copies to routed_scale * x.
    out = moe.combine(xs * ws[:, None], order, 7)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, 1.5 * x, rtol=1e-6, atol=1e-6)
    # Without weights the round trip is bit exact: K copies of x.
    assert torch.equal(moe.combine(xs, order, 7), 2 * x)


@pytest.mark.parametrize("copies", [1, 3])
def test_gather_rows_gradient_equals_index_select(copies):
    torch.manual_seed(0)
    rows, d = 11, 6
    perm = torch.randperm(rows * copies)
    x = torch.randn(rows, d, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(rows * copies, d, dtype=torch.float64)
    out = gather_rows(x, perm, copies=copies)
    assert torch.equal(out, x.index_select(0, perm // copies))
    (g,) = torch.autograd.grad(out, x, grad)
    (ref,) = torch.autograd.grad(x.index_select(0, perm // copies), x, grad)
    assert torch.allclose(g, ref, rtol=0, atol=1e-12)
    assert torch.equal(inverse_permutation(perm)[perm], torch.arange(rows * copies))
    # bf16 gradients: the k copies are summed in fp32 and rounded once
    xb = x.detach().bfloat16().requires_grad_()
    (gb,) = torch.autograd.grad(gather_rows(xb, perm, copies=copies), xb, grad.bfloat16())
    exact = torch.zeros(rows, d, dtype=torch.float64).index_add_(0, perm // copies, grad.bfloat16().double())
    assert gb.dtype == torch.bfloat16
    # one rounding of the fp32 sum: within half a bf16 step of the exact sum (a bf16 scatter-add rounds k times)
    assert ((gb.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-30).all()


@pytest.mark.parametrize("grouped", [False, True])
def test_experts_match_naive_per_token_loop(grouped):
    # T=7, D=24, E=5, k=2; the grouped GEMM (CPU fallback) needs 16-byte rows, hence F=12 there.
    moe = make_moe(hidden=12 if grouped else 10)
    moe.experts.path = "grouped" if grouped else "loop"
    x = torch.randn(7, 24)
    w, idx, _ = moe.gate(x)
    with torch.no_grad():
        xs, ws, tpe, order = moe.dispatch(x, idx, w)
        got = moe.combine(moe.experts_forward(xs, ws, tpe), order, 7)
        ref = naive_routed(moe, x, w, idx)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


def test_forward_matches_naive_with_two_shared_experts():
    moe = make_moe(shared=2)
    assert moe.shared_experts.w1.weight.shape == (20, 24)  # two experts fused: width 2 * F
    x = torch.randn(1, 7, 24)
    with torch.no_grad():
        out, _, _ = moe(x)
        w, idx, _ = moe.gate(x[0])
        ref = naive_routed(moe, x[0], w, idx) + naive_shared(moe, x[0])
    torch.testing.assert_close(out[0], ref, rtol=1e-6, atol=1e-6)


def test_clamps_active_on_large_inputs():
    g = torch.tensor([30.0, -30.0, 5.0])
    u = torch.tensor([50.0, 50.0, -50.0])
    a = clamped_swiglu(g, u, 10.0)
    torch.testing.assert_close(a, torch.stack([F.silu(torch.tensor(10.0)) * 10, F.silu(torch.tensor(-30.0)) * 10,
                                               F.silu(torch.tensor(5.0)) * -10]))
    # Through the module: huge inputs drive both g and u past the limit, the output matches the naive clamped
    # reference, and the shared expert is far from its unclamped value.
    moe = make_moe(std=1.0)
    x = 50 * torch.randn(14, 24)
    s = moe.shared_experts
    with torch.no_grad():
        assert (s.w1(x) > 10).any() and (s.w3(x).abs() > 10).any()
        out = moe(x.view(2, 7, 24))[0].view(14, 24)
        w, idx, _ = moe.gate(x)
        ref = naive_routed(moe, x, w, idx) + naive_shared(moe, x)
        unclamped = s.w2(F.silu(s.w1(x)) * s.w3(x))
        assert (s(x) - unclamped).abs().max() > 0.5 * unclamped.abs().max()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-3)


def test_bias_update_balances_skewed_router():
    dim, e = 16, 8
    moe = make_moe(dim=dim, num_experts=e, k=2, hidden=4, bias_update_rate=0.01)
    # Skew: every token shares a component along v, and expert i's router row leans on v by i / 2, so
    # high-numbered experts win most tokens.
    gen = torch.Generator().manual_seed(1)
    v = F.normalize(torch.randn(dim, generator=gen), dim=0)
    with torch.no_grad():
        moe.gate.weight.mul_(0.1).add_(torch.arange(e, dtype=torch.float32)[:, None] / 2 * v)

    def batch(n):
        return torch.randn(1, n, dim, generator=gen) + 2 * v

    def load(n):
        return moe(batch(n))[1]

    with torch.no_grad():
        before = moe.imbalance(load(2048))  # large held-out batches measure the load with little sampling noise
        for _ in range(200):  # "training": fresh small batches, one bias update each
            moe.add_load(load(256))
            moe.update_bias()
        after = moe.imbalance(load(2048))
    assert before > 3.0, before
    assert after < 1.6, after
    # Experts that were overloaded end with the smaller bias.
    assert moe.gate.bias[-1] < moe.gate.bias[0]
    assert torch.equal(moe.gate.bias_image, torch.zeros(e))  # no image tokens: no image update


def test_update_bias_rule_with_external_counts():
    moe = make_moe(num_experts=4)
    moe.load_text += torch.tensor([1, 1, 1, 1])  # local counters are reset even when counts are given
    counts = torch.tensor([[10, 0, 5, 1], [0, 0, 0, 0]])  # text mean 4; image saw nothing
    assert moe.imbalance(counts) == pytest.approx(2.5)
    moe.update_bias(rate=0.1, counts=counts)
    torch.testing.assert_close(moe.gate.bias, torch.tensor([-0.1, 0.1, -0.1, 0.1]))
    torch.testing.assert_close(moe.gate.bias_image, torch.zeros(4))
    assert moe.load_text.sum() == 0 and moe.load_image.sum() == 0


def test_sequence_balance_loss_hand_value_and_gradient():
    e, k, t = 4, 2, 2
    moe = identity_router_moe(num_experts=e, k=k)
    moe.cfg.seq_aux_loss_coef = 0.5
    logits = torch.tensor([[[2.0, 1.0, 0.5, -1.0], [0.0, 3.0, -2.0, 1.0]]])  # B=1, T=2
    _, _, balance = moe(logits)
    # Picks: token 0 -> {0, 1}, token 1 -> {1, 3}; f = E/(K*T) * counts = [1, 2, 0, 1].
    s = F.softplus(logits[0]).sqrt()
    p = (s / s.sum(-1, keepdim=True)).mean(0)
    expect = 0.5 * (torch.tensor([1.0, 2.0, 0.0, 1.0]) * p).sum()
    torch.testing.assert_close(balance, expect, rtol=1e-6, atol=0)
    balance.backward()
    assert moe.gate.weight.grad is not None and moe.gate.weight.grad.abs().sum() > 0
    # Off by default.
    off = make_moe()
    assert off(torch.randn(1, 3, 24))[2] is None


def test_gradients_reach_weights_not_biases():
    moe = make_moe(seq_aux_loss_coef=0.0)
    x = torch.randn(2, 7, 24, requires_grad=True)
    image = torch.zeros(2, 7, dtype=torch.bool)
    image[1, 3:] = True
    (moe(x, image)[0] * torch.randn(2, 7, 24)).sum().backward()
    for name in ("gate.weight", "experts.w1", "experts.w2", "experts.w3",
                 "shared_experts.w1.weight", "shared_experts.w2.weight", "shared_experts.w3.weight"):
        g = moe.get_parameter(name).grad
        assert g is not None and g.abs().sum() > 0, name
    assert x.grad is not None
    # The balancing biases are state, not trainable: not parameters, no grad, but saved in the state dict.
    names = {n for n, _ in moe.named_parameters()}
    assert "gate.bias" not in names and "gate.bias_image" not in names
    assert not moe.gate.bias.requires_grad and moe.gate.bias.grad is None
    sd = moe.state_dict()
    assert sd["gate.bias"].dtype == torch.float32 and "gate.bias_image" in sd
    assert "load_text" not in sd and "load_image" not in sd


def test_bf16_forward_dtype():
    moe = make_moe().to(torch.bfloat16)
    x = torch.randn(2, 7, 24, dtype=torch.bfloat16)
    out = moe(x)[0]
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    # Same (bf16-valued) weights in fp32: the router runs in fp32 in both, so the picks agree and only the
    # expert GEMMs' rounding differs.
    ref = copy.deepcopy(moe).float()(x.float())[0]
    torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.02 * ref.abs().max().item())


def test_meta_build_shapes():
    cfg = MoEConfig()  # flagship: 384 experts of 2304, one shared, top-6
    with torch.device("meta"):
        moe = MoE(5120, cfg, init_std=0.02)
    assert moe.gate.weight.shape == (384, 5120) and moe.gate.bias.shape == (384,)
    assert moe.gate.bias.dtype == torch.float32 and moe.gate.bias_image.shape == (384,)
    assert moe.experts.w1.shape == (384, 2304, 5120) and moe.experts.w3.shape == (384, 2304, 5120)
    assert moe.experts.w2.shape == (384, 5120, 2304)
    assert moe.shared_experts.w1.weight.shape == (2304, 5120)
    assert moe.shared_experts.w2.weight.shape == (5120, 2304)
    assert all(p.is_meta for p in moe.parameters())
    routed = sum(p.numel() for p in moe.experts.parameters())
    assert routed == 384 * 3 * 2304 * 5120  # x 40 layers = 543.6B (SPEC 4)
    assert math.isclose(routed * 40 / 1e9, 543.6, abs_tol=0.05)
    # to_empty + init_weights gives a usable module.
    small = make_moe()
    with torch.device("meta"):
        m = MoE(24, small.cfg, init_std=0.02)
    m.to_empty(device="cpu")
    m.init_weights()
    assert m.load_text.sum() == 0 and torch.equal(m.gate.bias, torch.zeros(5))
    assert torch.isfinite(m(torch.randn(1, 3, 24))[0]).all()


@pytest.mark.parametrize("forced", [False, True])
def test_sync_free_experts_match_the_loop_in_both_passes_without_host_reads(forced, monkeypatch):
    """The sync-free paths (grouped GEMMs, torch._grouped_mm with device-side group ends; the padded batched GEMM of
    a CUDA graph where the grouped one does not apply) equal the per-expert loop in the output and in every
    gradient, with experts that receive no token (forced: every token to experts 0 and 3), and read nothing on the
    host: no .tolist() / .item() in their forward or backward (what lets torch.compile capture them whole and a CUDA
    graph replay them)."""
    moe = make_moe(hidden=12)
    gen = torch.Generator().manual_seed(3)
    x0 = torch.randn(2, 7, 24, generator=gen)
    probe = torch.randn(2, 7, 24, generator=gen)
    experts = torch.tensor([0, 3]).expand(2, 7, 2) if forced else None
    got = {}
    for path in ("loop", "grouped", "padded"):
        moe.experts.path = path
        moe.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        with monkeypatch.context() as m:
            if path != "loop":
                for name in ("tolist", "item"):
                    m.setattr(torch.Tensor, name, lambda *a, _n=name, **k: pytest.fail(f"host read: Tensor.{_n}"))
            y, load, _ = moe(x, experts=experts)
            (y * probe).sum().backward()
        got[path] = (y.detach(), x.grad, {n: p.grad.clone() for n, p in moe.named_parameters()}, load)
    y_l, gx_l, g_l, load_l = got["loop"]
    for path in ("grouped", "padded"):
        y_g, gx_g, g_g, load_g = got[path]
        torch.testing.assert_close(y_g, y_l, rtol=1e-6, atol=1e-6, msg=path)
        torch.testing.assert_close(gx_g, gx_l, rtol=1e-5, atol=1e-6, msg=path)
        assert g_g.keys() == g_l.keys()
        for n in g_l:
            torch.testing.assert_close(g_g[n], g_l[n], rtol=1e-5, atol=1e-6, msg=f"{path}: {n}")
        assert torch.equal(load_g, load_l)
        if forced:  # the experts no token reached get an exact zero gradient
            assert torch.count_nonzero(g_g["experts.w1"][[1, 2, 4]]) == 0, path


def test_router_scores_stay_fp32_under_bf16_autocast():
    """The router's logits are fp32 as the reference's: a bf16 autocast region does not round them (an upcast of
    the inputs alone does not keep F.linear out of autocast)."""
    torch.manual_seed(0)
    moe = make_moe(dim=64, num_experts=8, k=2)
    x = torch.randn(16, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = moe.gate.scores(x)
    assert inside.dtype == torch.float32 and torch.equal(inside, moe.gate.scores(x))
