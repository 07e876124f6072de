"""Proves expert parallelism (trainer/parallel/expert.py) computes what the single process computes.

- Dispatch and combine alone (2 ranks, 6 experts): under random, skewed and one-sided routing (experts with no
  tokens; a rank that sends everything away; a rank whose experts receive nothing), each rank receives exactly
  the rows, routing weights and per-expert counts that LocalDispatcher gives its experts on the whole batch,
  combine returns exactly the single-process output, and the gradients of the tokens, the routing weights and
  the expert weights through the all-to-alls are exactly the single-process ones. apply_ep on a meta-built
  MoE followed by to_empty + init_weights gives each rank the single process's expert rows (and the same
  shared-expert weights drawn after them); applied to a materialised MoE it keeps the rows it had. The routing
  weights travel bit-exactly in fp32, bf16 and fp64 messages.

The rest of what it proves: docs/testing.md#expert-parallelism
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import model as model_pkg
from model.config import MoEConfig
from model.moe import MoE
from tests.distributed import run_distributed
from tests.helpers import assert_rel, load_config
from trainer.config import ParallelDims
from trainer.parallel.apply import ParallelModel
from trainer.parallel.expert import AllToAllDispatcher, _pack, _unpack, apply_ep
from trainer.parallel.gradients import clip_grad_norm_, reduce_gradients, update_router_biases
from trainer.parallel.mesh import build_mesh

# --- dispatch / combine alone ---------------------------------------------------------------------------------

NUM_EXPERTS, TOPK, DIM, HIDDEN, TOKENS = 6, 2, 8, 5, 7  # 7 tokens per rank: awkward sizes on purpose


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_routing_weights_travel_bit_exactly(dtype):
    x = torch.randn(5, 7).to(dtype)
    w = torch.rand(5) * 1.5 + 1e-3  # values a bf16 column could not hold
    buf = _pack(x, w)
    assert buf.dtype == dtype and buf.shape == (5, 7 + max(1, 4 // x.element_size()))
    x2, w2 = _unpack(buf, 7)
    assert torch.equal(x2, x) and torch.equal(w2, w) and w2.dtype == torch.float32


def _routing(scenario: str, world: int) -> torch.Tensor:
    """Global topk_idx [world * TOKENS, K] (rank r's tokens are rows r*TOKENS ...), distinct experts per row."""
    gen = torch.Generator().manual_seed(7)
    if scenario == "random":
        return torch.stack([torch.randperm(NUM_EXPERTS, generator=gen)[:TOPK] for _ in range(world * TOKENS)])
    if scenario == "skewed":
        # Rank 0 sends everything to rank 1's experts 3 and 4; rank 1 mostly keeps its tokens home. Experts
        # 1, 2 and 5 get nothing; the two ranks send and receive very different numbers of rows.
        rank0 = torch.tensor([[3, 4], [4, 3]]).repeat(TOKENS, 1)[:TOKENS]
        rank1 = torch.tensor([[0, 3], [3, 0], [4, 3], [3, 4]]).repeat(TOKENS, 1)[:TOKENS]
        return torch.cat([rank0, rank1])
    assert scenario == "one_sided"  # every copy goes to rank 1: rank 0's experts receive no rows at all
    return torch.tensor([[5, 4], [4, 5]]).repeat(world * TOKENS, 1)[:world * TOKENS]


def _moe(seed: int, ep_mesh=None) -> MoE:
    cfg = MoEConfig(num_experts=NUM_EXPERTS, num_shared_experts=1, experts_per_token=TOPK, expert_dim=HIDDEN)
    torch.manual_seed(seed)
    with torch.device("meta"):
        moe = MoE(DIM, cfg, init_std=0.5)
    if ep_mesh is not None:
        apply_ep(moe, ep_mesh)
    moe.to_empty(device="cpu")
    moe.init_weights()
    return moe


def _route(moe: MoE, x, weights, idx, probe):
    """dispatch -> experts -> combine, then a fixed linear loss; returns (dispatched, output)."""
    dispatched = moe.dispatch(x, idx, weights)
    x_sorted, w_sorted, tokens_per_expert, handle = dispatched
    out = moe.combine(moe.experts_forward(x_sorted, w_sorted, tokens_per_expert), handle, x.shape[0])
    (out * probe).sum().backward()
    return dispatched, out


def _local_rows(grad, param):
    """An expert weight's gradient as this rank's rows, zeros where no token reached them (grad None)."""
    shard = param.to_local() if isinstance(param, DTensor) else param
    if grad is None:
        return torch.zeros_like(shard)
    return grad.to_local() if isinstance(grad, DTensor) else grad


def _dispatch_worker(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    ref, ep = _moe(seed=3), _moe(seed=3, ep_mesh=mesh)
    assert isinstance(ep.dispatcher, AllToAllDispatcher)
    e_local = NUM_EXPERTS // world
    mine = slice(rank * e_local, (rank + 1) * e_local)
    late = apply_ep(_moe(seed=3), mesh)  # applied to a materialised model: the rows are kept
    for name in ("w1", "w3", "w2"):
        for m in (ep, late):
            assert torch.equal(m.experts.get_parameter(name).to_local(), ref.experts.get_parameter(name)[mine]), name
    assert torch.equal(ep.shared_experts.w2.weight, ref.shared_experts.w2.weight)  # the generator stayed aligned

    received = {}
    gen = torch.Generator().manual_seed(11)
    for scenario in ("random", "skewed", "one_sided"):
        idx = _routing(scenario, world)  # [world * TOKENS, K]
        x = torch.randn(world * TOKENS, DIM, generator=gen)
        weights = torch.rand(world * TOKENS, TOPK, generator=gen)
        probe = torch.randn(world * TOKENS, DIM, generator=gen)
        rows = slice(rank * TOKENS, (rank + 1) * TOKENS)
        for m in (ref, ep):
            m.zero_grad(set_to_none=True)

        x_ref, w_ref = x.clone().requires_grad_(), weights.clone().requires_grad_()
        (xs_ref, ws_ref, tpe_ref, _), out_ref = _route(ref, x_ref, w_ref, idx, probe)
        x_ep, w_ep = x[rows].clone().requires_grad_(), weights[rows].clone().requires_grad_()
        (xs_ep, ws_ep, tpe_ep, _), out_ep = _route(ep, x_ep, w_ep, idx[rows], probe[rows])

        # This rank's experts' slice of the single-process dispatch: same rows, same order, same counts.
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), tpe_ref.cumsum(0)])
        lo, hi = int(starts[mine.start]), int(starts[mine.stop])
        assert torch.equal(tpe_ep, tpe_ref[mine]), scenario
        assert torch.equal(xs_ep, xs_ref[lo:hi]) and torch.equal(ws_ep, ws_ref[lo:hi]), scenario
        assert torch.equal(out_ep, out_ref[rows]), scenario
        assert torch.equal(x_ep.grad, x_ref.grad[rows]), scenario
        assert torch.equal(w_ep.grad, w_ref.grad[rows]), scenario
        for name in ("w1", "w3", "w2"):
            p_ep, p_ref = ep.experts.get_parameter(name), ref.experts.get_parameter(name)
            assert torch.equal(_local_rows(p_ep.grad, p_ep), _local_rows(p_ref.grad, p_ref)[mine]), (scenario, name)
        received[scenario] = xs_ep.shape[0]
    return received


