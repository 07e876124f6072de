"""CSA2 building blocks: compressor grouping and visibility, top-k picks the highest allowed scores, the hierarchical
candidate pool (exactly the full search when it covers the context, never outside it otherwise), RoPE/YaRN facts."""

import math

import pytest
import torch

from model.config import AttentionConfig
from model.csa2 import Compressor, candidate_pool, select_topk, visible_mask
from model.rope import apply_rope, inv_freq, rope_tables


def test_visibility_rule():
    vis = visible_mask(7, 3, 2, "cpu")
    # entry t visible to p iff t < (p + 1) // 2, i.e. p >= 2t + 1
    for p in range(7):
        for t in range(3):
            assert bool(vis[p, t]) == (p >= 2 * t + 1)
    vis1 = visible_mask(5, 5, 1, "cpu")
    assert torch.equal(vis1, torch.ones(5, 5).tril().bool())  # ratio 1 includes the query's own token


def test_compressor_groups_do_not_overlap():
    torch.manual_seed(0)
    comp = Compressor(dim=8, latent_dim=6, ratio=2, eps=1e-6)
    comp.init_weights(0.5)
    h = torch.randn(2, 7, 8)
    out = comp(h)
    assert out.shape == (2, 3, 6)  # trailing partial group dropped
    h2 = h.clone()
    h2[:, 3] += 10.0  # token 3 belongs to group 1 only
    out2 = comp(h2)
    assert torch.equal(out[:, 0], out2[:, 0]) and torch.equal(out[:, 2], out2[:, 2])
    assert not torch.allclose(out[:, 1], out2[:, 1])


def test_compressor_gate_is_per_channel_softmax():
    torch.manual_seed(1)
    comp = Compressor(dim=4, latent_dim=3, ratio=2, eps=1e-6)
    comp.init_weights(0.5)
    h = torch.randn(1, 2, 4)
    kv = h @ comp.wkv.weight.T
    g = (h @ comp.wgate.weight.T).softmax(dim=1)
    pooled = (g * kv).sum(1, keepdim=True)
    ref = pooled * torch.rsqrt(pooled.pow(2).mean(-1, keepdim=True) + 1e-6) * comp.norm.weight
    torch.testing.assert_close(comp(h), ref)


def test_topk_picks_highest_allowed():
    torch.manual_seed(2)
    scores = torch.randn(3, 5, 40)
    allowed = torch.rand(3, 5, 40) > 0.3
    masked = scores.masked_fill(~allowed, float("-inf"))
    sel = select_topk(masked, 7)
    for b in range(3):
        for t in range(5):
            vals = masked[b, t]
            n_allowed = int(allowed[b, t].sum())
            assert int(sel[b, t].sum()) == min(7, n_allowed)
            assert bool((sel[b, t] <= allowed[b, t]).all())
            if sel[b, t].any():
                picked_min = vals[sel[b, t]].min()
                rest = vals[allowed[b, t] & ~sel[b, t]]
                assert rest.numel() == 0 or bool(rest.max() <= picked_min)


def test_topk_drops_picks_beyond_visible():
    scores = torch.tensor([[[1.0, float("-inf"), float("-inf")]]])
    assert select_topk(scores, 3).tolist() == [[[True, False, False]]]


def _pool_case(T, ratio, block, nblocks, seed=0):
    torch.manual_seed(seed)
    E = T // ratio
    scores = torch.randn(2, T, E).masked_fill(~visible_mask(T, E, ratio, "cpu"), float("-inf"))
    return scores, candidate_pool(scores, ratio, block, nblocks)


def test_pool_covering_context_is_full_search():
    scores, pool = _pool_case(T=40, ratio=1, block=4, nblocks=10)  # 10 blocks x 4 = 40 entries = whole context
    vis = visible_mask(40, 40, 1, "cpu")
    assert torch.equal(pool & vis, vis.expand_as(pool))
    restricted = select_topk(scores.masked_fill(~pool, float("-inf")), 5)
    assert torch.equal(restricted, select_topk(scores, 5))


