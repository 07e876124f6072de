"""The decode step on the serving kernels (model/serving_decode.py, `decode_step(..., kernels="triton")`) equals the
reference decode step: the logits of every step to fp32 rounding and the cache it leaves (entries, indexer keys, SWA
rings), for rows at different positions, in the serving formats (FP4 main KV and keys, FP8 SWA) and the exact ones;
index sources score on the stored keys (the Reindex layers over the candidate pool only) and the Reuse layers run
no indexer; the engine's generation with the switch is greedy under the teacher-forced forward, as the reference
engine's is. The kernels run in the Triton interpreter on the CPU (small shapes, v41_tiny)."""

from __future__ import annotations

import dataclasses
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports the kernels

import pytest  # noqa: E402

from kernels import indexer_decode, sparse_decode  # noqa: E402
from model.serving import decode_step  # noqa: E402
from model.serving_decode import check_decode_kernels  # noqa: E402
from tests.model.test_cache import DEVICE, EXACT_STORE, QAT, build, tokens  # noqa: E402
from tests.trainer.test_engine import _assert_greedy_and_teacher_forced  # noqa: E402
from trainer.engine import Engine, Request, SamplingParams  # noqa: E402

ATOL = 2e-5 if DEVICE == "cpu" else 2e-4  # fp32: the kernels sum in another order than the reference's einsums


@pytest.fixture(scope="module")
def qat_model():
    return build({**QAT})  # fake-quant on, the cache in its serving formats


@pytest.fixture(scope="module")
def exact_model():
    return build(EXACT_STORE)


def _prefilled(m, ids, prompts, max_len):
    """A cache whose rows are prefilled separately to their prompt lengths."""
    cache = m.new_cache(len(prompts), max_len, replay="none")
    with torch.no_grad():
        for b, p in enumerate(prompts):
            m(ids[b:b + 1, :p], cache=cache.rows(b, b + 1))
    return cache


def _stores(cache):
    """Every buffer the cache keeps, by name."""
    out = {}
    for i, lc in cache.layers.items():
        for name in ("swa", "main", "keys"):
            store = getattr(lc, name)
            if store is not None:
                for j, buf in enumerate(store.buffers):
                    out[f"{i}.{name}.{j}"] = buf
        if lc.entries is not None:
            out[f"{i}.entries"] = lc.entries
        if lc.pending is not None:
            out[f"{i}.pending"] = lc.pending
    return out


@pytest.mark.parametrize("which", ["qat", "exact"])
def test_decode_step_on_the_kernels_equals_the_reference_step(which, qat_model, exact_model):
    """Two rows (an odd prompt: a ratio-2 group open; one past the pool's 32 entries) decoded together for several
    steps, across group closes and the window edge: each step's logits and routing records (keep_routing), and the
    caches afterwards."""
    m = qat_model if which == "qat" else exact_model
    prompts, steps, max_len = [29, 36], 6, 48
    ids = tokens(max(prompts) + steps, batch=2, seed=7)
    ref, fast = _prefilled(m, ids, prompts, max_len), _prefilled(m, ids, prompts, max_len)
    with torch.no_grad():
        for i in range(steps):
            feed = torch.stack([ids[b, p + i:p + i + 1] for b, p in enumerate(prompts)])
            want, want_rec = decode_step(m, feed, ref, keep_routing=True)
            got, got_rec = decode_step(m, feed, fast, kernels="triton", keep_routing=True)
            torch.testing.assert_close(got, want, rtol=0, atol=ATOL, msg=f"step {i}")
            # an RL rollout's records (the kernels' top-k ids in the reference's ascending form)
            for key in ("topk", "experts"):
                g, w = getattr(got_rec, key), getattr(want_rec, key)
                assert g.keys() == w.keys() and all(g[k].tolist() == w[k].tolist() for k in g), (i, key)
    a, b = _stores(ref), _stores(fast)
    for name in a:
        x, y = a[name], b[name]
        if x.dtype in (torch.uint8, torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.long):
            # stored bytes: the same codes (a code at a rounding boundary may flip under fp32 reordering: count)
            diff = (x.view(torch.uint8) if x.dtype != torch.long else x) != (y.view(torch.uint8)
                                                                              if y.dtype != torch.long else y)
            assert diff.float().mean() < 1e-3, name
        else:
            torch.testing.assert_close(y, x, rtol=0, atol=ATOL, msg=name)


