"""The inference cache (model/cache.py, model/serving.py): prefill + decode equals the teacher-forced forward.

v41_tiny keeps every feature the cache must get right: ratio-2 encoder sources (open compression groups held across
calls), a ratio-1 decoder source fed from h_{L/2}, a window of 32 smaller than the prompts, the hierarchical pool
(8 blocks x 4 = 32 entries) smaller than the decoder's entries, Reindex + Reuse layers, two Engram layers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import model as model_pkg
from model.cache import CacheError
from model.csa2 import select_topk
from tests.helpers import load_config

# On a GPU the teacher-forced forward runs the Triton kernels (model.kernels=auto) and serving the reference ops
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ATOL = 5e-6 if DEVICE == "cpu" else 2e-4
EXACT_STORE = dict(cache_main_kv="none", cache_index="none", cache_swa_kv="none")
QAT = dict(main_kv="fp4", index="fp4", swa_kv="fp8")


def build(quant: dict | None = None, seed: int = 0, name: str = "v41_tiny", *, stage=None, **csa2):
    """conf/model/<name>.yaml with `quant` and `csa2` fields replaced, then a StageConfig's hooks applied, on DEVICE
    in eval mode."""
    cfg = load_config(name)
    if quant:
        cfg = dataclasses.replace(cfg, quant=dataclasses.replace(cfg.quant, **quant))
    if csa2:
        cfg = dataclasses.replace(cfg, csa2=dataclasses.replace(cfg.csa2, **csa2))
    if stage is not None:
        from trainer.stages.base import apply_model_hooks

        cfg = apply_model_hooks(stage, cfg)
    torch.manual_seed(seed)
    with torch.device("meta"):
        m = model_pkg.build(cfg)
    m.to_empty(device="cpu")
    m.init_weights()
    return m.to(DEVICE).eval()


@pytest.fixture(scope="module")
def exact_model():
    return build(EXACT_STORE)


@pytest.fixture(scope="module")
def qat_model():
    return build({**QAT})  # fake-quant on, the cache in its serving formats (fp4 main + keys, fp8 SWA)


def tokens(n: int, batch: int = 1, seed: int = 1, vocab: int = 4096) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, n), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def serve(m, ids: torch.Tensor, prompt: int, chunks=(), replay: str = "none", max_len: int | None = None):
    """Prefill ids[:, :prompt], then decode the rest in `chunks` (then one token at a time); the logits of every
    position, and the cache."""
    cache = m.new_cache(ids.shape[0], max_len or ids.shape[1], replay=replay)
    out, t = [m(ids[:, :prompt], cache=cache)], prompt
    for n in list(chunks) + [1] * ids.shape[1]:
        if t >= ids.shape[1]:
            break
        out.append(m(ids[:, t:t + n], cache=cache))
        t += n
    return torch.cat(out, dim=1), cache


# Prompt lengths: odd (a ratio-2 group left open by the prefill), one short of the window, one past it; decode
# chunks that cross group boundaries, the window edge and the pool's block edges (4 entries; the pool fills at 32).
@pytest.mark.parametrize("prompt,chunks", [(37, ()), (31, (2, 3, 1, 5, 4, 8)), (33, (7, 1, 16))])
def test_prefill_and_decode_equal_the_teacher_forced_forward(exact_model, prompt, chunks):
    ids = tokens(72, batch=2)
    with torch.no_grad():
        want = exact_model(ids)
        got, cache = serve(exact_model, ids, prompt, chunks)
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
    assert cache.lengths.tolist() == [72, 72]


def test_dense_warmup_phase_serves_exactly():
    """indexer.phase=dense_warmup: every visible entry is attended, in serving as in the training forward."""
    m = build(EXACT_STORE)
    m.cfg.indexer.phase = "dense_warmup"  # read per forward: the same weights in the other phase
    ids = tokens(60, batch=2)
    with torch.no_grad():
        got, _ = serve(m, ids, 21, (3, 5))
        want = m(ids)
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)


def test_requests_of_different_lengths_decode_together(exact_model):
    """Rows prefilled separately (cache.rows views), then decoded in one batch at different positions."""
    a, b = tokens(50, seed=2), tokens(63, seed=3)
    with torch.no_grad():
        want_a, want_b = exact_model(a), exact_model(b)
        cache = exact_model.new_cache(2, 64, replay="none")
        got_a = [exact_model(a[:, :29], cache=cache.rows(0, 1))]
        got_b = [exact_model(b[:, :42], cache=cache.rows(1, 2))]
        for i in range(21):
            step = exact_model(torch.cat((a[:, 29 + i:30 + i], b[:, 42 + i:43 + i])), cache=cache)
            got_a.append(step[:1])
            got_b.append(step[1:])
    torch.testing.assert_close(torch.cat(got_a, 1), want_a, rtol=0, atol=ATOL)
    torch.testing.assert_close(torch.cat(got_b, 1), want_b, rtol=0, atol=ATOL)
    assert cache.lengths.tolist() == [50, 63]


def _swa_keys(m, ids):
    """The teacher-forced forward's SWA keys of every layer (what its attention used), from each layer's input."""
    from model import kernels as kern

    inputs = {}
    hooks = [layer.attn.register_forward_pre_hook(lambda mod, args, i=i: inputs.__setitem__(i, args[0]))
             for i, layer in enumerate(m.layers)]
    try:
        out = m(ids, outputs=True)
    finally:
        for h in hooks:
            h.remove()
    keys = {}
    for i, layer in enumerate(m.layers):
        attn = layer.attn
        kind = layer.spec.rope
        cos, sin = out.state.rope(m.cfg.attention, kind, out.state.positions, inputs[i].dtype)
        keys[i] = kern.norm_rope_quant(attn.wkv(inputs[i]), attn.kv_norm, cos, sin,
                                       "fp8" if m.cfg.quant.swa_kv == "fp8" else None, "reference")
    return out, keys


def test_quantised_cache_holds_exactly_what_the_forward_used(qat_model):
    """With fake-quant on and the cache in the same formats, every stored entry (FP4 main KV + E4M3 scales, FP4
    indexer keys + UE8M0 scales, FP8 SWA rows) decodes to the teacher-forced forward's value bit for bit (on a GPU
    the SWA rows within one E4M3 step: its GEMMs round the last bit by row count)."""
    ids = tokens(61)
    with torch.no_grad():
        out, swa = _swa_keys(qat_model, ids)
        got, cache = serve(qat_model, ids, 25, (3, 2, 9))
    torch.testing.assert_close(got, out.logits, rtol=0, atol=ATOL)
    for src, (main, keys) in out.state.kv.items():
        lc = cache.layers[src]
        assert lc.main.buffers[0].dtype == torch.uint8 and lc.main.buffers[1].dtype == torch.float8_e4m3fn
        assert lc.keys.buffers[1].dtype == torch.float8_e8m0fnu
        E = main.shape[1]
        assert int(lc.entries[0]) == E  # 61 tokens: 30 ratio-2 entries, the open group held back
        assert torch.equal(lc.main.read_prefix(E), main) and torch.equal(lc.keys.read_prefix(E), keys)
        if qat_model.plan[src].ratio == 2:
            assert lc.pending is not None  # position 60 waits for its group's second token
    W = qat_model.cfg.attention.window
    last = torch.arange(61 - W, 61, device=DEVICE)
    for i, lc in cache.layers.items():
        assert lc.swa.buffers[0].dtype == torch.float8_e4m3fn
        stored, used = lc.swa.read((last % W)[None]), swa[i][:, last]
        if DEVICE == "cpu":
            assert torch.equal(stored, used)
        else:  # serving projects each call's rows, the forward all 61 at once: a GPU's GEMMs of other row counts
            # round the last bit otherwise, which the FP8 rounding can turn into one E4M3 step (1/8 relative)
            torch.testing.assert_close(stored.float(), used.float(), rtol=2 ** -3, atol=2 ** -9)
            assert (stored == used).float().mean() > 0.99


def test_the_halo_replay_is_exact_and_the_window_replay_is_not(exact_model):
    """Decoder bounded replay: "halo" keeps W + (n - 1)(W - 1) rows = 156 of v41_tiny's 300-token prompt and gives
    the exact logits of the last prompt token and of every decode step; "window" keeps the last 32 and drifts."""
    ids = tokens(310)
    with torch.no_grad():
        want = exact_model(ids)
        halo, _ = serve(exact_model, ids, 300, replay="halo")
        window, _ = serve(exact_model, ids, 300, replay="window")
    skipped = ~torch.isfinite(halo).all(-1)[0]
    assert int(skipped.sum()) == 300 - 156 and bool(skipped[:144].all())
    torch.testing.assert_close(halo[:, 299:], want[:, 299:], rtol=0, atol=ATOL)
    assert int((~torch.isfinite(window).all(-1)[0]).sum()) == 300 - 32
    assert float((window[:, 299:] - want[:, 299:]).abs().max()) > 1e-3  # the approximation is real


def test_cache_bytes_are_the_planners():
    """The global KV read from the allocated buffers, at flagship dims on the meta device: 890 B/token."""
    from model.accounting import kv_bytes

    for name, want in (("v41_flash", 890.0), ("v41_small", None)):
        with torch.device("meta"):
            m = model_pkg.build(load_config(name))
        cache = m.new_cache(2, 4096)
        per_token = cache.nbytes(persistent=True) / (2 * 4096)
        assert per_token == kv_bytes(m)["kv_bytes_per_token_persistent"]
        if want is not None:
            assert per_token == want
        assert cache.nbytes() > cache.nbytes(persistent=True)


def test_bad_calls_fail_clearly_and_leave_the_cache_alone(exact_model):
    cache = exact_model.new_cache(2, 20, replay="none")
    with torch.no_grad():
        exact_model(tokens(10, batch=2), cache=cache)
        with pytest.raises(CacheError, match="max_len=20"):
            exact_model(tokens(11, batch=2), cache=cache)
        with pytest.raises(CacheError, match="empty prompt"):
            exact_model(tokens(0, batch=2), cache=cache)
        with pytest.raises(CacheError, match="batch size 2"):
            exact_model(tokens(1, batch=3), cache=cache)
        bad = tokens(1, batch=2)
        bad[1, 0] = 5000
        with pytest.raises(ValueError, match="token id 5000 at row 1.*vocabulary"):
            exact_model(bad, cache=cache)
        assert cache.lengths.tolist() == [10, 10]
        other = build(EXACT_STORE, name="v41_tiny")
        other.cfg.attention.window = 16  # another model config
        with pytest.raises(CacheError, match="another model"):
            other(tokens(1, batch=2), cache=cache)
    with pytest.raises(CacheError, match="replay"):
        exact_model.new_cache(1, 8, replay="sometimes")


def test_topk_ties_go_to_the_lowest_entries():
    """The cache scores fewer (trailing, invisible) entries than the full forward: ties must not depend on that."""
    s = torch.tensor([[[0.0, 1.0, 0.0, 0.0, float("-inf"), 0.0]]])
    assert select_topk(s, 3)[0, 0].tolist() == [True, True, True, False, False, False]
    assert select_topk(s[..., :4], 3)[0, 0].tolist() == [True, True, True, False]


def _decode_static(m, ids, prompts, max_len, step=None):
    """Rows prefilled separately to their prompt lengths, then every row decoded together by `decode_step` (or
    `step`, a compiled one) to the end of the shortest: each row's logits of every position, and the cache."""
    from model.serving import decode_step

    step = step or (lambda ids_, cache_: decode_step(m, ids_, cache_))
    cache = m.new_cache(len(prompts), max_len, replay="none")
    got = [[m(ids[b:b + 1, :p], cache=cache.rows(b, b + 1))] for b, p in enumerate(prompts)]
    for i in range(ids.shape[1] - max(prompts)):
        feed = torch.stack([ids[b, p + i:p + i + 1] for b, p in enumerate(prompts)])
        out = step(feed, cache)
        for b in range(len(prompts)):
            got[b].append(out[b:b + 1])
    return [torch.cat(g, 1) for g in got], cache