def test_pool_restricts_and_keeps_newest_block():
    T, block, nb = 64, 4, 3
    scores, pool = _pool_case(T=T, ratio=1, block=block, nblocks=nb, seed=3)
    for t in range(T):
        blocks_kept = pool[:, t].view(2, -1, block).any(-1)
        assert bool((blocks_kept.sum(-1) <= nb).all())
        newest_block = t // block
        assert bool(blocks_kept[:, newest_block].all())  # the newest (partial) block is always in the pool
    # the other kept blocks are the best by block max among visible blocks
    t = T - 1
    bmax = scores[0, t].view(-1, block).amax(-1)
    bmax[t // block] = float("inf")
    expect = set(bmax.topk(nb).indices.tolist())
    got = set(pool[0, t].view(-1, block).any(-1).nonzero().flatten().tolist())
    assert got == expect
    # a Reindex search restricted to the pool never selects outside it
    sel = select_topk(scores.masked_fill(~pool, float("-inf")), 6)
    assert not bool((sel & ~pool).any())


def test_yarn_frequencies_match_reference_ranges():
    cfg = AttentionConfig()  # flagship: 64 rope dims, theta 1.6e5, YaRN factor 16 over 65536
    base = cfg.compress_rope_theta ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    f = inv_freq(cfg, "compress").double()
    torch.testing.assert_close(f[:16], base[:16].float().double())  # pairs 0..15 unscaled
    torch.testing.assert_close(f[25:], (base[25:] / 16).float().double())  # pairs 25..31 divided by 16
    mid = f[20] / base[20]
    assert 1 / 16 < mid < 1  # blended
    main = inv_freq(cfg, "main").double()
    torch.testing.assert_close(main, (1e4 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)).float().double())


def test_rope_interleaved_on_tail_and_inverse():
    cfg = AttentionConfig(num_heads=2, head_dim=12, rope_dim=4, o_groups=1)
    x = torch.randn(1, 5, 2, 12)
    cos, sin = rope_tables(cfg, "main", torch.arange(5), torch.float32)
    y = apply_rope(x, cos, sin)
    assert torch.equal(y[..., :8], x[..., :8])  # leading channels pass through
    # pair 0 of the tail = channels 8, 9 rotated by p * inv_freq_0 = p
    p = 3
    e, o = x[0, p, 0, 8], x[0, p, 0, 9]
    torch.testing.assert_close(y[0, p, 0, 8], e * math.cos(p) - o * math.sin(p))
    torch.testing.assert_close(y[0, p, 0, 9], e * math.sin(p) + o * math.cos(p))
    torch.testing.assert_close(apply_rope(y, cos, sin, inverse=True), x)


@pytest.mark.parametrize("ratio", [1, 2])
def test_pool_block_of_newest_entry_forced(ratio):
    T = 16
    E = T // ratio
    scores = torch.full((1, T, E), -5.0).masked_fill(~visible_mask(T, E, ratio, "cpu"), float("-inf"))
    scores[..., 0] = 10.0  # block 0 is always the best
    pool = candidate_pool(scores, ratio, 2, 2)
    for p in range(T):
        newest = (p + 1) // ratio - 1
        if newest >= 0:
            assert bool(pool[0, p, newest])


def test_compressor_pools_in_fp32_under_bf16_autocast():
    """The pooling (its kv and gate projections, the softmax over the group) runs in fp32 inside a bf16 autocast
    region, as the reference's weights-upcast pooling does; the latent's norm after it is autocast's."""
    torch.manual_seed(2)
    comp = Compressor(dim=32, latent_dim=16, ratio=4, eps=1e-6)
    comp.init_weights(0.5)
    h = torch.randn(2, 16, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = comp(h, norm=False)
    assert torch.equal(inside, comp(h, norm=False))
