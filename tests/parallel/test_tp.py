"""Proves tensor parallelism (trainer/parallel/tensor.py `apply_tp`) computes what the single process computes.

Contract: tp 2 on the tiny V4.1 (fp32, CPU, gloo), without sequence parallelism and with it (vocab-sharded logits,
the loss under `loss_parallel`). Built on meta -> apply_tp -> to_empty -> init_weights, every parameter and buffer
equals the single process's exactly, and no random number is drawn on a DTensor. With Engram off, three passes with
SGD steps and bias updates: every loss within 1e-5 relative, every gradient within 1e-5 of its norm (at least the
whole gradient's RMS per element), the router biases identical. With Engram on, the plan's Engram is bit-exact
(output, streams' and parameters' gradients, the table's gradient complete under SP) and the model's loss within
1e-5. The layout is the plan's: every parameter a DTensor, the split tensors halved. The Triton attention path under
tp equals the single process too.

Design and reasoning: docs/testing.md#tensor-parallelism
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import loss_parallel
from torch.overrides import TorchFunctionMode

import model as model_pkg
from model.layer_plan import build_layer_plan
from trainer.parallel.tensor import apply_tp, reduce_partial_grads
from tests.distributed import run_distributed
from tests.helpers import TRITON_SEQ_LEN, assert_rel, every_role_config, load_config
from trainer.parallel.apply import ParallelModel
from trainer.parallel.gradients import update_router_biases

TP = 2
B, T = 2, 48  # T > window (32) and > the decoder's candidate pool (32 entries); T % tp == 0 for SP
PASSES = 3
LR = 0.1  # plain SGD: the update is linear in the gradient, so equality tests the layout, not the optimiser
LAYOUTS = {"tp2": {"sequence_parallel": False, "loss_parallel": False},
           "tp2_sp": {"sequence_parallel": True, "loss_parallel": True}}
ENGRAM_LAYER = 1


def _config(engram: bool, kernels: str = "auto"):
    cfg = load_config("v41_tiny", kernels=kernels)
    return cfg if engram else dataclasses.replace(cfg, engram=dataclasses.replace(cfg.engram, layers=[]))


class _DTensorDraws(TorchFunctionMode):
    """Records random fills called on a DTensor itself (names of the functions)."""

    RANDOM = ("normal", "uniform", "rand", "bernoulli", "exponential", "random_", "geometric", "cauchy")

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if any(r in name for r in self.RANDOM) and any(isinstance(a, DTensor) for a in (*args, *kwargs.values())):
            self.calls.append(name)
        return func(*args, **kwargs)


def _build(engram: bool, mesh=None, layout=None, draws: list | None = None, kernels: str = "auto", cfg=None):
    """cfg: the model config (default `_config(engram, kernels)`)."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = model_pkg.build(cfg or _config(engram, kernels))
    if mesh is not None:
        apply_tp(model, mesh, layout["sequence_parallel"], loss_parallel=layout["loss_parallel"])
    model.to_empty(device="cpu")
    with _DTensorDraws() as recorder:
        model.init_weights()
    if draws is not None:
        draws += recorder.calls
    return model


def _state(model) -> dict:
    return {n: t.detach().clone() for n, t in list(model.named_parameters()) + list(model.named_buffers())}


def _init_mismatches(model, state: dict) -> list[str]:
    """Names whose (gathered) tensor differs from the single process's `state`."""
    return [n for n, t in list(model.named_parameters()) + list(model.named_buffers())
            if not torch.equal(_full(t.detach()), state[n])]


