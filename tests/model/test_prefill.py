"""Proves the prefill on the training forward's kernels (model/prefill.py, model/serving.py `prefill_attention`).

Contract: with the kernel switch on (model.kernels="triton", the CPU interpreter here: tests/conftest.py) a cached
call equals the reference serving path (kernels="reference", the same weights) in its logits and in every cache
buffer, for a one-shot prefill, a prefill in chunks (each attending to the cache's earlier entries and SWA ring rows
plus its own), a CED prefill trimmed by the halo replay, and rows of different lengths in one call; it never runs the
reference attention (no [B, H, T, E] scores); and generation after it equals the teacher-forced forward. The model
is tests/helpers.py's every-role config (window 8, top-k 6, a pool of 12 entries, a pool-restricted Reindex layer).

The stored bytes are compared exactly but for MAX_FLIPS: the fused norm sums its squares in another order
(kernels/norm_rope_fp4.py), so a value on a quantiser's rounding edge may take the neighbouring code.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import model as model_pkg
import model.serving as serving
from model.cache import KVCache
from tests.helpers import assert_rel, every_role_config
from trainer.engine import Engine, Request, SamplingParams

QAT = dict(main_kv="fp4", index="fp4", swa_kv="fp8")  # the cache stays in its serving formats (fp4, fp4, fp8)
EXACT = dict(cache_main_kv="none", cache_index="none", cache_swa_kv="none")  # the cache keeps what the forward used
MAX_FLIPS = 2  # stored bytes per buffer that may differ (a code on a rounding edge)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: the Triton interpreter (tests/conftest.py)


def _build(cfg):
    torch.manual_seed(0)
    with torch.device("meta"):
        m = model_pkg.build(cfg)
    m.to_empty(device="cpu")
    m.init_weights()
    return m.to(DEVICE).eval()


def _pair(quant: dict):
    """The same weights twice, kernels "reference" and "triton", in eval mode."""
    cfg = every_role_config()
    cfg = dataclasses.replace(cfg, quant=dataclasses.replace(cfg.quant, **quant))
    ref = _build(dataclasses.replace(cfg, kernels="reference"))
    tri = _build(dataclasses.replace(cfg, kernels="triton"))
    tri.load_state_dict(ref.state_dict())
    return ref, tri


@pytest.fixture(scope="module")
def qat_pair():
    return _pair(QAT)


def _ids(B: int, T: int, seed: int = 4) -> torch.Tensor:
    return torch.randint(3, 4096, (B, T), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def _no_reference_attention(monkeypatch):
    def refuse(*_, **__):
        raise AssertionError("the kernel path ran the reference attention (dense [B, H, T, E] scores)")

    monkeypatch.setattr(serving, "attend", refuse)


def _fill(m, cache: KVCache, ids: torch.Tensor, chunks) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([m(c, cache=cache) for c in ids.split(list(chunks), dim=1)], dim=1)


def _fill_keeping_routing(m, cache: KVCache, ids: torch.Tensor, chunks):
    """_fill with keep_routing: (logits, each call's RoutingRecords)."""
    with torch.no_grad():
        outs = [m(c, cache=cache, outputs=True, keep_routing=True) for c in ids.split(list(chunks), dim=1)]
    return torch.cat([o.logits for o in outs], dim=1), [o.routing for o in outs]


def _assert_same_cache(got: KVCache, want: KVCache) -> None:
    """Every buffer: stored bytes (at most MAX_FLIPS differ), open groups' fp32 rows, counts."""
    for name in ("lengths", "swa_start", "tokens", "prefilled", "prefill_end", "reached"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    for i, lc in want.layers.items():
        other = got.layers[i]
        for part in ("swa", "main", "keys"):
            if getattr(lc, part) is None:
                continue
            for k, (a, b) in enumerate(zip(getattr(other, part).buffers, getattr(lc, part).buffers)):
                if a.element_size() == 1:
                    flips = int((a.view(torch.uint8) != b.view(torch.uint8)).sum())
                    assert flips <= MAX_FLIPS, f"layer {i} {part} buffer {k}: {flips} bytes differ"
                else:
                    assert_rel(a, b, f"layer {i} {part} buffer {k}")
        if lc.entries is not None:
            assert torch.equal(other.entries, lc.entries), f"layer {i} entries"
        if lc.pending is not None:
            assert_rel(other.pending, lc.pending, f"layer {i} open groups")


# one shot; chunks that start inside the first window (a ring shorter than W - 1, a chunk shorter than the window),
# then past it, crossing ratio-2 groups and the pool's blocks
@pytest.mark.parametrize("chunks", [(30,), (5, 3, 13, 9)], ids=["one-shot", "chunked"])
def test_prefill_on_kernels_equals_the_reference(qat_pair, chunks, monkeypatch):
    """Logits and cache; with routing records kept (an RL rollout's prefill), every call's records: each index
    source's top-k and each MoE layer's experts are the reference prefill's."""
    ref, tri = qat_pair
    ids = _ids(2, 30)
    want_cache, got_cache = ref.new_cache(2, 32, replay="none"), tri.new_cache(2, 32, replay="none")
    want, want_rec = _fill_keeping_routing(ref, want_cache, ids, chunks)
    _no_reference_attention(monkeypatch)
    got, got_rec = _fill_keeping_routing(tri, got_cache, ids, chunks)
    assert_rel(got, want, "logits")
    _assert_same_cache(got_cache, want_cache)
    for k, (g, w) in enumerate(zip(got_rec, want_rec)):
        assert g.topk.keys() == w.topk.keys() and g.experts.keys() == w.experts.keys()
        assert any(bool((t >= 0).any()) for t in w.topk.values()), "no entry picked: the records compare nothing"
        for part in ("topk", "experts"):
            for layer, t in getattr(w, part).items():
                assert torch.equal(getattr(g, part)[layer], t), f"call {k} layer {layer} {part}"


def test_halo_prefill_on_kernels_equals_the_reference(qat_pair, monkeypatch):
    """A CED prefill whose decoder runs on the halo's rows only (the later layers' rows start after the call's), then
    a chunk: the skipped rows' NaN logits where the reference has them, the rest equal."""
    ref, tri = qat_pair
    ids = _ids(1, 34, seed=5)
    want_cache, got_cache = ref.new_cache(1, 40, replay="halo"), tri.new_cache(1, 40, replay="halo")
    want = _fill(ref, want_cache, ids, (28, 6))
    _no_reference_attention(monkeypatch)
    got = _fill(tri, got_cache, ids, (28, 6))
    skipped = want.isnan()
    assert skipped.any() and torch.equal(got.isnan(), skipped)
    assert_rel(got[~skipped], want[~skipped], "logits")
    _assert_same_cache(got_cache, want_cache)


def test_rows_of_different_lengths_in_one_call(qat_pair, monkeypatch):
    """Rows prefilled to 7 and 12 tokens (cache.rows views), then one call of 9 more tokens for both."""
    ref, tri = qat_pair
    ids = _ids(2, 21, seed=6)
    out = {}
    for name, m in (("ref", ref), ("tri", tri)):
        if name == "tri":
            _no_reference_attention(monkeypatch)
        cache = m.new_cache(2, 24, replay="none")
        with torch.no_grad():
            m(ids[:1, :7], cache=cache.rows(0, 1))
            m(ids[1:, :12], cache=cache.rows(1, 2))
            step = m(torch.cat((ids[:1, 7:16], ids[1:, 12:21])), cache=cache)
        out[name] = step, cache
    assert_rel(out["tri"][0], out["ref"][0], "logits")
    assert out["tri"][1].lengths.tolist() == [16, 21]
    _assert_same_cache(out["tri"][1], out["ref"][1])


def test_generation_after_a_kernel_prefill_equals_the_teacher_forced_forward():
    """The exact cache formats: a chunked prefill on the kernels, then decode steps (the static step, as the engine
    runs them), equal the reference model's teacher-forced forward, as the engine tests check."""
    ref, tri = _pair(EXACT)
    ids = _ids(2, 28, seed=7)
    cache = tri.new_cache(2, 28, replay="none")
    with torch.no_grad():
        want = ref(ids)
        got = [_fill(tri, cache, ids[:, :20], (11, 9))]
        got += [tri(ids[:, t:t + 1], cache=cache, static=True) for t in range(20, 28)]
    assert_rel(torch.cat(got, dim=1), want, "logits")


def test_the_switch_is_the_kernel_path():
    """kernels="triton" prefills on the kernels; the reference, replayed routing records and the dense warm-up take
    the reference path."""
    ref, tri = _pair(EXACT)
    assert serving.on_kernels(tri) and not serving.on_kernels(ref)
    assert not serving.on_kernels(tri, routing=object())
    tri.cfg.indexer.phase = "dense_warmup"
    assert not serving.on_kernels(tri)


def test_the_engine_on_a_kernel_prefill_is_greedy_under_the_teacher_forced_forward():
    """The engine's check (tests/trainer/test_engine.py): prompts of different lengths batched, prefilled on the
    kernels; every greedy token is the argmax of the reference model's teacher-forced forward on prompt +
    completion, and its model log-prob is that forward's."""
    ref, tri = _pair(EXACT)
    reqs = [Request(_ids(1, n, seed=n)[0].tolist(), SamplingParams(temperature=0, max_new_tokens=3), request_id=n)
            for n in (9, 20)]
    for c in Engine(tri, replay="none").generate(reqs):
        seq = torch.tensor([c.prompt_ids + c.token_ids], device=DEVICE)
        with torch.no_grad():
            lp = ref(seq).log_softmax(-1)[0]
        n = len(c.prompt_ids)
        rows = torch.arange(n - 1, seq.shape[1] - 1, device=DEVICE)
        assert c.token_ids == lp[rows].argmax(-1).tolist(), c.request_id
        torch.testing.assert_close(torch.tensor(c.model_logprobs), lp[rows, seq[0, n:]].cpu(), rtol=0, atol=1e-5)


def test_verify_forwards_and_rollbacks_on_kernels(qat_pair, monkeypatch):
    """A speculation cache (spec_tokens=4: rings with headroom): a prefill, a verify forward of 5 tokens, a rollback
    that leaves the rows at different lengths, another 5 tokens; every call equals the reference's."""
    ref, tri = qat_pair
    ids = _ids(2, 24, seed=8)
    out = {}
    for name, m in (("ref", ref), ("tri", tri)):
        if name == "tri":
            _no_reference_attention(monkeypatch)
        cache = m.new_cache(2, 32, replay="none", spec_tokens=4)
        with torch.no_grad():
            got = [m(ids[:, :13], cache=cache), m(ids[:, 13:18], cache=cache)]
            cache.rollback([15, 17])
            got.append(m(torch.cat((ids[:1, 15:20], ids[1:, 17:22])), cache=cache))
        out[name] = got, cache
    for k, (a, b) in enumerate(zip(*(out[n][0] for n in ("tri", "ref")))):
        assert_rel(a, b, f"call {k} logits")
    _assert_same_cache(out["tri"][1], out["ref"][1])