def test_static_decode_step_equals_the_teacher_forced_forward(exact_model):
    """model.serving.decode_step (static shapes: every entry slot presented, masked; entries written without
    selecting rows) decodes rows at different positions as the teacher-forced forward computes them: from an odd
    prompt (a ratio-2 group open) and an even one, across group closes, the window edge and the pool's blocks."""
    ids = tokens(56, batch=2, seed=4)
    with torch.no_grad():
        want = exact_model(ids)
        (a, b), cache = _decode_static(exact_model, ids, [29, 36], 64)
    torch.testing.assert_close(a, want[:1, :a.shape[1]], rtol=0, atol=ATOL)
    torch.testing.assert_close(b, want[1:], rtol=0, atol=ATOL)
    assert cache.lengths.tolist() == [29 + 20, 56]
    # the entries it stored are the dynamic decode's (same batch; to rounding), and the slots past them untouched
    with torch.no_grad():
        _, ref = _decode_static(exact_model, ids, [29, 36], 64, step=lambda x, c: exact_model(x, cache=c))
    for i, lc in cache.layers.items():
        if lc.main is not None:
            assert lc.entries.tolist() == ref.layers[i].entries.tolist(), i
            for x, y in zip(lc.main.buffers + lc.keys.buffers, ref.layers[i].main.buffers + ref.layers[i].keys.buffers):
                torch.testing.assert_close(x, y, rtol=0, atol=ATOL)
                for row, n in enumerate(lc.entries.tolist()):
                    assert not x[row, n:].any(), (i, row)


