"""Rolling the inference cache back past rejected draft tokens (model/cache.py `KVCache.rollback`): after verify
forwards over k drafts, each followed by a rollback to each row's accepted prefix, decoding goes on exactly as if only
the accepted tokens had ever been appended.

Each scenario runs on every_role_config (window 8, a ratio-2 and a ratio-1 KV source, Reuse and Reindex layers, the
candidate pool, Engram): three rows prefilled separately to prompts longer than the window (13, 16, 11 tokens: ratio-2
groups open and closed), two rounds of a verify forward of the batch over k = 5 drafts and a rollback, then four
decode steps of the batch. Accepted counts 0, 5, 2 then 3, 0, 5: none, all, a ratio-2 group cut in the middle (its
first token a draft; row 0's first round reopens a group whose first token is the prompt's, row 1's second one a
group of accepted drafts), and a second verify overwriting the rejected drafts' slots. It is compared with a cache
that only ever got the accepted tokens (a call of them per row instead of the verify forwards) and with the
teacher-forced forward:

The rest of what it proves: docs/testing.md#cache-rollback
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import model as model_pkg
from model.cache import CacheError
from tests.helpers import every_role_config, load_config

ATOL = 5e-6  # tests/model/test_cache.py's CPU tolerance: the serving path's reference ops vs the training forward's
EXACT_STORE = dict(cache_main_kv="none", cache_index="none", cache_swa_kv="none")
QAT = dict(main_kv="fp4", index="fp4", swa_kv="fp8")  # with v41_tiny's cache formats fp4 / fp4 / fp8
PROMPTS, K, AFTER = (13, 16, 11), 5, 4
MIXED, NONE = ((0, 5, 2), (3, 0, 5)), ((0, 0, 0), (0, 0, 0))  # accepted drafts per row, per round


def build(**quant):
    cfg = every_role_config()
    cfg = dataclasses.replace(cfg, quant=dataclasses.replace(cfg.quant, **quant))
    torch.manual_seed(0)
    with torch.device("meta"):
        m = model_pkg.build(cfg)
    m.to_empty(device="cpu")
    m.init_weights()
    return m.eval()


@pytest.fixture(scope="module")
def exact_model():
    return build(**EXACT_STORE)


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 4096, (len(PROMPTS), n), generator=torch.Generator().manual_seed(seed))


def _prefill(m, seqs, spec_tokens: int):
    cache = m.new_cache(len(PROMPTS), 32, spec_tokens=spec_tokens)
    for b, p in enumerate(PROMPTS):
        m(seqs[b:b + 1, :p], cache=cache.rows(b, b + 1))
    return cache


def _decode(m, seqs, cache, static: bool):
    """AFTER steps of the whole batch, each row from its length on: logits [B, AFTER, V]."""
    start = cache.lengths.clone()
    out = []
    for i in range(AFTER):
        feed = seqs.gather(1, start[:, None] + i)
        out.append(m(feed, cache=cache, static=True) if static else m(feed, cache=cache))
    return torch.cat(out, dim=1)


def _speculate(m, seqs, rounds, static: bool, views: bool, seed: int):
    """Prefill, then per round verify K drafts (the accepted ones seqs' next tokens, the others wrong) and roll back to
    the accepted counts, then decode: ([verify logits per round], decode logits, cache)."""
    cache = _prefill(m, seqs, K)
    verify = []
    for r, accepted in enumerate(rounds):
        start = cache.lengths.clone()
        drafts = seqs.gather(1, start[:, None] + torch.arange(K))
        wrong = (drafts + 1 + _ids(K, seed=seed + 100 + r)) % 4096
        drafts = torch.where(torch.arange(K)[None] >= torch.tensor(accepted)[:, None], wrong, drafts)
        verify.append(m(drafts, cache=cache))
        before = _stores(cache)
        new = start + torch.tensor(accepted)
        if views:  # a rows view rolls back its rows of the shared buffers
            cache.rows(0, 2).rollback(new[:2])
            cache.rows(2, 3).rollback(new[2:].tolist())
        else:
            cache.rollback(new)
        assert cache.lengths.tolist() == new.tolist()
        _assert_kept(before, cache)
    return verify, _decode(m, seqs, cache, static), cache


def _fresh(m, seqs, accepted, static: bool):
    """The cache that only ever got the accepted tokens (a call of them per row), then the same decode steps."""
    cache = _prefill(m, seqs, 0)
    for b, (p, j) in enumerate(zip(PROMPTS, accepted)):
        if j:
            m(seqs[b:b + 1, p:p + j], cache=cache.rows(b, b + 1))
    return _decode(m, seqs, cache, static), cache


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _stores(cache) -> dict:
    """(layer, store) -> copies of the global stores' buffers (codes and scales)."""
    return {(i, store): [b.clone() for b in getattr(lc, store).buffers]
            for i, lc in cache.layers.items() if lc.main is not None for store in ("main", "keys")}


def _assert_kept(before: dict, cache) -> None:
    """A rollback leaves the bytes of every entry it keeps as they were (the entries before each row's new count)."""
    for (i, store), old in before.items():
        for x, y in zip(old, getattr(cache.layers[i], store).buffers):
            for row, n in enumerate(cache.layers[i].entries.tolist()):
                assert torch.equal(_raw(x[row, :n]), _raw(y[row, :n])), (i, store, row)


def _check(m, rounds=MIXED, static: bool = False, views: bool = False, seed: int = 1, values: bool = True):
    """values False: no comparison of logits or stored values between calls of other compositions (a quantised
    cache's codes may round apart there: see test_rollback_with_the_quantised_cache)."""
    seqs = _ids(32, seed=seed)  # row b: its prompt, then the accepted drafts, then the tokens decoded after
    accepted = [sum(r[b] for r in rounds) for b in range(len(PROMPTS))]
    exact = not any(accepted)
    with torch.no_grad():
        verify, got, cache = _speculate(m, seqs, rounds, static, views, seed)
        want, fresh = _fresh(m, seqs, accepted, static)
        full = [m(seqs[b:b + 1, :p + j + AFTER])[0] for b, (p, j) in enumerate(zip(PROMPTS, accepted))]
    assert got.isfinite().all()
    if exact:
        assert torch.equal(got, want)
    for b, (p, j) in enumerate(zip(PROMPTS, accepted) if values else ()):
        torch.testing.assert_close(got[b], want[b], rtol=0, atol=ATOL)
        torch.testing.assert_close(got[b], full[b][p + j:], rtol=0, atol=ATOL)
        for logits, r in zip(verify, rounds):  # the accepted drafts' verify logits too
            torch.testing.assert_close(logits[b, :r[b]], full[b][p:p + r[b]], rtol=0, atol=ATOL)
            p += r[b]
    # after the decode: the fresh cache's counts and history, its global KV, nothing stored past the entries
    blank = m.new_cache(len(PROMPTS), 32)
    for name in ("lengths", "tokens", "swa_start", "prefill_end"):
        assert torch.equal(getattr(cache, name), getattr(fresh, name)), name
    for i, lc in cache.layers.items():
        if lc.main is None:
            continue
        assert torch.equal(lc.entries, fresh.layers[i].entries), i
        for store in ("main", "keys"):
            for x, y, empty in zip(getattr(lc, store).buffers, getattr(fresh.layers[i], store).buffers,
                                   getattr(blank.layers[i], store).buffers):
                if exact:
                    assert torch.equal(_raw(x), _raw(y)), (i, store)
                elif values and x.element_size() > 1:  # values in the compute dtype
                    torch.testing.assert_close(x, y, rtol=0, atol=ATOL)
                for row, n in enumerate(lc.entries.tolist()):
                    assert torch.equal(_raw(x[row, n:]), _raw(empty[row, n:])), (i, store, row)


@pytest.mark.parametrize("rounds", [MIXED, NONE], ids=["mixed", "none"])
def test_rollback_decodes_as_if_only_the_accepted_tokens_were_appended(exact_model, rounds):
    _check(exact_model, rounds)


def test_rollback_then_the_static_decode_step(exact_model):
    """The static decode step (every entry slot presented, masked by visibility) after a rollback through rows
    views: the rolled-back entries' slots are blank again, as the step's fresh cache has them."""
    _check(exact_model, static=True, views=True)


@pytest.mark.parametrize("rounds", [MIXED, NONE], ids=["mixed", "none"])
def test_rollback_with_the_quantised_cache(rounds):
    """Fake-quant on, the cache in its serving formats (fp4 main KV + E4M3 scales, fp4 indexer keys + UE8M0 scales,
    fp8 SWA rows): every rolled-back entry's slot holds a new store's bytes, scale bytes included; every kept entry's
    bytes are as the verify forward wrote them; the counts, history and entries are the fresh cache's.
    Every draft rejected, the decode is the fresh cache's bit for bit (the same calls but the verify forwards).
    Values computed in calls of other compositions are not compared here: with drafts accepted, or against the
    teacher-forced forward, the same rows are computed with other shapes (the MoE's grouped GEMMs, the CPU's
    blocking of their reductions), their fp32 values differ in the last bits, a value within that noise of an
    FP4/FP8 rounding edge may take the other code, and from there the logits part by far more than fp32 rounding, on
    some machines and not others. Those values are compared where no rounding edge can decide them: with the stores
    exact (test_rollback_decodes_as_if_only_the_accepted_tokens_were_appended)."""
    m = build(**QAT)
    assert (m.cfg.quant.cache_main_kv, m.cfg.quant.cache_index, m.cfg.quant.cache_swa_kv) == ("fp4", "fp4", "fp8")
    _check(m, rounds, values=False)


def test_bad_rollbacks_fail_clearly(exact_model):
    """A rollback past the headroom, into the prefill or forward fails naming the row and the numbers, and leaves the
    cache alone."""
    seqs = _ids(32, seed=3)
    with torch.no_grad():
        cache = _prefill(exact_model, seqs, 2)
        exact_model(seqs[:, 20:22], cache=cache)  # rows at 15, 18, 13
        with pytest.raises(CacheError, match=r"row 1 holds 18 tokens: it cannot roll forward to 19"):
            cache.rollback([15, 19, 13])
        with pytest.raises(CacheError, match=r"row 2 cannot go back to 10 tokens \(below 11\).*spec_tokens=2"):
            cache.rollback([13, 16, 10])
        assert cache.lengths.tolist() == [15, 18, 13]
        cache.rollback([14, 18, 12])
        # the headroom counts from the longest the row has been: the rings hold k rows past it, not past its length
        with pytest.raises(CacheError, match=r"row 0 cannot go back to 12 tokens \(below 13\).*reached 15 tokens"):
            cache.rollback([12, 18, 12])
        with pytest.raises(CacheError, match=r"shape \(2,\).*batch size 3"):
            cache.rollback([12, 18])
        plain = _prefill(exact_model, seqs, 0)
        exact_model(seqs[:, 20:21], cache=plain)
        with pytest.raises(CacheError, match=r"row 0 cannot go back to 13 tokens \(below 14\).*spec_tokens=0"):
            plain.rollback([13, 17, 12])
        plain.rollback([14, 17, 12])  # to the current length: nothing to do
        # a bounded-replay prefill kept the decoder's SWA rows of its last rows only: no rollback into it
        trimmed = exact_model.new_cache(1, 32, replay="window", spec_tokens=4)
        exact_model(seqs[:1, :16], cache=trimmed)
        with pytest.raises(CacheError, match=r"row 0 cannot go back to 15 tokens \(below 16\).*prefill ended"):
            trimmed.rollback([15])
    with pytest.raises(CacheError, match="spec_tokens"):
        exact_model.new_cache(1, 8, spec_tokens=-1)


def test_spec_tokens_zero_keeps_the_cache_bytes_and_the_headroom_adds_its_rows():
    """spec_tokens=0: the bytes before rollback existed (v41_flash, 2 rows of 4096 tokens, on the meta device; the
    persistent part is trainer.plan's 890 B/token); spec_tokens=k adds k rows to every SWA ring and every ratio-2
    compressor ring, nothing to the global KV."""
    from model.accounting import kv_bytes

    with torch.device("meta"):
        m = model_pkg.build(load_config("v41_flash"))
    plain = m.new_cache(2, 4096)
    assert (plain.nbytes(), plain.nbytes(persistent=True), plain.nbytes(persistent=False)) == \
        (12722176, 7290880, 5431296)
    k = 5
    spec = m.new_cache(2, 4096, spec_tokens=k)
    assert spec.nbytes(persistent=True) == plain.nbytes(persistent=True)
    a = m.cfg.attention
    swa_row = kv_bytes(m)["swa_kv_bytes_per_layer"] / a.window
    rings = sum(1 for s in m.plan if s.owns_kv and s.ratio > 1)
    extra = 2 * k * (len(m.plan) * swa_row + rings * 2 * a.head_dim * 4)
    assert spec.nbytes(persistent=False) - plain.nbytes(persistent=False) == extra
