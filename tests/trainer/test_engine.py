"""The generation engine (trainer/engine/): batching, sampling, stop tokens, streaming, log-probs, routing replay,
the prefix cache, bad requests."""

from __future__ import annotations

import pytest
import torch

from tests.model.test_cache import DEVICE, EXACT_STORE, build, tokens

LP_ATOL = 1e-5 if DEVICE == "cpu" else 5e-4  # on a GPU the teacher-forced forward runs the Triton kernels
from trainer.engine import Engine, PrefixCache, Request, SamplingParams


@pytest.fixture(scope="module")
def model():
    return build(EXACT_STORE)


def _prompt(n: int, seed: int) -> list[int]:
    return tokens(n, seed=seed)[0].tolist()


def _t(x) -> torch.Tensor:
    return torch.tensor(x, device=DEVICE)


def test_greedy_batch_equals_each_request_alone_and_the_teacher_forced_argmax(model):
    """Prompts of different lengths batched together give what each gives alone; every greedy token is the argmax
    of the teacher-forced forward on prompt + completion, and its model log-prob is that forward's."""
    reqs = [Request(_prompt(n, seed=n), SamplingParams(temperature=0, max_new_tokens=k), request_id=(n, k))
            for n, k in ((9, 12), (40, 5), (23, 9))]
    eng = Engine(model, replay="none")
    batch = eng.generate(reqs)
    alone = [eng.generate([r])[0] for r in reqs]
    for c, a in zip(batch, alone):
        assert c.token_ids == a.token_ids and c.finish_reason == "length"
        assert len(c.token_ids) == c.request_id[1]
        seq = _t([c.prompt_ids + c.token_ids])
        with torch.no_grad():
            lp = model(seq).log_softmax(-1)[0]
        n = len(c.prompt_ids)
        assert c.token_ids == lp[n - 1:-1].argmax(-1).tolist()
        want = lp[torch.arange(n - 1, seq.shape[1] - 1), seq[0, n:]].cpu()
        torch.testing.assert_close(torch.tensor(c.model_logprobs), want, rtol=0, atol=LP_ATOL)
        assert c.logprobs == [0.0] * len(c.token_ids)  # greedy: a point mass


def test_sampling_is_seeded_and_cut(model):
    eng = Engine(model, replay="none")
    p = dict(temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=16)
    a = eng.generate([Request(_prompt(12, 1), SamplingParams(seed=7, **p))])[0]
    b = eng.generate([Request(_prompt(30, 2), SamplingParams(seed=3, **p)),
                      Request(_prompt(12, 1), SamplingParams(seed=7, **p))])[1]
    c = eng.generate([Request(_prompt(12, 1), SamplingParams(seed=8, **p))])[0]
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids
    # each token's sampling log-prob is under the temperature-scaled, top-k / top-p cut distribution
    seq = _t([a.prompt_ids + a.token_ids])
    with torch.no_grad():
        logits = model(seq)[0, len(a.prompt_ids) - 1:-1]
    from trainer.engine.sampling import sampling_logprobs as _sampling_logprobs

    for t, (tok, lp) in enumerate(zip(a.token_ids, a.logprobs)):
        dist = _sampling_logprobs(logits[t], SamplingParams(**p))
        assert torch.isfinite(dist).sum() <= 20  # the top-k cut
        assert abs(float(dist[tok]) - lp) < 10 * LP_ATOL


def test_stop_tokens_and_streaming(model):
    eng = Engine(model, replay="none")
    free = eng.generate([Request(_prompt(10, 4), SamplingParams(temperature=0, max_new_tokens=8))])[0]
    stop = free.token_ids[3]
    streamed = []
    c = eng.generate([Request(_prompt(10, 4), SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=[stop]),
                              request_id="r")], on_token=lambda rid, tok, lp: streamed.append((rid, tok)))[0]
    first = free.token_ids.index(stop)
    assert c.token_ids == free.token_ids[:first + 1] and c.finish_reason == "stop"
    assert streamed == [("r", t) for t in c.token_ids]