def test_static_decode_step_with_the_quantised_cache(qat_model):
    """The same in the serving formats (fp4 main KV and keys, fp8 SWA): what decode_step writes and reads equals
    what the dynamic decode does."""
    ids = tokens(48, batch=1, seed=5)
    with torch.no_grad():
        want, _ = serve(qat_model, ids, 31, max_len=48)
        (got,), _ = _decode_static(qat_model, ids, [31], 48)
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)


def test_a_cleared_cache_is_a_new_one(qat_model):
    """KVCache.clear (the engine's graph pool reuses a cache this way): after a prefill and decode steps in the
    serving formats, every buffer and count equals a new cache's, the buffers stay where they were (a captured graph
    reads them there), and serving on it again gives what a new cache gives."""
    ids = tokens(40, batch=2, seed=9)

    def state(c):
        out = [c.lengths, c.swa_start, c.tokens, c.prefilled, c.reached, c.prefill_end]
        for lc in c.layers.values():
            out += [b.view(torch.uint8) if b.element_size() == 1 else b
                    for st in (lc.swa, lc.main, lc.keys) if st is not None for b in st.buffers]
            out += [t for t in (lc.pending, lc.entries) if t is not None]
        return out

    with torch.no_grad():
        want, _ = serve(qat_model, ids, 29, max_len=48)
        _, used = serve(qat_model, ids, 29, max_len=48)
        addresses = [t.data_ptr() for t in state(used)]
        used.clear()
        fresh = qat_model.new_cache(2, 48, replay="none")
        assert [t.data_ptr() for t in state(used)] == addresses
        for a, b in zip(state(used), state(fresh), strict=True):
            assert torch.equal(a, b)
        out = [qat_model(ids[:, :29], cache=used)]
        for t in range(29, 40):
            out.append(qat_model(ids[:, t:t + 1], cache=used))
    torch.testing.assert_close(torch.cat(out, dim=1), want, rtol=0, atol=0)


