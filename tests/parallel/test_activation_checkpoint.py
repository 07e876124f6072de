"""Proves activation checkpointing (parallel.activation_checkpoint=full, trainer/parallel/activation_checkpoint.py)
changes what a step keeps in memory and nothing it computes.

Contract: one process, the trainer's code path, fp32, two steps of 4 micro-batches: with full checkpointing the
loss, every aux term, the clipped norm, every gradient, the expert loads, the biases and the parameters are BITWISE
those without it, as configured, under QAT fake-quant and in the indexer's dense warm-up; every block is recomputed
(not vacuous) and a block's forward writes nothing into the ForwardState or the MoE counters. On 2 ranks pp 2, ep 2,
tp 2 and dp_shard 2 with checkpointing equal the single process without it by test_layouts' comparison. Module
names, state-dict and optimiser keys are the same with and without, and a DCP checkpoint moves between the two
exactly.

Design and reasoning: docs/testing.md#activation-checkpointing
"""

from __future__ import annotations

import dataclasses
import traceback

import pytest
import torch

import model.block
import model.forward
import model.transformer
import trainer.parallel.activation_checkpoint as ac
from optim import LRScheduler, OptimConfig, build_optimizer
from tests.distributed import run_distributed
from tests.parallel import test_layouts as layouts
from trainer.checkpoint import Checkpointer, TrainState
from trainer.config import CheckpointConfig, ParallelConfig, TrainerConfig
from trainer.parallel.gradients import full_named_tensors, update_router_biases
from trainer.train import build_model, compute_gradients, freeze_all_but, setup_runtime, trainable_parameters

STEPS = layouts.STEPS


def _model_config(case: str):
    cfg = layouts._config()
    if case == "qat":
        return dataclasses.replace(cfg, quant=dataclasses.replace(cfg.quant, main_kv="fp4", index="fp4",
                                                                  swa_kv="fp8"))
    if case == "dense_warmup":
        return dataclasses.replace(cfg, indexer=dataclasses.replace(cfg.indexer, phase="dense_warmup"))
    return cfg


def _build(cfg, activation_checkpoint: str):
    parallel = ParallelConfig(activation_checkpoint=activation_checkpoint)
    rt = setup_runtime(TrainerConfig(device="cpu", precision="fp32", num_threads=1), parallel)
    pm = build_model(cfg, rt, parallel, layouts.SEED, batch_size=layouts.ROWS, seq_len=layouts.SEQ_LEN,
                     grad_accum=layouts.MICROBATCHES)
    params = trainable_parameters(pm.module, cfg)
    freeze_all_but(pm.module, params)  # as trainer.train.build does (the dense warm-up trains the indexers only)
    return pm, params