def test_routing_replay_gives_the_engines_logprobs(model, monkeypatch):
    """With the rollout's records (index top-k per source, experts per MoE layer) the training forward's log-probs of
    the completion are the engine's; the records cover every token the model read. Two samples of one prompt (an RL
    group) are prefilled in one call and each keeps its own row of the records."""
    eng = Engine(model, replay="none")
    calls = []
    call = eng._call
    monkeypatch.setattr(eng, "_call", lambda ids, cache, keep: calls.append(ids.shape) or call(ids, cache, keep))
    reqs = [Request(_prompt(45, 9), SamplingParams(temperature=1.0, max_new_tokens=10, seed=s), return_routing=True)
            for s in (1, 2)]
    done = eng.generate(reqs)
    assert calls[0] == (2, 45)  # the group's prompt: one prefill call of two rows
    assert done[0].token_ids != done[1].token_ids
    for c in done:
        seq = _t([c.prompt_ids + c.token_ids[:-1]])
        rec = c.routing
        assert all(t.shape[:2] == seq.shape for t in list(rec.topk.values()) + list(rec.experts.values()))
        assert sorted(rec.experts) == list(range(model.cfg.num_layers))
        assert sorted(rec.topk) == sorted(model.cfg.csa2.index_source_layers)
        with torch.no_grad():
            out = model(seq, routing=rec, outputs=True)
        n = len(c.prompt_ids)
        lp = out.logits.log_softmax(-1)[0, n - 1:]
        got = lp.gather(-1, _t(c.token_ids)[:, None]).squeeze(-1).cpu()
        torch.testing.assert_close(got, torch.tensor(c.model_logprobs), rtol=0, atol=LP_ATOL)
    # the records are used: forcing other experts changes the forward
    flipped = type(rec)(dict(rec.topk), {k: (v + 1) % model.cfg.moe.num_experts for k, v in rec.experts.items()})
    with torch.no_grad():
        other = model(seq, routing=flipped)
    assert float((other - out.logits).abs().max()) > 1e-3


def test_prefix_cache_hits_and_replays(model):
    """A second request sharing a prompt's blocks reuses their global KV; its SWA state is restored while it lives,
    and rebuilt by replaying the last window of hit tokens once it has expired. Hit, SWA-hit and replayed requests
    greedy-decode exactly as without a cache (replay="none" and the SWA state alive), or within the replay's
    approximation (expired)."""
    now = [0.0]
    pc = PrefixCache(model, block_size=16, swa_ttl_s=60.0, clock=lambda: now[0])
    eng = Engine(model, replay="none", prefix_cache=pc)
    plain = Engine(model, replay="none")
    base = _prompt(70, 11)
    p = SamplingParams(temperature=0, max_new_tokens=6)
    first = eng.generate([Request(base, p)])[0]
    assert pc.stats["hits"] == 0 and pc.stats["misses"] == 4 and len(pc.blocks) == 4
    follow = base[:64] + _prompt(9, 12)
    want = plain.generate([Request(follow, p)])[0]
    hit = eng.generate([Request(follow, p)])[0]
    assert pc.stats["hits"] == 4 and pc.stats["swa_hits"] == 1 and hit.token_ids == want.token_ids
    torch.testing.assert_close(torch.tensor(hit.model_logprobs), torch.tensor(want.model_logprobs), atol=1e-5, rtol=0)
    now[0] = 120.0  # the SWA pool's entries are older than their time-to-live
    replayed = eng.generate([Request(follow, p)])[0]
    assert pc.stats["replays"] == 1 and pc.stats["hits"] == 8
    assert len(replayed.token_ids) == 6
    assert first.finish_reason == "length"


def test_bad_requests_fail_alone(model):
    eng = Engine(model, replay="none", max_len=64)
    good = Request(_prompt(11, 5), SamplingParams(temperature=0, max_new_tokens=4), request_id="good")
    alone = eng.generate([good])[0]
    out = eng.generate([Request([], request_id="empty"), good,
                        Request([1, 2, 99999], request_id="vocab"),
                        Request(_prompt(60, 6), SamplingParams(max_new_tokens=10), request_id="long"),
                        Request(_prompt(5, 7), effort=0, request_id="effort"),
                        Request("text without a tokenizer", request_id="text")])
    errors = {c.request_id: c.error for c in out if c.error}
    assert "empty prompt" in errors["empty"]
    assert "token id 99999 is outside the vocabulary" in errors["vocab"]
    assert "exceeds the engine's max_len=64" in errors["long"]
    assert "effort 0" in errors["effort"] and "tokenizer" in errors["text"]
    assert out[1].token_ids == alone.token_ids and out[1].error is None
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)


