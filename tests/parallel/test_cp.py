"""Proves context parallelism (trainer/parallel/context.py) computes what the single process computes.

Contract: at cp 3 on awkward sizes the entry gather, window halo, token gather and chunk mean give each rank exactly
its slice of the whole tensors, with exact gradients (integer data). The tiny model at cp 2 (windows, compressor
groups, top-k, pool and Engram n-grams of the second chunk reach into the first) over two SGD steps with clipping,
bias updates, the indexer KL and the balance loss: the losses, gradient norm, every gradient and parameter equal the
single process within 1e-5 relative (a tensor at the second step may instead stay within twice its rounding twin's
distance: docs/testing.md says why), the biases exactly, both ranks identical replicas; dropping the halo, the entry
gather or the offset moves the loss over ten times the tolerance. The same on the Triton attention path. The
chunk-length validation refuses lengths that cannot split, naming the values.

Design and reasoning: docs/testing.md#context-parallelism
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import model as model_pkg
from model.layer_plan import build_layer_plan
from tests.distributed import run_distributed
from tests.helpers import TRITON_SEQ_LEN, assert_rel, every_role_config, load_config
from trainer.config import ParallelDims
from trainer.parallel.apply import ParallelModel
from trainer.parallel.context import apply_cp, check_sequence_length, sequence_shard, shard_sequence
from trainer.parallel.gradients import clip_grad_norm_, reduce_gradients, update_router_biases
from trainer.parallel.mesh import build_mesh

# --- the exchanges alone --------------------------------------------------------------------------------------------

ROWS, CHUNK, D_MAIN, D_KEY, WINDOW = 2, 7, 5, 3, 5  # halo of WINDOW - 1 = 4 rows out of 7


def _ints(gen, *shape) -> torch.Tensor:
    return torch.randint(-4, 5, shape, generator=gen).float()


def _exchange_worker(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    shard = sequence_shard(mesh, WINDOW)
    assert shard.index == rank
    T, halo = CHUNK * world, WINDOW - 1
    mine = slice(rank * CHUNK, (rank + 1) * CHUNK)
    gen = torch.Generator().manual_seed(5)  # every rank draws the same whole tensors and every rank's probes
    main, keys, kv = _ints(gen, ROWS, T, D_MAIN), _ints(gen, ROWS, T, D_KEY), _ints(gen, ROWS, T, D_MAIN)
    probe_main, probe_keys = _ints(gen, world, ROWS, T, D_MAIN), _ints(gen, world, ROWS, T, D_KEY)
    probe_halo = _ints(gen, world, ROWS, halo + CHUNK, D_MAIN)

    # Entries: every rank gets the whole sequence; a chunk's gradient is the sum of every rank's probe on it.
    m, k = main[:, mine].clone().requires_grad_(), keys[:, mine].clone().requires_grad_()
    gm, gk = shard.gather_entries(m, k)
    assert torch.equal(gm, main) and torch.equal(gk, keys)
    ((gm * probe_main[rank]).sum() + (gk * probe_keys[rank]).sum()).backward()
    assert torch.equal(m.grad, probe_main.sum(0)[:, mine]) and torch.equal(k.grad, probe_keys.sum(0)[:, mine])

    # Halo: the previous chunk's last rows in front (zeros on rank 0); their gradient lands on the previous rank.
    x = kv[:, mine].clone().requires_grad_()
    out = shard.window_halo(x)
    before = kv[:, rank * CHUNK - halo:rank * CHUNK] if rank > 0 else torch.zeros(ROWS, halo, D_MAIN)
    assert torch.equal(out, torch.cat((before, kv[:, mine]), dim=1))
    (out * probe_halo[rank]).sum().backward()
    expected = probe_halo[rank][:, halo:].clone()
    if rank + 1 < world:
        expected[:, CHUNK - halo:] += probe_halo[rank + 1][:, :halo]
    assert torch.equal(x.grad, expected)

    # Tokens and masks of the whole sequence, no gradient; the chunk mean.
    ids = torch.randint(0, 1000, (ROWS, T), generator=gen)
    mask = torch.rand(ROWS, T, generator=gen) < 0.5
    assert torch.equal(shard.gather_tokens(ids[:, mine]), ids)
    assert torch.equal(shard.gather_tokens(mask[:, mine]), mask)
    assert torch.equal(shard.chunk_mean(torch.tensor([rank + 1.0, 2.0 * rank])), torch.tensor([2.0, 2.0]))
    assert torch.equal(shard_sequence(ids, mesh), ids[:, mine])


@pytest.mark.distributed
def test_exchanges_equal_slices_of_the_whole_sequence():
    run_distributed(_exchange_worker, 3)


# --- validation -----------------------------------------------------------------------------------------------------

def test_chunk_length_validation_names_the_values():
    cfg = load_config("v41_tiny")  # window 32, compression ratios 2 and 1
    check_sequence_length(cfg, 128, 2)
    check_sequence_length(cfg, 64, 2)  # chunks of 32 tokens: whole ratio-2 groups and a whole 31-row halo
    with pytest.raises(ValueError, match=r"sequence length 130 is not divisible by cp=4"):
        check_sequence_length(cfg, 130, 4)
    with pytest.raises(ValueError, match=r"chunk length 33 \(sequence length 66 / cp=2\).*compression ratio 2"):
        check_sequence_length(cfg, 66, 2)
    with pytest.raises(ValueError, match=r"chunk length 30 .* window halo of 31 rows \(model.attention.window=32"):
        check_sequence_length(cfg, 60, 2)
    check_sequence_length(cfg, 7, 1)  # one process: anything goes


# --- the whole model: cp 2 against the single process ---------------------------------------------------------------

SEED, ROWS_GLOBAL, SEQ_LEN, STEPS, LR, MAX_NORM, CP = 0, 2, 128, 2, 0.05, 0.5, 2


def _config(kernels: str = "reference", base=None):
    """v41_tiny, or `base`, on `kernels`."""
    base = dataclasses.replace(base or load_config("v41_tiny"), kernels=kernels)
    # A large bias rate, so the second step routes with visibly moved biases, and the sequence-wise balance loss on,
    # so the chunk mean of its expert frequencies is exercised.
    moe = dataclasses.replace(base.moe, bias_update_rate=0.05, seq_aux_loss_coef=1e-2)
    return dataclasses.replace(base, moe=moe)


def _parallel_model(model, meshes=None) -> ParallelModel:
    """What the trainer's gradient functions take: the single process (meshes None) or cp-only, no FSDP."""
    dims = ParallelDims(dp_replicate=1, dp_shard=1, tp=1, pp=1, ep=1, cp=1 if meshes is None else meshes.cp.size())
    return ParallelModel(model, meshes, dims, False)