@pytest.mark.distributed
def test_all_to_all_dispatch_combine_equals_local_dispatcher():
    received = run_distributed(_dispatch_worker, 2)
    # The scenarios did what they claim. Skewed: rank 0 gets the 4 copies rank 1 sends to expert 0, rank 1 all
    # 14 of rank 0's plus 10 of its own. One-sided: rank 0's experts get no rows at all.
    assert [r["skewed"] for r in received] == [4, 24]
    assert [r["one_sided"] for r in received] == [0, 2 * TOKENS * TOPK]


# --- the whole model: ep 2 and dp_shard 2 x ep 2 against the single process ----------------------------------

SEED, GLOBAL_ROWS, SEQ_LEN, STEPS, LR, MAX_NORM = 0, 4, 32, 2, 0.5, 0.5


def _optimizer(model):
    # SGD with momentum and weight decay, not AdamW: AdamW's first update is about lr * sign(g), so gradient
    # entries at fp32 rounding level move their parameter by +-lr on the noise any split of the batch makes
    # (summation order); with AdamW at lr 1e-3 the step-2 gradients differ by 1.4e-5 for that reason alone.
    # SGD keeps the step linear in the gradient, so 1e-5 tests the layout, not the optimiser's sensitivity.
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=0.1)


def _config():
    base = load_config("v41_tiny")
    # A bias rate large enough that the first update changes picks of the second step (910 of its 1536
    # token-layer top-k sets), and the sequence-wise balance loss on, so both balancing paths are covered.
    # Engram off: its gate's signed square root is steep where the score nears 0, so the fp32 rounding noise of
    # any split of the batch (the single process on two half batches, no parallelism at all) moves layer 4's
    # Engram gradients by 1e-3 at step 2 and the layers below by 4e-5. Engram has nothing to do with EP;
    # without it EP stays within 1.3e-6 of the single process on the scale _check_against_single uses.
    moe = dataclasses.replace(base.moe, bias_update_rate=0.05, seq_aux_loss_coef=1e-2)
    return dataclasses.replace(base, moe=moe, engram=dataclasses.replace(base.engram, layers=[]))


