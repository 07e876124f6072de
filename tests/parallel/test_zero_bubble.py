"""Proves the zero-bubble pipeline schedules train exactly like the single process, through the trainer.

Contract: per stage, in one process, trainer/parallel/zero_bubble.py's split backward equals the full backward bit
for bit (inputs and every parameter) on cuts where a KV source's main KV and indexer keys cross, its input pass
computes no parameter gradient and hands back contiguous input gradients; without its hooks the indexer keys' wk and
k_norm lose their gradient (the test sees the bug). Through the trainer on 2 gloo ranks (test_layouts' _train and
_check, 1e-5 rules), ZBVZeroBubble on [2, 6, 10] and [2, 6, 9] and InterleavedZeroBubble equal the single process,
with the backward split on every stage. validate_layout lets both schedules through, with activation checkpointing
too; a pipeline on a torch too old is refused, naming the version.

Design and reasoning: docs/testing.md#zero-bubble-schedules
"""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.distributed.pipelining.stage as pipelining_stage

import model as model_pkg
from tests.distributed import run_distributed
from tests.parallel.test_layouts import _check, _config, _train, single  # noqa: F401  (single: the reference)
from tests.parallel.test_pp import _one_thread  # noqa: F401  (autouse: one thread, as each rank runs)
from trainer.config import ParallelConfig
from trainer.parallel import zero_bubble
from trainer.parallel.apply import validate_layout
from trainer.parallel.pipeline import split_model

LAYOUTS = {
    "pp2_v2_zbv": dict(pp=2, pp_virtual=2, pp_schedule="ZBVZeroBubble"),
    "pp2_v2_zbv_cuts_2_6_9": dict(pp=2, pp_virtual=2, pp_schedule="ZBVZeroBubble", pp_cuts=[2, 6, 9]),
    "pp2_v2_interleaved_zb": dict(pp=2, pp_virtual=2, pp_schedule="InterleavedZeroBubble"),
    # activation checkpointing: every block recomputed for the input pass and again for the weight pass
    "pp2_v2_zbv_ac": dict(pp=2, pp_virtual=2, pp_schedule="ZBVZeroBubble", activation_checkpoint="full"),
}


# --- one process: the split backward of each stage ------------------------------------------------------------------