def _build(cp_mesh=None, kernels: str = "reference", base=None):
    torch.manual_seed(SEED)
    with torch.device("meta"):
        model = model_pkg.build(_config(kernels, base))
    if cp_mesh is not None:
        apply_cp(model, cp_mesh)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def _batch(step: int, seq_len: int = SEQ_LEN):
    gen = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, 4096, (ROWS_GLOBAL, seq_len + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


def _losses(model, input_ids, labels) -> dict[str, torch.Tensor]:
    fwd = model(input_ids, outputs=True)
    logits, aux = fwd.logits, fwd.aux
    assert set(aux) == {"indexer_kl", "moe_seq_balance"}
    return {"lm": F.cross_entropy(logits.flatten(0, 1), labels.flatten()), **aux}


def _optimizer(model):
    # SGD, not AdamW: Adam's first step moves every weight by about lr whatever its gradient's size, so gradients at
    # the level of rounding (1.3e-9 or 1.4e-9 in an mHC base whose largest is 3e-5) made the weights after one step
    # differ by up to 7e-3 of their scale through no fault of the layout. SGD keeps the weights' differences
    # proportional to the gradients'.
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=0.1)


def _state(model) -> tuple[dict, dict]:
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    biases = {n: b.clone() for n, b in model.named_buffers() if n.endswith(("gate.bias", "gate.bias_image"))}
    return params, biases


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _rounding_twin(model, batch) -> dict[str, torch.Tensor]:
    """The gradients of `batch` with every weight nudged by one ulp in a random direction: how far rounding alone
    moves each gradient of the single process. Weights, gradients and MoE load counters are restored afterwards."""
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad for n, p in model.named_parameters()}
    loads = [(moe.load_text.clone(), moe.load_image.clone()) for moe in model.moe_layers()]
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.nextafter(p, torch.where(torch.rand(p.shape, generator=gen) < 0.5, -torch.inf, torch.inf)))
    model.zero_grad(set_to_none=True)
    sum(_losses(model, *batch).values()).backward()
    clip_grad_norm_(model.parameters(), MAX_NORM, _parallel_model(model))
    twin = _grads(model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[n])
            p.grad = grads[n]
    for moe, (text, image) in zip(model.moe_layers(), loads):
        moe.load_text.copy_(text)
        moe.load_image.copy_(image)
    return twin