def test_static_decode_step_compiles_to_one_graph(exact_model):
    """What a CUDA graph needs, checked on the CPU: the step traces whole (fullgraph: a host read of a device value
    or a data-dependent shape would break it) and its shapes do not change as the rows grow (one graph for every
    step: no recompilation); the compiled step's logits equal the eager step's."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from model.serving import decode_step

    ids = tokens(44, batch=2, seed=6)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(lambda x, c: decode_step(exact_model, x, c), backend=counter, fullgraph=True,
                             dynamic=False)
    try:
        with torch.no_grad():
            got, _ = _decode_static(exact_model, ids, [33, 33], 48, step=compiled)
            want, _ = _decode_static(exact_model, ids, [33, 33], 48)
    finally:
        torch._dynamo.reset()
    assert counter.frame_count == 1
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=ATOL)


def test_static_decode_step_keeps_the_dynamic_steps_routing(exact_model):
    """decode_step(keep_routing=True), what an RL rollout's CUDA graph replays: it traces whole, once for every step
    (as test_static_decode_step_compiles_to_one_graph's step without records), and each step's records (every index
    source's top-k ids, every MoE layer's experts) and logits equal those of the dynamic step with keep_routing."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from model.serving import decode_step

    ids = tokens(44, batch=2, seed=7)
    static_recs, dynamic_recs = [], []
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(lambda x, c: decode_step(exact_model, x, c, keep_routing=True), backend=counter,
                             fullgraph=True, dynamic=False)

    def keep_static(x, c):
        logits, rec = compiled(x, c)
        static_recs.append(rec)
        return logits

    def keep_dynamic(x, c):
        out = exact_model(x, cache=c, outputs=True, keep_routing=True)
        dynamic_recs.append(out.routing)
        return out.logits

    try:
        with torch.no_grad():
            got, _ = _decode_static(exact_model, ids, [29, 36], 48, step=keep_static)
            want, _ = _decode_static(exact_model, ids, [29, 36], 48, step=keep_dynamic)
    finally:
        torch._dynamo.reset()
    assert counter.frame_count == 1
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=ATOL)
    assert len(static_recs) == len(dynamic_recs) == 44 - 36
    for step, (s, d) in enumerate(zip(static_recs, dynamic_recs)):
        assert s.topk.keys() == d.topk.keys() and s.experts.keys() == d.experts.keys() and s.topk, step
        for layer in s.topk:
            assert s.topk[layer].tolist() == d.topk[layer].tolist(), (step, layer)
        for layer in s.experts:
            assert s.experts[layer].tolist() == d.experts[layer].tolist(), (step, layer)