@pytest.mark.skipif(DEVICE == "cuda", reason="the refusal of a model that is not on a CUDA device")
def test_cuda_graph_needs_a_cuda_model(model):
    with pytest.raises(ValueError, match="CUDA device"):
        Engine(model, cuda_graph=True)


def test_static_decode_is_refused_where_it_does_not_apply(model):
    """Transformer.forward(static=True) is one text token per row on a cache, logits only."""
    cache = model.new_cache(1, 8, replay="none")
    with torch.no_grad():
        model(_t([[1, 2, 3]]), cache=cache)
        for kwargs in ({"cache": None}, {"cache": cache, "outputs": True}, {"cache": cache, "keep_routing": True}):
            with pytest.raises(ValueError, match="static=True"):
                model(_t([[4]]), static=True, **kwargs)
        with pytest.raises(ValueError, match=r"\[1, 1\]"):
            model(_t([[4, 5]]), cache=cache, static=True)


@pytest.mark.skipif(DEVICE != "cuda", reason="a CUDA graph needs a CUDA device (the CPU refusal is tested above)")
def test_cuda_graph_decode_equals_the_plain_engine(model):
    """Engine(cuda_graph=True) replays the captured decode step: greedy tokens and model log-probs equal the plain
    engine's (the same static step, launched op by op) for a batch of rows at different positions; a second batch
    of the same size too, replayed from the kept graph on its cleared cache (one capture for both)."""
    reqs = [Request(_prompt(n, seed=n), SamplingParams(temperature=0, max_new_tokens=k), request_id=n)
            for n, k in ((9, 14), (40, 6), (23, 10))]
    plain = Engine(model, replay="none").generate(reqs)
    graphed = Engine(model, replay="none", cuda_graph=True)
    for _ in range(2):
        for a, b in zip(graphed.generate(reqs), plain):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
            torch.testing.assert_close(torch.tensor(a.model_logprobs), torch.tensor(b.model_logprobs), rtol=0,
                                       atol=1e-5)
    assert (graphed.stats["graphs_captured"], graphed.stats["graphs_reused"]) == (1, 1)


class _EagerGraph:
    """A stand-in for the engine's _DecodeGraph on the CPU: bound, as a captured graph is, to the cache it was made
    with, and running the same step on it at every call."""

    made = 0

    def __init__(self, model, cache, step=None, keep: bool = False):
        self.step = step or (lambda ids, c: model(ids, cache=c, static=True))
        self.cache, self.keep, self.records = cache, keep, None
        _EagerGraph.made += 1

    def __call__(self, ids):
        out = self.step(ids, self.cache)
        logits, self.records = out if self.keep else (out, None)
        return logits.clone()

    def last_records(self):
        return self.records


def test_the_graph_pool_keeps_one_graph_and_cache_a_batch_size(model, monkeypatch):
    """Under cuda_graph the engine keeps each batch size's captured graph with its cache (keep_graphs of them, most
    recent first) and replays it on the cleared cache for the next batch of that size. On the CPU, with a stand-in
    graph bound to the cache it was made with (a graph replayed on a cache other than its own would decode the old
    one): every call's tokens and log-probs equal a plain engine's, one capture a batch size and keep flag, and a
    size evicted from the pool is captured again."""
    import trainer.engine.engine as engine_mod

    monkeypatch.setattr(engine_mod, "_DecodeGraph", _EagerGraph)
    three = [Request(_prompt(n, seed=n), SamplingParams(temperature=0, max_new_tokens=k), request_id=n)
             for n, k in ((9, 7), (20, 4), (14, 6))]
    two = three[:2]
    sampled = [Request(_prompt(11, seed=5), SamplingParams(temperature=1.0, max_new_tokens=5, seed=s), request_id=s,
                       return_routing=True) for s in (1, 2, 3)]
    plain = Engine(model, replay="none", max_len=64)
    want = {id(reqs): plain.generate(reqs) for reqs in (three, two, sampled)}
    eng = Engine(model, replay="none", max_len=64, keep_graphs=2)
    eng.cuda_graph = True  # (the constructor refuses a CPU model; the stand-in needs no device)
    _EagerGraph.made = 0
    for reqs, made in ((three, 1), (three, 1), (two, 2), (three, 2), (sampled, 3), (two, 4), (three, 5)):
        got = eng.generate(reqs)
        assert _EagerGraph.made == made
        for a, b in zip(got, want[id(reqs)]):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
            torch.testing.assert_close(torch.tensor(a.model_logprobs), torch.tensor(b.model_logprobs), rtol=0,
                                       atol=1e-5)
            if reqs is sampled:
                for key in ("topk", "experts"):
                    ga, gb = getattr(a.routing, key), getattr(b.routing, key)
                    assert all(ga[k].tolist() == gb[k].tolist() for k in gb), key
    assert (eng.stats["graphs_captured"], eng.stats["graphs_reused"]) == (5, 2)
    assert [k[0] for k in eng._graphs] == [3, 2] and all(c.max_len == 64 for c, _ in eng._graphs.values())
    eng.release_graphs()
    none_kept = Engine(model, replay="none", max_len=64, keep_graphs=0)
    none_kept.cuda_graph = True
    for _ in range(2):
        none_kept.generate(two)
    assert none_kept.stats["graphs_captured"] == 2 and not none_kept._graphs
    with pytest.raises(ValueError, match="keep_graphs"):
        Engine(model, keep_graphs=-1)