def _build(meshes=None):
    torch.manual_seed(SEED)
    with torch.device("meta"):
        model = model_pkg.build(_config())
    if meshes is not None:
        apply_ep(model, meshes.ep)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def _batch(step: int):
    gen = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, 4096, (GLOBAL_ROWS, SEQ_LEN + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


def _loss(model, input_ids, labels):
    fwd = model(input_ids, outputs=True)
    logits, aux = fwd.logits, fwd.aux
    assert set(aux) == {"indexer_kl", "moe_seq_balance"}
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten()) + sum(aux.values())


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _state(model) -> tuple[dict, dict]:
    params = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
    biases = {n: b.clone() for n, b in model.named_buffers() if n.endswith(("gate.bias", "gate.bias_image"))}
    return params, biases


def _single_run() -> dict:
    model = _build()
    # The trainer's functions, as a single-process job runs them (no meshes: no collectives).
    pm = ParallelModel(model, None, ParallelDims(dp_replicate=1, dp_shard=1, tp=1, pp=1, ep=1, cp=1), False)
    opt = _optimizer(model)
    out = {"loss": [], "grad_norm": [], "grads": []}
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = _loss(model, *_batch(step))
        loss.backward()
        # The trainer's clip on one process is torch's clip_grad_norm_ with a more accurate (fp64) norm.
        torch_norm = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]))
        out["grad_norm"].append(float(clip_grad_norm_(model.parameters(), MAX_NORM, pm)))
        assert out["grad_norm"][-1] == pytest.approx(torch_norm, rel=1e-5)
        out["loss"].append(float(loss.detach()))
        out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        update_router_biases(pm)
    out["params"], out["biases"] = _state(model)
    return out