def test_reuse_layers_run_no_indexer_and_reindex_layers_score_their_pool(qat_model, monkeypatch):
    """One decode step on the kernels: one attention launch per layer, one scoring per index source (Full and
    Reindex), pool-restricted exactly in the layers that use the pool, none in a Reuse layer."""
    m = qat_model
    calls = {"attn": 0, "scores": []}
    real_attn, real_scores = sparse_decode.sparse_decode, indexer_decode.index_scores_decode

    def attn(*args, **kw):
        calls["attn"] += 1
        return real_attn(*args, **kw)

    def scores(*args, pool=None, **kw):
        calls["scores"].append(pool is not None)
        return real_scores(*args, pool=pool, **kw)

    monkeypatch.setattr(sparse_decode, "sparse_decode", attn)
    monkeypatch.setattr(indexer_decode, "index_scores_decode", scores)
    ids = tokens(37, batch=1, seed=3)
    cache = _prefilled(m, ids, [36], 40)
    with torch.no_grad():
        decode_step(m, ids[:, 36:], cache, kernels="triton")
    assert calls["attn"] == len(m.plan)
    sources = [s for s in m.plan if s.owns_indexer]
    assert calls["scores"] == [s.uses_pool for s in sources]
    assert any(s.uses_pool for s in sources) and any(s.role == "reuse" for s in m.plan)
    assert all(layer.attn.indexer is None for layer, s in zip(m.layers, m.plan) if s.role == "reuse")


def test_decode_kernels_switch_checks(qat_model, monkeypatch):
    ids = tokens(4, batch=1)
    cache = qat_model.new_cache(1, 8, replay="none")
    with pytest.raises(ValueError, match="kernels must be one of"):
        decode_step(qat_model, ids[:, :1], cache, kernels="cuda")
    with pytest.raises(ValueError, match="serving_kernels must be one of"):
        Engine(qat_model, serving_kernels="fast")
    # auto: the kernels on a CUDA device only (the CPU interpreter is for the tests, not for serving)
    assert Engine(qat_model, serving_kernels="auto").serving_kernels == ("triton" if DEVICE == "cuda" else "reference")
    # one-line reasons: a dense-warm-up model (its attention reads every visible entry), a CPU without the interpreter
    warm = dataclasses.replace(qat_model.cfg, indexer=dataclasses.replace(qat_model.cfg.indexer, phase="dense_warmup"))
    assert "indexer.phase='dense_warmup'" in check_decode_kernels(warm)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "CUDA device" in check_decode_kernels(qat_model.cfg, torch.device("cpu"))


def test_engine_on_the_kernels_is_greedy_under_the_teacher_forced_forward(qat_model, monkeypatch):
    """Engine(serving_kernels="triton"): rows at different positions generate what the reference engine generates,
    greedy under the teacher-forced forward (each token's log-prob within the tolerance of the largest), with the
    reference engine's model log-probs."""
    m = qat_model
    reqs = [Request(tokens(n, seed=n)[0].tolist(), SamplingParams(temperature=0, max_new_tokens=k), request_id=n)
            for n, k in ((9, 5), (34, 4))]
    ref = Engine(m, replay="none").generate(reqs)
    launches = []
    real = sparse_decode.sparse_decode
    monkeypatch.setattr(sparse_decode, "sparse_decode", lambda *a, **kw: launches.append(1) or real(*a, **kw))
    out = Engine(m, replay="none", serving_kernels="triton").generate(reqs)
    assert len(launches) == len(m.plan) * (5 - 1)  # every decode step on the kernels (after the prefill's token)
    for c, r in zip(out, ref):
        assert c.token_ids == r.token_ids
        torch.testing.assert_close(torch.tensor(c.model_logprobs), torch.tensor(r.model_logprobs), rtol=0,
                                   atol=ATOL)
    _assert_greedy_and_teacher_forced(m, out, atol=ATOL)