def test_serving_under_a_bf16_autocast(exact_model):
    """The cache path under the bf16 autocast the GPU runs in (the engine's and bench/generation.py's): the ratio-2
    compressor's ring keeps its fp32 projections (computed in fp32, as the training forward's compressor), and the
    logits follow the teacher-forced forward under the same autocast within bf16 rounding (the two see other row
    counts, so their bf16 matmuls round differently; on a GPU the forward runs the Triton kernels and serving the
    reference ops, which round differently again)."""
    ids = tokens(48, batch=2)
    with torch.no_grad(), torch.autocast(ids.device.type, dtype=torch.bfloat16):
        want = exact_model(ids)
        got, cache = serve(exact_model, ids, 31, (2, 3))
    rings = [lc.pending for lc in cache.layers.values() if getattr(lc, "pending", None) is not None]
    assert rings and all(r.dtype == torch.float32 for r in rings)
    # on the CPU: 0.048 of the largest logit at most, 0.0085 of the norm (a random model's logits are too flat for
    # their argmax to be a measure); a GPU's max was 0.10
    cpu = DEVICE == "cpu"
    assert (got - want).abs().max() < (0.1 if cpu else 0.25) * want.abs().max()
    assert (got - want).norm() < (0.02 if cpu else 0.05) * want.norm()
