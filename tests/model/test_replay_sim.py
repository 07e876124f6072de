"""The trainer hooks make the training forward compute what serving computes (model/replay.py, trainer/stages/base.py):
bounded-replay simulation against the cache's bounded replays, FP4/FP8 QAT against the quantised cache, and the
hierarchical indexer against the cache's pool-restricted search."""

from __future__ import annotations

import pytest
import torch

from model.replay import ReplayCuts, sample_cuts, window_floors
from tests.helpers import load_config
from tests.model.test_cache import ATOL, DEVICE, EXACT_STORE, serve, tokens
from tests.model.test_cache import build as build_model
from trainer.config import StageConfig


def build(stage: StageConfig | None = None, quant: dict | None = None, **csa2):
    return build_model(quant, stage=stage, **csa2)


@pytest.fixture(scope="module")
def exact_model():
    return build(quant=EXACT_STORE)


def test_decoder_cut_equals_the_window_replay_prefill(exact_model):
    """A cut at c: rows [c - W, c) and every later row equal a replay="window" prefill of c tokens + decode."""
    W = exact_model.cfg.attention.window
    ids = tokens(90, batch=2)
    c = 70
    with torch.no_grad():
        served, _ = serve(exact_model, ids, c, replay="window")
        cut = torch.full((2,), c, device=DEVICE)
        sim = exact_model(ids, replay_cuts=ReplayCuts(decoder=cut))
        exact = exact_model(ids)
    torch.testing.assert_close(sim[:, c - W:], served[:, c - W:], rtol=0, atol=ATOL)
    torch.testing.assert_close(sim[:, :c - W], exact[:, :c - W], rtol=0, atol=ATOL)  # before the span: untouched
    assert float((sim[:, c:] - exact[:, c:]).abs().max()) > 1e-3


def test_encoder_cut_equals_a_prefix_hit_whose_swa_state_expired(exact_model):
    """A prefix-cache hit on h tokens with the SWA state gone: the last W prefix tokens are replayed through every
    layer (windows truncated to the replay, the cached global KV kept), then the rest of the request."""
    W = exact_model.cfg.attention.window
    ids = tokens(100, batch=1, seed=5)
    for h in (61, 64):  # an open ratio-2 group at the hit, and none
        with torch.no_grad():
            cache = exact_model.new_cache(1, 100, replay="none")
            exact_model(ids[:, :h], cache=cache)
            cache.lengths.fill_(h - W)  # the SWA ring expired: rebuild it from the last W prefix tokens
            cache.swa_start.fill_(h - W)
            served = [exact_model(ids[:, h - W:h + 5], cache=cache)]
            served += [exact_model(ids[:, t:t + 1], cache=cache) for t in range(h + 5, 100)]
            served = torch.cat(served, dim=1)
            sim = exact_model(ids, replay_cuts=ReplayCuts(encoder=torch.tensor([h], device=DEVICE)))
        torch.testing.assert_close(sim[:, h - W:], served, rtol=0, atol=ATOL)


def test_qat_hook_equals_the_quantised_cache():
    """stage.fp4_kv_qat: the training forward fake-quantises as the cache stores (FP4 main + keys, FP8 SWA): the
    serving path with the quantised cache gives the same logits."""
    m = build(StageConfig(fp4_kv_qat=True))
    q = m.cfg.quant
    assert (q.main_kv, q.index, q.swa_kv, q.cache_main_kv, q.cache_swa_kv) == ("fp4", "fp4", "fp8", "fp4", "fp8")
    ids = tokens(58, batch=2)
    with torch.no_grad():
        got, _ = serve(m, ids, 23, (4, 1, 6))
        want = m(ids)
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)


@pytest.mark.parametrize("pool", [True, False])
def test_hierarchical_indexer_hook_equals_the_cache_search(pool):
    """With and without the candidate pool (stage.hierarchical_indexer forces it on), serving searches what the
    training forward searches; the pool (8 blocks x 4 entries) bites: the two models differ past 32 entries."""
    m = build(StageConfig(hierarchical_indexer=pool), quant=EXACT_STORE, hierarchical_pool=False)
    assert m.cfg.csa2.hierarchical_pool is pool
    ids = tokens(64, batch=1)
    with torch.no_grad():
        got, _ = serve(m, ids, 40)
        want = m(ids)
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)


def test_floors_and_sampled_cuts():
    cfg = load_config("v41_tiny")
    floors = window_floors(cfg, ReplayCuts(decoder=torch.tensor([40, -1])), torch.arange(50))
    assert sorted(floors) == list(range(cfg.num_encoder_layers + 1, cfg.num_layers))
    f = floors[cfg.num_layers - 1]
    assert f[0, 8:40].eq(8).all() and f[0, :8].eq(-1).all() and f[0, 40:].eq(-1).all() and f[1].eq(-1).all()
    ids = tokens(128, batch=64)
    a = sample_cuts(ids, 32, 0.5, ("decoder", "encoder"), seed=3)
    b = sample_cuts(ids.clone(), 32, 0.5, ("decoder", "encoder"), seed=3)
    assert torch.equal(a.decoder, b.decoder) and torch.equal(a.encoder, b.encoder)  # from the tokens alone
    hit = a.decoder[a.decoder >= 0]
    assert 10 < hit.numel() < 54 and bool(((hit >= 32) & (hit < 128)).all())