@pytest.mark.skipif(DEVICE != "cuda", reason="a CUDA graph needs a CUDA device (the static step's records are tested "
                    "on the CPU in tests/model/test_cache.py)")
def test_cuda_graph_keeps_the_rollouts_routing(model):
    """An RL rollout in a CUDA graph (return_routing with cuda_graph=True: decode_step's keep_routing, captured):
    tokens, log-probs and every routing record equal the plain engine's dynamic keep_routing decode."""
    reqs = [Request(_prompt(n, seed=n), SamplingParams(temperature=1.0, max_new_tokens=k, seed=n), request_id=n,
                    return_routing=True) for n, k in ((9, 12), (40, 6))]
    plain = Engine(model, replay="none").generate(reqs)
    graphed = Engine(model, replay="none", cuda_graph=True).generate(reqs)
    for a, b in zip(graphed, plain):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.model_logprobs), torch.tensor(b.model_logprobs), rtol=0, atol=1e-5)
        for key in ("topk", "experts"):
            ga, gb = getattr(a.routing, key), getattr(b.routing, key)
            assert ga.keys() == gb.keys() and all(ga[k].tolist() == gb[k].tolist() for k in ga), key


def _assert_greedy_and_teacher_forced(model, completions, atol: float = LP_ATOL) -> None:
    """Each completion's tokens are greedy under the teacher-forced forward of prompt + completion (each token's
    log-prob within LP_ATOL of the largest: a near-tie may go either way), and its model log-probs are that
    forward's."""
    for c in completions:
        seq = _t([c.prompt_ids + c.token_ids])
        with torch.no_grad():
            lp = model(seq).log_softmax(-1)[0].cpu()
        n = len(c.prompt_ids)
        rows = torch.arange(n - 1, seq.shape[1] - 1)
        picked = lp[rows, torch.tensor(c.token_ids)]
        assert bool((picked >= lp[rows].amax(-1) - atol).all()), c.request_id
        torch.testing.assert_close(torch.tensor(c.model_logprobs), picked, rtol=0, atol=atol)


@pytest.mark.parametrize("cuda_graph", [False, True], ids=["eager", "graph"])
def test_compiled_decode_is_greedy_under_the_teacher_forced_forward(model, cuda_graph):
    """Engine(compile_decode=...) decodes through model.serving.compiled_decode_step (Inductor on a GPU, inside the
    CUDA graph with cuda_graph; the eager backend on the CPU, which checks the trace): greedy tokens and model
    log-probs agree with the teacher-forced forward for rows at different positions, and a second batch reuses the
    compiled step."""
    if cuda_graph and DEVICE != "cuda":
        with pytest.raises(ValueError, match="CUDA device"):
            Engine(model, cuda_graph=True, compile_decode="eager")
        return
    reqs = [Request(_prompt(n, seed=n), SamplingParams(temperature=0, max_new_tokens=k), request_id=n)
            for n, k in ((9, 14), (40, 6), (23, 10))]
    backend = "inductor" if DEVICE == "cuda" else "eager"
    eng = Engine(model, replay="none", cuda_graph=cuda_graph, compile_decode=backend)
    for _ in range(2):
        out = eng.generate(reqs)
        assert [len(c.token_ids) for c in out] == [14, 6, 10]
        _assert_greedy_and_teacher_forced(model, out)
