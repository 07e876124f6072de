"""trainer/fused_loss.py (trainer.fused_loss=true): the head and the cross-entropy fused and chunked over tokens give
the plain loss, and keep no [N, V] logits for the backward.

- The function against F.cross_entropy's sum on the plain fp32 logits, values and the gradients of hidden and the
  head weight (1e-6 relative, the order of the sums): with IGNORE_INDEX labels, per-token weights, N not a multiple
  of the chunk, one token per chunk, a chunk larger than N; all tokens ignored gives an exact zero and zero
  gradients; a frozen head weight gets no gradient.
- Under bf16 autocast against the plain path under the same autocast (bf16 matmul, then fp32): in one chunk the
  gradients are bitwise the plain ones; over several chunks the head's gradient is summed in fp32 over bf16 partial
  products, so a bf16 rounding apart (5e-3 relative).
- No logits kept: every tensor saved for the backward (saved-tensor hooks) is at most the size of the head weight
  or of the hidden states, while the plain path saves [N, V] ones (the check is not vacuous).

The rest of what it proves: docs/testing.md#fused-loss
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from trainer.fused_loss import linear_cross_entropy
from trainer.loss import IGNORE_INDEX, LMLoss

N, D, V = 203, 24, 317


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread, as each rank of the distributed tests runs: these tensors are far too small to gain from
    more, and on a busy machine a second thread's waits cost seconds per step."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _data(seed: int = 0, n: int = N, ignore_every: int = 5):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, D, generator=gen).requires_grad_()
    weight = (0.3 * torch.randn(V, D, generator=gen)).requires_grad_()
    labels = torch.randint(0, V, (n,), generator=gen)
    labels[::ignore_every] = IGNORE_INDEX
    weights = 0.5 + torch.rand(n, generator=gen)
    return hidden, weight, labels, weights


def _plain(hidden, weight, labels, weights=None):
    ce = F.cross_entropy(F.linear(hidden, weight).float(), labels, ignore_index=IGNORE_INDEX, reduction="none")
    return (ce if weights is None else ce * weights).sum()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("chunk", [64, 1, 1000], ids=["remainder", "one_token", "chunk_over_n"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_equals_cross_entropy_fp32(chunk, weighted):
    hidden, weight, labels, weights = _data()
    w = weights if weighted else None
    total, valid = linear_cross_entropy(hidden, weight, labels, w, chunk_size=chunk)
    assert int(valid) == int((labels != IGNORE_INDEX).sum()) and total.dtype == torch.float32
    got = torch.autograd.grad(total, (hidden, weight))
    ref = _plain(hidden, weight, labels, w)
    want = torch.autograd.grad(ref, (hidden, weight))
    assert float(total.detach()) == pytest.approx(float(ref.detach()), rel=1e-6)
    for g, r, name in zip(got, want, ("hidden", "weight")):
        assert _rel(g, r) < 2e-6, name


def test_batch_shaped_inputs_and_no_valid_token():
    hidden, weight, labels, weights = _data(n=2 * 9)
    total, valid = linear_cross_entropy(hidden.view(2, 9, D), weight, labels.view(2, 9), weights.view(2, 9),
                                        chunk_size=4)
    assert float(total.detach()) == pytest.approx(float(_plain(hidden, weight, labels, weights).detach()), rel=1e-6)
    labels = torch.full_like(labels, IGNORE_INDEX)
    for w in (None, weights):
        total, valid = linear_cross_entropy(hidden, weight, labels, w, chunk_size=4)
        assert int(valid) == 0 and float(total.detach()) == 0.0
        for g in torch.autograd.grad(total, (hidden, weight)):
            assert float(g.abs().sum()) == 0.0


def test_frozen_head_gets_no_gradient():
    hidden, weight, labels, _ = _data()
    weight = weight.detach()
    total, _ = linear_cross_entropy(hidden, weight, labels, chunk_size=50)
    total.backward()
    ref_hidden = hidden.detach().clone().requires_grad_()
    _plain(ref_hidden, weight, labels).backward()
    assert weight.grad is None and _rel(hidden.grad, ref_hidden.grad) < 2e-6


@pytest.mark.parametrize("chunk", [1000, 64], ids=["one_chunk", "chunks"])
def test_bf16_autocast_matches_the_plain_path_under_autocast(chunk):
    hidden, weight, labels, weights = _data()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        total, _ = linear_cross_entropy(hidden, weight, labels, weights, chunk_size=chunk)
        logits = F.linear(hidden, weight).float()  # what Transformer.forward's head gives under autocast
    assert logits.dtype == torch.float32
    ref = (F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none") * weights).sum()
    got, want = torch.autograd.grad(total, (hidden, weight)), torch.autograd.grad(ref, (hidden, weight))
    assert float(total.detach()) == pytest.approx(float(ref.detach()), rel=1e-6)  # the same bf16 logits, summed in another order
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    assert torch.equal(got[0], want[0])  # grad_hidden: each token's row is its own chunk's product
    if chunk >= N:
        assert torch.equal(got[1], want[1])
    else:  # fp32 sum over the chunks' bf16 partials vs one bf16 product
        assert _rel(got[1], want[1]) < 5e-3
    # and the bf16 path is not the fp32 one (the autocast dtype was used)
    fp32 = torch.autograd.grad(linear_cross_entropy(hidden, weight, labels, weights, chunk_size=chunk)[0], weight)[0]
    assert not torch.equal(fp32, got[1])


def _saved_sizes(fn) -> list[int]:
    sizes: list[int] = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sizes


def test_no_logits_are_saved_for_the_backward():
    n, vocab = 512, 1000
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(n, D, generator=gen, requires_grad=True)
    weight = (0.3 * torch.randn(vocab, D, generator=gen)).requires_grad_()
    labels = torch.randint(0, vocab, (n,), generator=gen)
    chunk = 64
    out = []
    fused = _saved_sizes(lambda: out.append(linear_cross_entropy(hidden, weight, labels, chunk_size=chunk)[0]))
    plain = _saved_sizes(lambda: _plain(hidden, weight, labels))
    assert max(plain) >= n * vocab  # the plain path keeps [N, V] (its log-softmax)
    # the fused one: hidden, weight, labels and the per-token logsumexp; not even one chunk's [chunk, V] logits
    assert max(fused) <= max(n * D, vocab * D) < chunk * vocab, fused
    out[0].backward()  # and the backward runs from what was saved
    assert hidden.grad is not None and weight.grad is not None


# -- the trainer ------------------------------------------------------------------------------------------------------

T = 12


def _batches(vocab: int, step: int) -> list[dict]:
    gen = torch.Generator().manual_seed(10 + step)
    out = []
    for masked in (0, 4, 12):  # the third micro-batch has no valid label at all
        ids = torch.randint(0, vocab, (1, T + 1), generator=gen)
        labels = ids[:, 1:].clone()
        labels[:, :masked] = IGNORE_INDEX
        out.append({"input_ids": ids[:, :-1], "labels": labels, "loss_weights": 0.5 + torch.rand(1, T, generator=gen)})
    return out


def _grads(m) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def _grad_errors(actual: dict, expected: dict) -> dict[str, float]:
    """Norm-relative error of each gradient, floored at its share of the whole gradient's norm (sqrt(numel) x the
    whole vector's RMS, as tests/parallel/test_layouts.py: a near-zero tensor is held to the rounding floor of the
    whole, not to its own), and of the whole vector ("all")."""
    assert actual.keys() == expected.keys() and "head.weight" in expected
    diff = torch.stack([(actual[n] - t).double().norm() for n, t in expected.items()])
    norm = torch.stack([t.double().norm() for t in expected.values()])
    numel = torch.tensor([t.numel() for t in expected.values()], dtype=torch.float64)
    total = norm.square().sum().sqrt()
    out = dict(zip(expected, (diff / torch.maximum(norm, total * (numel / numel.sum()).sqrt())).tolist()))
    out["all"] = float(diff.square().sum().sqrt() / total)
    return out


def test_model_without_logits_is_the_same_forward():
    from tests.helpers import build_tiny

    m = build_tiny(seed=0)
    ids = _batches(m.cfg.vocab_size, 0)[0]["input_ids"]
    with torch.no_grad():
        plain, bare = m(ids, outputs=True), m(ids, outputs=True, logits=False)
    assert bare.logits is None and torch.equal(bare.hidden, plain.hidden)
    assert torch.equal(m.head(bare.hidden).float(), plain.logits)
    assert bare.aux.keys() == plain.aux.keys() and all(torch.equal(bare.aux[k], plain.aux[k]) for k in plain.aux)
    with pytest.raises(ValueError, match="outputs=True"):
        m(ids, logits=False)


def test_training_steps_equal_the_plain_run():
    from tests.helpers import build_tiny
    from trainer.parallel.apply import ParallelModel
    from trainer.train import compute_gradients

    base = build_tiny(seed=0)
    runs = {}
    for name, loss in (("plain", LMLoss()), ("fused", LMLoss(fused=True, chunk_size=5))):
        m = copy.deepcopy(base)
        m.train()
        params = list(m.parameters())
        opt = torch.optim.SGD(params, lr=0.5)
        steps = []
        for step in range(2):
            stats = compute_gradients(ParallelModel.local(m), _batches(m.cfg.vocab_size, step), params, 1.0,
                                      step=step + 1, loss=loss)
            steps.append((stats.loss, stats.grad_norm, stats.aux, _grads(m)))
            opt.step()
            opt.zero_grad(set_to_none=True)
        runs[name] = steps
    for (loss, norm, aux, grads), (f_loss, f_norm, f_aux, f_grads) in zip(runs["plain"], runs["fused"]):
        assert f_loss == pytest.approx(loss, rel=1e-5) and f_norm == pytest.approx(norm, rel=1e-5)
        assert f_aux == pytest.approx(aux, rel=1e-5)
        bad = {n: e for n, e in _grad_errors(f_grads, grads).items() if not e < 1e-5}
        assert not bad, bad


def _fsdp_worker(rank: int, world: int) -> dict:
    from tests.helpers import every_role_config
    from trainer.config import ParallelConfig, TrainerConfig
    from trainer.parallel.gradients import full_named_tensors
    from trainer.train import build_model, compute_gradients, setup_runtime, trainable_parameters

    parallel = ParallelConfig(dp_shard=2)
    rt = setup_runtime(TrainerConfig(device="cpu", precision="fp32", num_threads=1), parallel)
    cfg = every_role_config()
    out = {}
    for name, loss in (("plain", LMLoss()), ("fused", LMLoss(fused=True, chunk_size=7))):
        pm = build_model(cfg, rt, parallel, 0, batch_size=1, seq_len=T, grad_accum=2)
        pm.module.train()
        params = trainable_parameters(pm.module, cfg)
        mine = _batches(cfg.vocab_size, 0)[:2] if rank == 0 else _batches(cfg.vocab_size, 1)[1:]
        stats = compute_gradients(pm, mine, params, float("inf"), step=1, loss=loss)
        out[name] = (stats.loss, stats.grad_norm, full_named_tensors(pm.module, grads=True))
    return out


def test_fsdp_dp_shard2_equals_the_plain_run():
    from tests.distributed import run_distributed

    ranks = run_distributed(_fsdp_worker, 2)
    for r in ranks:
        (loss, norm, grads), (f_loss, f_norm, f_grads) = r["plain"], r["fused"]
        assert f_loss == pytest.approx(loss, rel=1e-5) and f_norm == pytest.approx(norm, rel=1e-5)
        bad = {n: e for n, e in _grad_errors(f_grads, grads).items() if not e < 1e-5}
        assert not bad, bad
    assert ranks[0]["fused"][:2] == ranks[1]["fused"][:2]  # one loss and one norm for the job


# -- what is refused ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    (["stage=rl"], "stage.name=rl's loss (PolicyLoss) reads the logits themselves"),
    (["parallel.tp=2"], "not under tensor parallelism"),
    (["parallel.pp=2", "trainer.grad_accum=2"], "parallel.pp=2"),
], ids=["rl", "tp", "pp"])
def test_unsupported_combinations_are_refused_at_start_up(overrides, message, tmp_path):
    from trainer.config import to_config
    from trainer.compose import compose
    from trainer.memory_plan import check_layout
    from trainer.train import build

    node = compose(["model=v41_tiny", "trainer.fused_loss=true", *overrides])
    with pytest.raises(ValueError, match="trainer.fused_loss=true") as built:
        build(to_config(node), tmp_path)
    assert message in str(built.value)
    with pytest.raises(ValueError) as planned:  # the planner / preflight give the trainer's line
        check_layout(node)
    assert str(planned.value) == str(built.value)
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_token_losses_are_each_tokens_cross_entropy():
    """token_losses (for per-kind metrics) holds each token's unweighted cross-entropy, 0 where not counted, and
    changes neither the total nor the gradient."""
    hidden, weight, labels, weights = _data()
    per_token = torch.empty(labels.numel())
    total, _ = linear_cross_entropy(hidden, weight, labels, weights, chunk_size=7, token_losses=per_token)
    want = F.cross_entropy(hidden.detach() @ weight.detach().t(), labels, ignore_index=IGNORE_INDEX,
                           reduction="none")
    torch.testing.assert_close(per_token, want, rtol=1e-5, atol=1e-6)
    assert float(total.detach()) == pytest.approx(float(_plain(hidden, weight, labels, weights).detach()), rel=1e-6)
    with pytest.raises(ValueError, match="token_losses must be a"):
        linear_cross_entropy(hidden, weight, labels, token_losses=torch.empty(3))