def _batch(rows: int = B, seq_len: int = T):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 4096, (rows, seq_len + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


def _image_mask():
    """A few image tokens: dead for Engram (no memory read, n-grams broken), routed with the image bias."""
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[0, 5:9] = True
    mask[1, 30] = True
    return mask


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _loss(model, ids, targets, image_mask=None):
    fwd = model(ids, image_mask=image_mask, outputs=True)
    logits, aux = fwd.logits, fwd.aux
    return _full(F.cross_entropy(logits.flatten(0, 1), targets.flatten())) + aux["indexer_kl"]


def _train(model, loss_context, passes: int = PASSES, rows: int = B, seq_len: int = T) -> dict:
    """`passes` forward/backward passes, an SGD step and a router-bias update between them."""
    ids, targets = _batch(rows, seq_len)
    opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=False)
    losses, grads = [], []
    for i in range(passes):
        opt.zero_grad(set_to_none=True)
        with loss_context():
            loss = _loss(model, ids, targets)
            loss.backward()
        reduce_partial_grads(model)
        losses.append(float(loss.detach()))
        grads.append({n: _full(p.grad).detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        assert not any(isinstance(p.grad, DTensor) and p.grad.placements[0].is_partial() for p in model.parameters())
        if i < passes - 1:
            opt.step()
            # the trainer's update; tp peers route the same tokens, so no counts cross ranks (meshes=None)
            update_router_biases(ParallelModel.local(model))
    biases = {n: b.clone() for n, b in model.named_buffers() if n.endswith(("gate.bias", "gate.bias_image"))}
    return {"loss": losses, "grads": grads, "biases": biases}


def _engram_inputs(model) -> tuple:
    """(S, row_ids, dead) that the model's Engram at ENGRAM_LAYER receives on the batch with image tokens."""
    seen = {}
    hook = model.layers[ENGRAM_LAYER].engram.register_forward_pre_hook(
        lambda _, args: seen.setdefault("args", tuple(a.detach().clone() for a in args)))
    with torch.no_grad():
        model(_batch()[0], image_mask=_image_mask())
    hook.remove()
    return seen["args"]


def _engram_step(engram, S, row_ids, dead, cotangent) -> dict:
    S = S.clone().requires_grad_()
    out = engram(S, row_ids, dead)
    (out * cotangent).sum().backward()
    return {"out": out.detach(), "grad_S": S.grad,
            "grads": {n: _full(p.grad) for n, p in engram.named_parameters()},
            "grad_placements": {n: getattr(p.grad, "placements", None) for n, p in engram.named_parameters()}}


def _tp_worker(rank: int, world_size: int, state: dict, state_engram: dict, engram_case: tuple) -> dict:
    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for name, layout in LAYOUTS.items():
        loss_context = loss_parallel if layout["loss_parallel"] else contextlib.nullcontext
        draws: list[str] = []
        model = _build(False, mesh, layout, draws)
        init_mismatches = _init_mismatches(model, state)
        placements = {n: (tuple(p.placements), tuple(p.to_local().shape)) if isinstance(p, DTensor) else None
                      for n, p in model.named_parameters()}
        result = {"placements": placements, **_train(model, loss_context)}

        model = _build(True, mesh, layout, draws)
        result["init_mismatches"] = init_mismatches + _init_mismatches(model, state_engram)
        result["dtensor_draws"] = draws
        with loss_context(), torch.no_grad():
            result["engram_model_loss"] = float(_loss(model, *_batch(), _image_mask()))
        S, row_ids, dead, cotangent = engram_case
        if layout["sequence_parallel"]:  # the streams and their gradient are sequence shards; ids stay whole
            rows = slice(rank * T // world_size, (rank + 1) * T // world_size)
            S, cotangent = S[:, rows], cotangent[:, rows]
        result["engram"] = _engram_step(model.layers[ENGRAM_LAYER].engram, S, row_ids, dead, cotangent)
        out[name] = result
    return out


@pytest.fixture(scope="module")
def runs():
    # One thread, as each spawned rank has: GEMM reduction orders then differ only where the layout splits a sum.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = _build(False)
        state = _state(model)
        reference = _train(model, contextlib.nullcontext)

        model = _build(True)
        state_engram = _state(model)
        with torch.no_grad():
            engram_model_loss = float(_loss(model, *_batch(), _image_mask()))
        S, row_ids, dead = _engram_inputs(model)
        assert dead.any() and not dead.all()
        cotangent = torch.randn(S.shape, generator=torch.Generator().manual_seed(2))
        engram = _engram_step(model.layers[ENGRAM_LAYER].engram, S, row_ids, dead, cotangent)
    finally:
        torch.set_num_threads(threads)
    tp = run_distributed(_tp_worker, TP, state, state_engram, (S, row_ids, dead, cotangent))
    return {"reference": reference, "engram_model_loss": engram_model_loss, "engram": engram, "tp": tp}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_tp_init_equals_single_process(runs, layout):
    for rank, result in enumerate(runs["tp"]):
        assert result[layout]["init_mismatches"] == [], f"rank {rank}"
        assert result[layout]["dtensor_draws"] == [], f"rank {rank}: random fills on a DTensor (use init_normal)"


@pytest.mark.distributed
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_tp_training_equals_single_process(runs, layout):
    ref = runs["reference"]
    assert ref["loss"][0] > ref["loss"][1] > ref["loss"][2]  # the SGD steps train the model
    assert any(b.abs().sum() > 0 for b in ref["biases"].values())  # the router biases moved
    for rank, result in enumerate(runs["tp"]):
        run = result[layout]
        assert run["loss"] == pytest.approx(ref["loss"], rel=1e-5), f"rank {rank}"
        for i, grads in enumerate(ref["grads"]):
            assert run["grads"][i].keys() == grads.keys()
            flat = torch.cat([g.flatten() for g in grads.values()])
            rms = (flat.norm() / flat.numel() ** 0.5).item()
            for name, g in grads.items():
                assert_rel(run["grads"][i][name], g, f"rank {rank} pass {i + 1} grad {name}", floor=rms)
        for name, b in ref["biases"].items():
            assert torch.equal(run["biases"][name], b), name


@pytest.mark.distributed
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_tp_engram_exact(runs, layout):
    ref = runs["engram"]
    for rank, result in enumerate(runs["tp"]):
        run = result[layout]
        assert run["engram_model_loss"] == pytest.approx(runs["engram_model_loss"], rel=1e-5), f"rank {rank}"
        rows = slice(None)
        if LAYOUTS[layout]["sequence_parallel"]:
            rows = slice(rank * T // TP, (rank + 1) * T // TP)
        engram = run["engram"]
        assert torch.equal(engram["out"], ref["out"][:, rows]), f"rank {rank} output"
        assert torch.equal(engram["grad_S"], ref["grad_S"][:, rows]), f"rank {rank} stream gradient"
        for name, g in ref["grads"].items():
            assert torch.equal(engram["grads"][name], g), f"rank {rank} grad {name}"
            # complete on every rank: no per-step reduction of the table over tp
            assert engram["grad_placements"][name] == (Replicate(),), name


@pytest.mark.distributed
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_tp_layout(runs, layout):
    placements = runs["tp"][0][layout]["placements"]
    assert all(v is not None for v in placements.values()), "every parameter is a DTensor on the tp mesh"
    cfg = _config(False)
    a, m = cfg.attention, cfg.moe
    hd = a.num_heads * a.head_dim
    expected = {
        "layers.2.attn.wq_b.weight": ((Shard(0),), (hd // TP, a.q_lora_rank)),
        "layers.2.attn.attn_sink": ((Shard(0),), (a.num_heads // TP,)),
        "layers.2.attn.wo_a.weight": ((Shard(0),), (a.o_groups // TP * a.o_lora_rank, hd // a.o_groups)),
        "layers.2.attn.wo_b.weight": ((Shard(1),), (cfg.dim, a.o_groups * a.o_lora_rank // TP)),
        "layers.2.attn.wkv.weight": ((Replicate(),), (a.head_dim, cfg.dim)),
        "layers.2.attn.indexer.wq_b.weight": ((Replicate(),),
                                              (cfg.csa2.index_num_heads * cfg.csa2.index_head_dim, a.q_lora_rank)),
        "layers.2.ffn.experts.w1": ((Shard(1),), (m.num_experts, m.expert_dim // TP, cfg.dim)),
        "layers.2.ffn.experts.w2": ((Shard(2),), (m.num_experts, cfg.dim, m.expert_dim // TP)),
        "layers.2.ffn.shared_experts.w1.weight": ((Shard(0),), (m.expert_dim // TP, cfg.dim)),
        "layers.2.ffn.shared_experts.w2.weight": ((Shard(1),), (cfg.dim, m.expert_dim // TP)),
        "layers.2.ffn.gate.weight": ((Replicate(),), (m.num_experts, cfg.dim)),
        "layers.2.hc_attn.fn": ((Replicate(),), None),
        "embed.weight": ((Shard(1),), (cfg.vocab_size, cfg.dim // TP)),
        "head.weight": ((Shard(0),), (cfg.vocab_size // TP, cfg.dim)),
    }
    for name, (want_placements, want_shape) in expected.items():
        got_placements, got_shape = placements[name]
        assert got_placements == want_placements, name
        assert want_shape is None or got_shape == want_shape, name


# -- the Triton attention and indexer under tp ----------------------------------------------------------------------

def _triton_config():
    """The every-role config (tests/helpers.py: SWA, encoder Full + Reuse, decoder Full building the pool, Reuse,
    pool-restricted Reindex), Engram off as above."""
    cfg = every_role_config(kernels="triton")
    return dataclasses.replace(cfg, engram=dataclasses.replace(cfg.engram, layers=[]))


TRITON_KERNELS = ("sparse_attention", "index_scores", "candidate_pool", "index_scores_pool")


def _count_calls(module, name: str, counter: list) -> None:
    inner = getattr(module, name)

    def counted(*args, **kwargs):
        counter.append(name)
        return inner(*args, **kwargs)

    setattr(module, name, counted)


def _triton_worker(rank: int, world_size: int) -> dict:
    from kernels import indexer, sparse_attention

    calls: list[str] = []
    _count_calls(sparse_attention, "sparse_attention", calls)
    for name in TRITON_KERNELS[1:]:
        _count_calls(indexer, name, calls)
    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for name, layout in LAYOUTS.items():
        loss_context = loss_parallel if layout["loss_parallel"] else contextlib.nullcontext
        model = _build(False, mesh, layout, cfg=_triton_config())
        calls.clear()
        out[name] = {**_train(model, loss_context, passes=1, rows=1, seq_len=TRITON_SEQ_LEN),
                     "calls": sorted(set(calls))}
    return out


@pytest.mark.distributed
def test_tp_triton_attention_equals_single_process():
    """model.kernels=triton under tp 2 (and tp 2 + sp): the sparse-attention and indexer kernels (scores, candidate
    pool, pool scores) run on each rank's heads (the head-summed KL target completed by the plan's all-reduce at
    HeadSum) and one forward/backward equals the single process on the same kernels: the loss within 1e-5 relative,
    every gradient within 1e-5 of its scale. The model is the every-role config (every layer role: SWA, Full,
    Reuse, the pool-building decoder Full, the pool-restricted Reindex; the MoE and mHC as in v41_tiny) on one row of
    TRITON_SEQ_LEN tokens (tests/helpers.py), one pass: the CPU interpreter runs the kernels."""
    cfg = _triton_config()
    assert {s.role for s in build_layer_plan(cfg)} == {"swa", "full", "reindex", "reuse"}

    def reference() -> dict:  # the single process, on one thread as each rank, while the ranks run
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return _train(_build(False, cfg=cfg), contextlib.nullcontext, passes=1, rows=1, seq_len=TRITON_SEQ_LEN)
        finally:
            torch.set_num_threads(threads)

    runs, ref = run_distributed(_triton_worker, TP, meanwhile=reference)
    for rank, result in enumerate(runs):
        for layout, run in result.items():
            assert run["calls"] == sorted(TRITON_KERNELS), (rank, layout)
            assert run["loss"] == pytest.approx(ref["loss"], rel=1e-5), (rank, layout)
            grads = ref["grads"][0]
            assert run["grads"][0].keys() == grads.keys()
            flat = torch.cat([g.flatten() for g in grads.values()])
            rms = (flat.norm() / flat.numel() ** 0.5).item()
            for name, g in grads.items():
                assert_rel(run["grads"][0][name], g, f"rank {rank} {layout} grad {name}", floor=rms)