def _single_run() -> dict:
    model = _build()
    pm = _parallel_model(model)
    opt = _optimizer(model)
    out = {"losses": [], "grad_norm": [], "grads": [], "twin_grads": []}
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        losses = _losses(model, *_batch(step))
        sum(losses.values()).backward()
        out["grad_norm"].append(float(clip_grad_norm_(model.parameters(), MAX_NORM, pm)))
        out["losses"].append({k: float(v.detach()) for k, v in losses.items()})
        out["grads"].append(_grads(model))
        # What rounding alone does to this step's gradient: at the first step the layouts' reduction orders differ
        # (the sequence split, and another CPU's SIMD path), from the second on their weights too.
        out["twin_grads"].append(_rounding_twin(model, _batch(step)))
        opt.step()
        update_router_biases(pm)
    out["params"], out["biases"] = _state(model)
    with torch.no_grad():
        out["final_loss"] = float(sum(_losses(model, *_batch(0)).values()))
    return out


def _rank_mean(values: dict[str, torch.Tensor], group) -> dict[str, float]:
    """The mean over cp ranks of each (per-rank) loss: what the job's loss is."""
    stacked = torch.stack([v.detach() for v in values.values()])
    dist.all_reduce(stacked, group=group)
    return {k: float(v) / dist.get_world_size(group) for k, v in zip(values, stacked)}