def _stage_grads(cuts: list[int]) -> list[dict]:
    """Per non-first stage of the tiny model cut at `cuts`: full-backward and split-backward gradients of the
    received inputs and of every parameter, for the same inputs and random output gradients."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = model_pkg.build(_config())
    model.to_empty(device="cpu")
    model.init_weights()
    model.train()
    stages = split_model(model, cuts, list(range(len(cuts) + 1)))
    for s in stages:
        s.set_shapes(1, 64)
    x: tuple = (torch.randint(0, 4096, (1, 64)),)
    received = []
    for s in stages:
        received.append(x)
        x = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in s(*x))
    out = []
    for k, s in list(enumerate(stages))[1:]:
        params = dict(s.named_parameters())
        result = {}
        for how in ("full", "split"):
            inputs = tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in received[k])
            torch.manual_seed(1)
            outputs = s(*inputs)
            if s.is_last:
                logits, aux = outputs
                outputs, grads = (logits.square().mean() + aux.sum(),), None
            else:
                gen = torch.Generator().manual_seed(2)
                grads = [torch.randn(t.shape, generator=gen) if t.requires_grad else None for t in outputs]
            want = [t for t in inputs if t.requires_grad]
            if how == "full":
                pairs = [(o, g) for o, g in zip(outputs, grads or [None]) if o.requires_grad]
                got = torch.autograd.grad([o for o, _ in pairs], want + list(params.values()),
                                          [g for _, g in pairs] if grads else None, allow_unused=True)
                d_in, d_w = got[:len(want)], dict(zip(params, got[len(want):]))
            else:
                for p in params.values():
                    p.grad = None
                d_all, state = zero_bubble._backward_input(list(outputs), grads, list(inputs), s.parameters())
                assert all(p.grad is None for p in params.values())  # the input pass leaves the weights alone
                zero_bubble._backward_weight(s.parameters(), state)
                d_in = tuple(d for t, d in zip(inputs, d_all) if t.requires_grad)
                d_w = {n: p.grad for n, p in params.items()}
                for p in params.values():
                    p.grad = None
            result[how] = (d_in, d_w)
        out.append(result)
    return out


def _diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def test_split_backward_equals_full_backward_per_stage():
    for result in _stage_grads([2, 6, 9]):
        (full_in, full_w), (split_in, split_w) = result["full"], result["split"]
        assert all(torch.equal(a, b) for a, b in zip(split_in, full_in))
        assert all(d.is_contiguous() for d in split_in)  # gloo sends them
        bad = {n: _diff(split_w[n], g) for n, g in full_w.items() if _diff(split_w[n], g) != 0.0}
        assert not bad, bad


def test_without_the_hooks_the_indexer_keys_lose_their_gradient(monkeypatch):
    """The bug the hooks fix, in one process: stage [6, 9) publishes layer 6's indexer keys, made from its
    detached latent; the weight pass loses the gradient they receive from the next stage."""
    monkeypatch.setattr(zero_bubble.Tie, "apply", staticmethod(lambda t, anchor: t))
    monkeypatch.setattr(zero_bubble.ContiguousGrad, "apply", staticmethod(lambda t: t))
    stage_6_9, last = _stage_grads([2, 6, 9])[1:]
    (_, full_w), (_, split_w) = stage_6_9["full"], stage_6_9["split"]
    wrong = sorted(n for n, g in full_w.items() if _diff(split_w[n], g) > 0.5)
    assert wrong == ["layers.6.attn.indexer.k_norm.weight", "layers.6.attn.indexer.wk.weight"]
    assert not all(d.is_contiguous() for d in last["split"][0])  # kv gradients of the last stage: strided


# --- start-up checks ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "InterleavedZeroBubble"])
def test_zero_bubble_layouts_pass_validation(schedule):
    fields = dict(pp=2, pp_virtual=2, pp_schedule=schedule)
    assert validate_layout(ParallelConfig(**fields), _config(), seq_len=64, grad_accum=4) == [2, 6, 10]
    assert validate_layout(ParallelConfig(**fields, pp_cuts=[2, 6, 9]), _config(), seq_len=64, grad_accum=4) == [
        2, 6, 9]


def test_zero_bubble_with_activation_checkpointing_passes_validation():
    layout = ParallelConfig(pp=2, pp_virtual=2, pp_schedule="ZBVZeroBubble", activation_checkpoint="full")
    assert validate_layout(layout, _config(), seq_len=64, grad_accum=4) == [2, 6, 10]


def test_pipeline_on_an_old_torch_is_refused_naming_the_version(monkeypatch):
    """pp runs on torch 2.11 (the GPU machine's: its stages cross the cuts on the float wire, test_pp_torch211.py)
    and 2.13; an older torch, below the project's floor, is refused by name."""
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    assert validate_layout(ParallelConfig(pp=2), _config(), seq_len=64, grad_accum=4) == [6]
    monkeypatch.setattr(torch, "__version__", "2.10.0+cu128")
    with pytest.raises(RuntimeError, match=r"needs torch >= 2\.11, this is 2\.10\.0\+cu128"):
        validate_layout(ParallelConfig(pp=2), _config(), seq_len=64, grad_accum=4)
    assert validate_layout(ParallelConfig(tp=2), _config(), seq_len=64, grad_accum=4) == []  # other layouts run


# --- through the trainer, 2 ranks -----------------------------------------------------------------------------------

def _worker(rank: int, world: int, names: list[str]) -> dict:
    """Every layout in one spawn; counts the input passes, the weight passes run apart from them, and the full
    backward passes."""
    calls = {"input": 0, "weight": 0, "full": 0}

    def counted(fn, key):
        def wrapper(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)
        return wrapper

    zero_bubble._backward_input = counted(zero_bubble._backward_input, "input")
    zero_bubble._backward_weight = counted(zero_bubble._backward_weight, "weight")
    pipelining_stage.stage_backward = counted(pipelining_stage.stage_backward, "full")
    results = {}
    for name in names:
        calls.update(input=0, weight=0, full=0)
        try:
            results[name] = _train(LAYOUTS[name])
            results[name]["split_passes"] = dict(calls)
        except Exception:
            results[name] = traceback.format_exc()
            break
    return results


_RUNS: list = []


def _runs() -> list:
    if not _RUNS:
        _RUNS.extend(run_distributed(_worker, 2, list(LAYOUTS)))
    return _RUNS


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_zero_bubble_layouts_match_single_process(name, single):  # noqa: F811
    ranks = [r[name] if name in r else f"{name} did not run" for r in _runs()]
    _check(name, ranks, single)
    # The backward ran split: an input pass and a later weight pass for each of 2 steps x 4 micro-batches on the 3
    # stages with received inputs; the first stage, which has no input gradient, runs its whole backward at its
    # weight pass (torch's rule).
    passes = {key: sum(r["split_passes"][key] for r in ranks) for key in ("input", "weight", "full")}
    assert passes == {"input": 3 * 2 * 4, "weight": 3 * 2 * 4, "full": 2 * 4}, passes