def _ep_worker(rank: int, world: int, dp_shard: int, ep: int, ckpt_dir: str | None) -> dict:
    dims = ParallelDims(dp_replicate=1, dp_shard=dp_shard, tp=1, pp=1, ep=ep, cp=1)
    meshes = build_mesh(dims, "cpu")
    model = _build(meshes)
    # The trainer's gradient functions on the replicated path (fsdp False: plain averaging over dp stands in).
    pm = ParallelModel(model, meshes, dims, False)
    num_experts = model.cfg.moe.num_experts
    for moe in model.moe_layers():
        assert isinstance(moe.dispatcher, AllToAllDispatcher)
        assert moe.experts.w1.to_local().shape[0] == num_experts // ep
    opt = _optimizer(model)
    data_rank, data_size = meshes.data.get_local_rank(), meshes.data.size()
    rows = slice(data_rank * GLOBAL_ROWS // data_size, (data_rank + 1) * GLOBAL_ROWS // data_size)
    out = {"loss": [], "grad_norm": [], "grads": []}
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        input_ids, labels = _batch(step)
        loss = _loss(model, input_ids[rows], labels[rows])
        loss.backward()
        reduce_gradients(pm)
        out["grad_norm"].append(float(clip_grad_norm_(model.parameters(), MAX_NORM, pm)))
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, group=meshes.data.get_group())
        out["loss"].append(float(mean_loss) / data_size)
        out["grads"].append({n: _full(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        update_router_biases(pm)
    out["params"], out["biases"] = _state(model)
    if ckpt_dir is not None:
        dcp.save(model.state_dict(), checkpoint_id=ckpt_dir)
    if rank == 0:
        return out
    # Other ranks: enough to show they hold the same replicas as rank 0 (the full tensors stay on rank 0).
    return {"params": {n: p.double().sum() for n, p in out["params"].items()}, "biases": out["biases"],
            "loss": out["loss"], "grad_norm": out["grad_norm"]}


def _update_scale(rms: float, grad_norm: float, step: int) -> float:
    """How far the gradient floor `rms` of step `step` (0-based) moves a parameter by the end of the run: SGD's lr
    times the clip factor, counted once for each step it stays in the momentum (at most STEPS - step). A parameter's
    floor is the sum over steps: a parameter that starts at zero (the mHC bases) is as large as its few updates, and
    rounding in its gradient, allowed up to the floor there, moves it by this much."""
    return LR * min(1.0, MAX_NORM / grad_norm) * rms * (STEPS - step)


def _param_floor(single: dict) -> float:
    """The parameters' floor: `_update_scale` summed over the single process's steps, each at its gradient's RMS."""
    total = 0.0
    for step, grads in enumerate(single["grads"]):
        flat = torch.cat([g.flatten() for g in grads.values()])
        total += _update_scale((flat.norm() / flat.numel() ** 0.5).item(), single["grad_norm"][step], step)
    return total


@pytest.fixture(scope="module")
def single():
    # One thread, as each spawned rank has: the GEMMs' reduction order then differs only by the batch split.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _single_run()
    finally:
        torch.set_num_threads(threads)


def _check_against_single(results: list[dict], single: dict) -> None:
    first = results[0]
    assert first["loss"] == pytest.approx(single["loss"], rel=1e-5)
    assert first["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-5)
    assert single["grad_norm"][0] > MAX_NORM  # clipping was active
    for step in range(STEPS):
        grads = single["grads"][step]
        assert first["grads"][step].keys() == grads.keys()
        # Floor: the gradient's RMS over all parameters. The mHC `scale` gradients (3 numbers per site) are sums
        # that cancel to 1e-2 of that RMS, so their own size would make plain rounding look like a 5e-5 error.
        flat = torch.cat([g.flatten() for g in grads.values()])
        rms = (flat.norm() / flat.numel() ** 0.5).item()
        for name, g in grads.items():
            assert_rel(first["grads"][step][name], g, f"step {step + 1} grad {name}", floor=rms)
    moved = _param_floor(single)
    for name, p in single["params"].items():
        assert_rel(first["params"][name], p, f"param {name}", floor=moved)
    for name, b in single["biases"].items():
        assert torch.equal(first["biases"][name], b), name
    assert any(b.abs().sum() > 0 for b in single["biases"].values())  # the biases did move
    for other in results[1:]:
        assert other["loss"] == first["loss"] and other["grad_norm"] == first["grad_norm"]
        for name, p in first["params"].items():
            assert other["params"][name] == p.double().sum(), name
        for name, b in first["biases"].items():
            assert torch.equal(other["biases"][name], b), name


@pytest.mark.distributed
def test_ep2_matches_single_process(single, tmp_path):
    results = run_distributed(_ep_worker, 2, 1, 2, str(tmp_path / "ckpt"))
    _check_against_single(results, single)
    # The sharded checkpoint loads into the unsharded model and gives the single process's weights.
    model = _build()
    state = model.state_dict()
    dcp.load(state, checkpoint_id=str(tmp_path / "ckpt"))
    model.load_state_dict(state)
    params, biases = _state(model)
    for name, p in single["params"].items():
        assert_rel(params[name], p, f"loaded {name}", floor=_param_floor(single))
    for name, b in single["biases"].items():
        assert torch.equal(biases[name], b), name


@pytest.mark.distributed
def test_dp_shard2_ep2_matches_single_process(single):
    results = run_distributed(_ep_worker, 4, 2, 2, None)
    _check_against_single(results, single)
