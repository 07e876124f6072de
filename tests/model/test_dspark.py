"""DSpark, the drafter (model/dspark.py): the block sees exactly the context before its anchor and its own slots,
anchors batched equal anchors alone, the Markov and confidence heads are what B6 says, the loss's acceptance
figures, no gradient into the frozen backbone, and the planner's counts of the flagship's drafter."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from model.accounting import dspark_parameters
from model.dspark import DSpark, acceptance_length, draft_loss, drafter_config, stream_means
from tests.helpers import build_tiny, load_config

T = 48  # > the tiny drafter's window (32), so windows are cut


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    backbone = build_tiny(seed=1).eval()
    for p in backbone.parameters():
        p.requires_grad_(False)
    cfg = backbone.cfg
    drafter = DSpark(cfg)
    drafter.init_weights()
    with torch.no_grad():
        drafter.markov_out.weight.normal_(0, 0.02)  # (zero at init: make the Markov term matter)
    ids = torch.randint(0, cfg.vocab_size, (2, T))
    with torch.no_grad(), stream_means(backbone, cfg.dspark.target_layers) as means:
        logits = backbone(ids)
    return backbone, drafter, ids, means, logits


def _block(drafter, backbone, main_x, ids, anchors):
    K = drafter.cfg.dspark.block_size
    at = ids.gather(1, anchors)
    nxt = (anchors[..., None] + torch.arange(K)).clamp_max(ids.shape[1] - 1)
    prev = ids.gather(1, nxt.flatten(1)).unflatten(1, nxt.shape[1:])
    return drafter(backbone.embed, backbone.head, main_x, anchors, at, prev), prev


def test_stream_means_are_the_residual_entering_each_target_layer(setup):
    backbone, drafter, ids, means, _ = setup
    assert sorted(means) == list(backbone.cfg.dspark.target_layers)
    seen = {}
    h = backbone.layers[10].register_forward_pre_hook(lambda m, a: seen.update(S=a[0]))
    with torch.no_grad():
        backbone(ids)
    h.remove()
    assert torch.equal(means[10], seen["S"].mean(dim=-2))


def test_the_block_sees_the_context_before_its_anchor_and_nothing_after(setup):
    backbone, drafter, ids, means, _ = setup
    W = drafter.cfg.dspark.window
    main_x = drafter.context(means).detach()
    anchors = torch.tensor([[40, 3], [20, 0]])
    with torch.no_grad():
        base, _ = _block(drafter, backbone, main_x, ids, anchors)
        # the anchor's own position and everything after it, and everything before its window: not seen
        changed = main_x.clone()
        changed[0, 40:] += 1.0
        changed[0, :40 - W] += 1.0
        out, _ = _block(drafter, backbone, changed, ids, anchors)
        assert torch.allclose(out.logits[0, 0], base.logits[0, 0], atol=1e-5, rtol=0)
        # the last context position is seen
        edge = main_x.clone()
        edge[0, 39] += 1.0
        out, _ = _block(drafter, backbone, edge, ids, anchors)
        assert (out.logits[0, 0] - base.logits[0, 0]).abs().max() > 1e-3
        # so is the first of the window, and nothing before position 0 (anchor 0 has no context at all)
        edge = main_x.clone()
        edge[0, 40 - W] += 1.0
        out, _ = _block(drafter, backbone, edge, ids, anchors)
        assert (out.logits[0, 0] - base.logits[0, 0]).abs().max() > 1e-3
        edge = main_x.clone()
        edge[1] += 1.0
        out, _ = _block(drafter, backbone, edge, ids, anchors)
        assert torch.allclose(out.logits[1, 1], base.logits[1, 1], atol=1e-5, rtol=0)


def test_slots_see_each_other_inside_the_block(setup):
    """Non-causal inside the block: the last slot's token reaches the first slot's draft."""
    backbone, drafter, ids, means, _ = setup
    main_x = drafter.context(means).detach()
    anchors = torch.tensor([[30]])
    with torch.no_grad():
        base, _ = _block(drafter, backbone, main_x[:1], ids[:1], anchors)
        old = drafter.cfg.dspark.noise_token
        drafter.cfg.dspark.noise_token = (old + 7) % drafter.cfg.vocab_size
        try:
            out, _ = _block(drafter, backbone, main_x[:1], ids[:1], anchors)
        finally:
            drafter.cfg.dspark.noise_token = old
    assert (out.hidden[0, 0, 0] - base.hidden[0, 0, 0]).abs().max() > 1e-4


def test_anchors_together_equal_anchors_alone(setup):
    backbone, drafter, ids, means, _ = setup
    main_x = drafter.context(means).detach()
    anchors = torch.tensor([[0, 7, 31, 44], [12, 33, 45, 2]])
    with torch.no_grad():
        together, prev = _block(drafter, backbone, main_x, ids, anchors)
        for b in range(2):
            for a in range(4):
                alone, _ = _block(drafter, backbone, main_x[b:b + 1], ids[b:b + 1], anchors[b:b + 1, a:a + 1])
                assert torch.allclose(alone.logits[0, 0], together.logits[b, a], atol=1e-5, rtol=1e-5)
                assert torch.allclose(alone.confidence[0, 0], together.confidence[b, a], atol=1e-5, rtol=1e-5)


def test_markov_and_confidence_heads(setup):
    """logits_k = head(h_k) + W2 W1[x_k]; c_k = w [h_k; W1[x_k]] + b."""
    backbone, drafter, ids, means, _ = setup
    main_x = drafter.context(means).detach()
    anchors = torch.tensor([[10, 25]])
    with torch.no_grad():
        out, prev = _block(drafter, backbone, main_x[:1], ids[:1], anchors)
        e = drafter.markov_in.weight[prev]  # [1, A, K, r]
        want = backbone.head(out.hidden).float() + e @ drafter.markov_out.weight.T
        assert torch.allclose(out.logits, want, atol=1e-5, rtol=1e-5)
        c = torch.cat((out.hidden, e), -1) @ drafter.confidence.weight[0] + drafter.confidence.bias
        assert torch.allclose(out.confidence, c, atol=1e-5, rtol=1e-5)


def test_loss_trains_the_drafter_alone_and_its_acceptance_figures(setup):
    backbone, drafter, ids, means, logits = setup
    K = drafter.cfg.dspark.block_size
    anchors = torch.tensor([[5, 20, 44], [0, 30, 46]])
    main_x = drafter.context(means)  # the backbone's means carry no gradient: main_x's does, through main_proj
    out, prev = _block(drafter, backbone, main_x, ids, anchors)
    pos = anchors[..., None] + torch.arange(K)  # slot k at a + k drafts the token at a + k + 1
    valid = pos + 1 < T
    targets = ids.gather(1, (pos + 1).clamp_max(T - 1).flatten(1)).unflatten(1, pos.shape[1:])
    target_logits = logits.gather(1, pos.clamp_max(T - 1).flatten(1)[..., None].expand(-1, -1, logits.shape[-1]))
    res = draft_loss(out, target_logits.unflatten(1, pos.shape[1:]), targets, valid)
    res.loss.backward()
    assert all(p.grad is None for p in backbone.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in drafter.named_parameters()
               if "bias" not in n.split(".")[-1] or n == "confidence.bias"), "every drafter weight learns"
    drafter.zero_grad(set_to_none=True)
    # anchor 44 of a 48-token row: 3 slots have a target, a contiguous prefix, and alpha is 0 past it
    assert valid[0, 2].tolist() == [True, True, True, False, False] and (res.alpha[0, 2, 3:] == 0).all()
    assert ((res.alpha >= 0) & (res.alpha <= 1)).all() and res.weight == pytest.approx(
        sum(math.exp(-k / 4.0) * valid[..., k].sum().item() for k in range(K)))
    # tau = 1 + sum_k prod_{j <= k} alpha_j
    a = torch.tensor([0.9, 0.5, 0.0, 1.0])
    assert float(acceptance_length(a)) == pytest.approx(1 + 0.9 + 0.45)


def test_flagship_drafter_is_counted():
    cfg = load_config("v41_flash")
    n = dspark_parameters(cfg)
    d = cfg.dspark
    assert n["params_dspark_routed_experts"] == d.num_layers * d.num_experts * 3 * cfg.dim * cfg.moe.expert_dim
    assert n["params_dspark"] > n["params_dspark_routed_experts"] > n["params_dspark_active"]
    assert drafter_config(cfg).moe.num_experts == 128 and drafter_config(cfg).moe.experts_per_token == 3
    tiny = load_config("v41_tiny")
    with pytest.raises(ValueError, match="target_layers"):
        drafter_config(dataclasses.replace(tiny, dspark=dataclasses.replace(tiny.dspark, target_layers=[9, 12])))
    with pytest.raises(ValueError, match="window"):
        drafter_config(dataclasses.replace(tiny, dspark=dataclasses.replace(tiny.dspark, window=64)))