def _cp_worker(rank: int, world: int) -> dict:
    meshes = build_mesh(ParallelDims(dp_replicate=1, dp_shard=1, tp=1, pp=1, ep=1, cp=world), "cpu")
    cp_group = meshes.cp.get_group()
    model = _build(meshes.cp)
    pm = _parallel_model(model, meshes)
    opt = _optimizer(model)
    out = {"losses": [], "grad_norm": [], "grads": []}
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        input_ids, labels = (shard_sequence(t, meshes.cp) for t in _batch(step))
        assert input_ids.shape == (ROWS_GLOBAL, SEQ_LEN // world)
        losses = _losses(model, input_ids, labels)
        sum(losses.values()).backward()
        reduce_gradients(pm)  # mean over dp x ep x cp = the cp ranks here
        out["grad_norm"].append(float(clip_grad_norm_(model.parameters(), MAX_NORM, pm)))
        out["losses"].append(_rank_mean(losses, cp_group))
        out["grads"].append(_grads(model))
        opt.step()
        update_router_biases(pm)
    out["params"], out["biases"] = _state(model)

    # The same forward with one piece of CP switched off at a time: each must visibly change the loss.
    shard = model.sequence_shard
    broken = {
        "intact": shard,
        "no halo": dataclasses.replace(shard, window_halo=lambda kv: kv),
        # every rank's own entries in every chunk's place: the right shapes, no exchange
        "no entry gather": dataclasses.replace(shard, gather_entries=lambda *ts: tuple(t.repeat(1, world, 1)
                                                                                    for t in ts)),
        "no offset": dataclasses.replace(shard, index=0),
    }
    out["final_loss"] = {}
    with torch.no_grad():
        ids, labels = (shard_sequence(t, meshes.cp) for t in _batch(0))
        for name, variant in broken.items():
            model.sequence_shard = variant
            out["final_loss"][name] = sum(_rank_mean(_losses(model, ids, labels), cp_group).values())
    model.sequence_shard = shard
    if rank == 0:
        return out
    return {"params": {n: p.double().sum() for n, p in out["params"].items()}, "biases": out["biases"],
            "losses": out["losses"], "grad_norm": out["grad_norm"]}


def _update_scale(rms: float, grad_norm: float, step: int) -> float:
    """How far the gradient floor `rms` of step `step` (0-based) moves a parameter by the end of the run: SGD's lr
    times the clip factor, counted once for each step it stays in the momentum (at most STEPS - step). A parameter's
    floor is the sum over steps: a parameter that starts at zero (the mHC bases) is as large as its few updates, and
    rounding in its gradient, allowed up to the floor there, moves it by this much."""
    return LR * min(1.0, MAX_NORM / grad_norm) * rms * (STEPS - step)


def _global_rel_error(actual: dict, expected: dict) -> float:
    """|actual - expected| / |expected| over the whole gradient vector (every tensor concatenated)."""
    diff = torch.cat([(actual[n] - g).flatten() for n, g in expected.items()])
    return (diff.norm() / torch.cat([g.flatten() for g in expected.values()]).norm()).item()


@pytest.mark.distributed
def test_cp2_matches_single_process():
    cfg = _config()
    chunk = SEQ_LEN // CP
    # The set-up reaches across the chunk boundary: a window longer than 1, ratio-2 groups whole in each chunk, and
    # the second chunk's decoder queries see more entries (ratio 1) than the candidate pool and top-k can hold.
    assert 1 < cfg.attention.window <= chunk and chunk % 2 == 0
    assert cfg.csa2.index_topk < cfg.csa2.candidate_topk_blocks * cfg.csa2.candidate_block_size < chunk

    def reference() -> dict:  # the single process, while the ranks run
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as each rank runs: the reductions then differ only by the sequence split
        try:
            return _single_run()
        finally:
            torch.set_num_threads(threads)

    results, single = run_distributed(_cp_worker, CP, meanwhile=reference)

    first = results[0]
    for step in range(STEPS):
        for name, value in single["losses"][step].items():
            assert first["losses"][step][name] == pytest.approx(value, rel=1e-5), (step, name)
    assert all(v > 0 for v in single["losses"][0].values())  # every aux loss is live
    assert first["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-5)
    assert single["grad_norm"][0] > MAX_NORM  # clipping was active
    moved = 0.0
    for step in range(STEPS):
        grads, twin = single["grads"][step], single["twin_grads"][step]
        assert first["grads"][step].keys() == grads.keys()
        assert _global_rel_error(first["grads"][step], grads) < 1e-5, step
        # Floor: the RMS of the whole gradient. The mHC base/scale gradients are sums that cancel to ~1e-5 of their
        # terms, so their own size would make plain rounding look like an error.
        flat = torch.cat([g.flatten() for g in grads.values()])
        rms = (flat.norm() / flat.numel() ** 0.5).item()
        if twin is not None:  # the twin moved by rounding only (no routing or top-k decision flipped)
            assert _global_rel_error(twin, grads) < 1e-4, step
        for name, g in grads.items():
            assert_rel(first["grads"][step][name], g, f"step {step + 1} grad {name}", rms,
                        None if twin is None else twin[name])
        moved += _update_scale(rms, single["grad_norm"][step], step)
    for name, p in single["params"].items():
        assert_rel(first["params"][name], p, f"param {name}", floor=moved)
    for name, b in single["biases"].items():
        assert torch.equal(first["biases"][name], b), name
    assert any(b.abs().sum() > 0 for b in single["biases"].values())  # the biases did move
    second = results[1]
    assert second["losses"] == first["losses"] and second["grad_norm"] == first["grad_norm"]
    for name, p in first["params"].items():
        assert second["params"][name] == p.double().sum(), name
    for name, b in first["biases"].items():
        assert torch.equal(second["biases"][name], b), name

    final = first["final_loss"]
    assert final["intact"] == pytest.approx(single["final_loss"], rel=1e-5)
    for name in ("no halo", "no entry gather", "no offset"):
        assert abs(final[name] - single["final_loss"]) > 1e-4 * single["final_loss"], name


# --- the Triton attention and indexer under cp ----------------------------------------------------------------------

# The every-role config (tests/helpers.py: SWA, encoder Full + Reuse, decoder Full building the pool, Reuse,
# pool-restricted Reindex with Engram; window 8, top-k 6, pool 12 entries) on one row of TRITON_SEQ_LEN = 16 tokens:
# chunks of 8, so each rank's window still reaches into the other chunk (a whole 7-row halo), and the second chunk's
# ratio-1 queries see more entries than the pool holds


def _cp_triton_worker(rank: int, world: int) -> dict:
    from kernels import indexer, sparse_attention

    calls: list[str] = []
    for module, name in ((sparse_attention, "sparse_attention"), (indexer, "index_scores"),
                         (indexer, "candidate_pool"), (indexer, "index_scores_pool")):
        inner = getattr(module, name)
        setattr(module, name, lambda *a, _inner=inner, _name=name, **k: calls.append(_name) or _inner(*a, **k))
    meshes = build_mesh(ParallelDims(dp_replicate=1, dp_shard=1, tp=1, pp=1, ep=1, cp=world), "cpu")
    model = _build(meshes.cp, kernels="triton", base=every_role_config())
    batch = tuple(shard_sequence(t, meshes.cp)[:1] for t in _batch(0, TRITON_SEQ_LEN))  # one short row: the interpreter
    losses = _losses(model, *batch)
    sum(losses.values()).backward()
    reduce_gradients(_parallel_model(model, meshes))
    return {"losses": _rank_mean(losses, meshes.cp.get_group()), "grads": _grads(model), "calls": sorted(set(calls))}


@pytest.mark.distributed
def test_cp2_triton_attention_equals_single_process():
    """model.kernels=triton under cp 2: each rank's queries run the sparse-attention kernel over the previous chunk's
    window halo and the gathered entries, and the indexer kernels score, pool and pick at the chunk's position
    offset. One forward/backward equals the single process on the same kernels: every loss within 1e-5 relative,
    every gradient within 1e-4 of its scale (at least the whole gradient's RMS). The every-role config on one row of
    TRITON_SEQ_LEN tokens: the CPU interpreter runs the kernels."""
    cfg = _config("triton", every_role_config())
    chunk = TRITON_SEQ_LEN // CP
    check_sequence_length(cfg, TRITON_SEQ_LEN, CP)
    # as in the cp 2 test above: the window and the entries reach across the chunk boundary, the second chunk's
    # ratio-1 queries see more entries than the pool holds, and the pool more than the top-k
    assert 1 < cfg.attention.window <= chunk
    assert cfg.csa2.index_topk < cfg.csa2.candidate_topk_blocks * cfg.csa2.candidate_block_size < TRITON_SEQ_LEN
    assert {s.role for s in build_layer_plan(cfg)} == {"swa", "full", "reindex", "reuse"} and cfg.engram.layers

    def reference() -> dict:  # the single process, on one thread as each rank, while the ranks run
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            model = _build(kernels="triton", base=every_role_config())
            losses = _losses(model, *(t[:1] for t in _batch(0, TRITON_SEQ_LEN)))
            sum(losses.values()).backward()
            return {"losses": {k: float(v.detach()) for k, v in losses.items()}, "grads": _grads(model)}
        finally:
            torch.set_num_threads(threads)

    runs, ref = run_distributed(_cp_triton_worker, CP, meanwhile=reference)
    for rank, run in enumerate(runs):
        assert run["calls"] == ["candidate_pool", "index_scores", "index_scores_pool", "sparse_attention"], rank
        for name, value in ref["losses"].items():
            assert run["losses"][name] == pytest.approx(value, rel=1e-5), (rank, name)
        grads = ref["grads"]
        assert run["grads"].keys() == grads.keys()
        flat = torch.cat([g.flatten() for g in grads.values()])
        rms = (flat.norm() / flat.numel() ** 0.5).item()
        for name, g in grads.items():
            # 1e-4: the Engram gate's slope near its floor (the cp 2 test above) turns the kernels' other summation
            # order over a chunk into up to ~4e-5 of the table gradient's scale; a missing halo row, offset or
            # entry moves the losses by far more than 1e-5 (the cp 2 test's ablations)
            torch.testing.assert_close(run["grads"][name], g, rtol=1e-4, atol=1e-4 * max(g.abs().max().item(), rms),
                                       msg=lambda m, name=name: f"rank {rank} grad {name}: {m}")