def _run(case: str, activation_checkpoint: str) -> dict:
    """test_layouts._train's single process, recording the expert load counts of every step too."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = _model_config(case)
        pm, params = _build(cfg, activation_checkpoint)
        opt = torch.optim.SGD(params, lr=layouts.LR, momentum=0.9, weight_decay=0.1)
        out = {"init": full_named_tensors(pm.module), "loss": [], "grad_norm": [], "grads": [], "aux": [],
               "counts": []}
        pm.module.train()
        for step in range(STEPS):
            stats = compute_gradients(pm, layouts._global_batch(step), params, layouts.MAX_NORM, step=step + 1)
            out["loss"].append(stats.loss)
            out["grad_norm"].append(stats.grad_norm)
            out["aux"].append(stats.aux)
            out["grads"].append(full_named_tensors(pm.module, grads=True))
            out["counts"].append(torch.stack([m.load_counts() for m in pm.module.moe_layers()]))
            opt.step()
            opt.zero_grad(set_to_none=True)
            update_router_biases(pm)
        out["params"] = full_named_tensors(pm.module)
        out["biases"] = layouts._biases(pm.module)
        return out
    finally:
        torch.set_num_threads(threads)


_REFERENCE: dict[str, dict] = {}


def _reference(case: str) -> dict:
    """The run without checkpointing, once per case."""
    if case not in _REFERENCE:
        _REFERENCE[case] = _run(case, "none")
    return _REFERENCE[case]


def _assert_bitwise(got: dict, ref: dict, what: str) -> None:
    assert got["loss"] == ref["loss"] and got["grad_norm"] == ref["grad_norm"], what
    assert got["aux"] == ref["aux"], what
    for step in range(STEPS):
        assert torch.equal(got["counts"][step], ref["counts"][step]), f"{what}: expert load counts, step {step + 1}"
        assert got["grads"][step].keys() == ref["grads"][step].keys(), what
        bad = [n for n, g in ref["grads"][step].items() if not torch.equal(got["grads"][step][n], g)]
        assert not bad, f"{what}: gradients differ at step {step + 1}: {bad}"
    for key in ("init", "params", "biases"):
        assert got[key].keys() == ref[key].keys(), (what, key)
        bad = [n for n, t in ref[key].items() if not torch.equal(got[key][n], t)]
        assert not bad, f"{what}: {key} differ: {bad}"


def _count_block_calls(monkeypatch) -> list[int]:
    """Count every call of Block.forward: the forwards and, under checkpointing, the recomputations (checkpoint
    calls the original function again)."""
    calls: list[int] = []
    real = model.block.Block.forward

    def counted(self, *args, **kwargs):
        calls.append(self.spec.index)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(model.block.Block, "forward", counted)
    return calls


@pytest.mark.parametrize("case", ["plain", "qat", "dense_warmup"])
def test_single_process_is_bitwise_equal(case, monkeypatch):
    calls = _count_block_calls(monkeypatch)
    got = _run(case, "full")
    cfg = _model_config(case)
    forwards = STEPS * layouts.MICROBATCHES * cfg.num_layers
    # every block once per micro-batch; in the warm-up only those with an indexer save anything to recompute
    blocks = len(cfg.csa2.index_source_layers) if case == "dense_warmup" else cfg.num_layers
    assert len(calls) - forwards == STEPS * layouts.MICROBATCHES * blocks
    _assert_bitwise(got, _reference(case), case)


def test_reference_is_not_vacuous():
    ref = _reference("plain")
    assert all(norm > layouts.MAX_NORM for norm in ref["grad_norm"])  # clipping active
    assert ref["aux"][0]["aux/indexer_kl"] > 0 and ref["aux"][0]["aux/moe_seq_balance"] > 0
    assert any(b.abs().sum() > 0 for b in ref["biases"].values())  # the biases moved
    assert any(n.endswith("engram.table") for n in ref["grads"][0])
    warmup = _reference("dense_warmup")
    assert all(".indexer." in n for n in warmup["grads"][0])  # only the indexers learn in the warm-up


def test_a_block_forward_writes_nothing():
    """What makes the recomputation safe without a guard: calling a block again (as checkpoint's recomputation
    does) on the state of a finished forward returns what the forward recorded and changes neither the state nor
    the MoE counters."""
    cfg = _model_config("plain")
    m = model.transformer.Transformer(cfg)
    torch.manual_seed(0)
    m.init_weights()
    ids = torch.randint(0, cfg.vocab_size, (2, layouts.SEQ_LEN))
    out = m(ids, outputs=True)
    state = out.state
    counters = [(moe.load_text.clone(), moe.load_image.clone()) for moe in m.moe_layers()]
    snapshot = {k: dict(getattr(state, k)) for k in ("kv", "selection", "indexer_kl", "balance_loss", "expert_load")}
    pool = state.pool
    S, pre = model.forward.embed_streams(m.embed, ids, cfg.mhc.num_streams)
    _, engram_in = model.forward.new_state(cfg, ids, m.sequence_shard, m.hasher)
    checked = 0
    for layer in m.layers:
        e_in = engram_in[layer.spec.index] if layer.engram is not None else None
        S, pre, made = layer(S, pre, state, e_in)  # the second call of every block, on the recorded state
        for name, recorded in snapshot.items():
            value = getattr(made, name)
            if value is not None:
                first = recorded[layer.spec.index]
                for a, b in zip(value if isinstance(value, tuple) else (value,),
                                first if isinstance(first, tuple) else (first,)):
                    assert torch.equal(a, b), (layer.spec.index, name)
                checked += 1
    assert checked >= cfg.num_layers  # every block returned its expert load at least
    assert {k: dict(getattr(state, k)) for k in snapshot} == snapshot and state.pool is pool
    for moe, (text, image) in zip(m.moe_layers(), counters):
        assert torch.equal(moe.load_text, text) and torch.equal(moe.load_image, image)


# --- distributed --------------------------------------------------------------------------------------------------

LAYOUTS = {
    "pp2_1f1b": dict(pp=2),
    "ep2": dict(ep=2),
    "tp2": dict(tp=2),
    "dp_shard2": dict(dp_shard=2),
}


def _worker(rank: int, world: int, names: list[str]) -> dict:
    """Every layout in one spawn, checkpointed; a failure stops the rest (peers may wait in a collective)."""
    results = {}
    for name in names:
        try:
            results[name] = layouts._train_small({**LAYOUTS[name], "activation_checkpoint": "full"})
        except Exception:
            results[name] = traceback.format_exc()
            break
    return results


_RUNS: list = []


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_checkpointed_layouts_match_single_process_without(name):
    if not _RUNS:
        _RUNS.append(run_distributed(_worker, 2, list(LAYOUTS)))
    ranks = [r[name] if name in r else f"{name} did not run" for r in _RUNS[0]]
    layouts._check(name, ranks, layouts.single_small_run())  # the single process without checkpointing


# --- checkpoints --------------------------------------------------------------------------------------------------

def _train_state(activation_checkpoint: str):
    cfg = layouts._config()
    pm, params = _build(cfg, activation_checkpoint)
    optim_cfg = OptimConfig()
    opt = build_optimizer(params, optim_cfg)
    return pm, TrainState(pm.module, opt, LRScheduler(opt, optim_cfg, total_steps=10))


def test_checkpoints_are_the_same_with_and_without(tmp_path):
    (with_ac, state_ac), (without, state) = _train_state("full"), _train_state("none")
    assert all(ac.is_checkpointed(b) for b in with_ac.module.layers)
    assert not any(ac.is_checkpointed(b) for b in without.module.layers)
    assert [n for n, _ in with_ac.module.named_parameters()] == [n for n, _ in without.module.named_parameters()]
    for pm, st in ((with_ac, state_ac), (without, state)):  # one step each, so the optimisers have state
        compute_gradients(pm, layouts._global_batch(0), list(pm.module.parameters()), layouts.MAX_NORM)
        st.optimizer.step()
        st.scheduler.step()
    saved = state_ac.state_dict()
    assert saved["model"].keys() == state.state_dict()["model"].keys()
    assert saved["optim"]["state"].keys() == state.state_dict()["optim"]["state"].keys()

    ckpt = Checkpointer(tmp_path, CheckpointConfig())
    ckpt.load(ckpt.save(1, {"train": state_ac}), {"train": state})  # into the model without checkpointing
    loaded = state.state_dict()
    for n, t in saved["model"].items():
        assert torch.equal(loaded["model"][n], t), n
    for n, moments in saved["optim"]["state"].items():
        for k, t in moments.items():
            assert torch.equal(loaded["optim"]["state"][n][k], t), (n, k)
    _, state_back = _train_state("full")  # and from there back into a checkpointed one
    ckpt.load(ckpt.save(2, {"train": state}), {"train": state_back})
    for n, t in state_back.state_dict()["model"].items():
        assert torch.equal(saved["model"][n], t), n

