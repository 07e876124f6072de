"""Proves pipeline parallelism (trainer/parallel/pipeline.py) computes what the single process computes.

- Splitting: `split_points` cuts only at SWA layers and Full/Reindex group starts, its split is the most balanced
  one (brute force over every admissible split, stage cost = layers + 1 for the embedding + 1 for the head), the
  flagship's recommended splits are the documented ones, and impossible splits fail with a ValueError naming the
  numbers.
- The boundary state: for the test plan below (a second decoder Full layer at 9 so that h_{L/2} must travel,
  Engram at layers 1 and 8) each cut ships exactly the state its later layers read: S, pre, aux always; h_{L/2},
  a source's main KV + indexer keys, an index source's top-k, the candidate pool, Engram row ids only when a
  later layer needs them; the flagship byte counts quoted in the module docstring. Bit-packing of the masks is
  exact at awkward widths.

The rest of what it proves: docs/testing.md#pipeline-parallelism
"""

from __future__ import annotations

import dataclasses
import itertools
import traceback

import pytest
import torch
import torch.nn.functional as F

import model as model_pkg
from model.layer_plan import build_layer_plan
from tests.distributed import run_distributed
from tests.helpers import TRITON_SEQ_LEN, assert_rel, every_role_config, load_config
from trainer.config import ParallelDims
from trainer.parallel.apply import ParallelModel, StageGroup
from trainer.parallel.gradients import clip_grad_norm_, update_router_biases
from trainer.parallel.mesh import build_mesh
from trainer.parallel.pipeline import (
    allowed_cuts,
    build_pipeline,
    split_model,
    split_points,
    stage_ids_for_rank,
)
from trainer.parallel.pipeline_wire import boundary_bytes, boundary_slots, pack_bits, unpack_bits

SEED, MICROBATCHES, ROWS, SEQ_LEN, STEPS, LR, MAX_NORM = 0, 4, 1, 32, 2, 0.5, 0.5


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # One thread, as each spawned rank has: the reference's GEMMs then reduce in the ranks' order, and the tiny
    # model's small GEMMs run faster than with threads competing for two shared cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _config(kernels: str = "auto"):
    """v41_tiny with a second decoder Full layer (9, so h_{L/2} has a consumer after the first decoder layer),
    Engram at layers 1 and 8 (row ids must cross the encoder/decoder cuts), and both MoE balancing paths on."""
    base = load_config("v41_tiny", kernels=kernels)
    csa2 = dataclasses.replace(base.csa2, kv_source_layers=[2, 4, 6, 9], index_source_layers=[2, 4, 6, 8, 9, 10])
    moe = dataclasses.replace(base.moe, bias_update_rate=0.05, seq_aux_loss_coef=1e-2)
    return dataclasses.replace(base, csa2=csa2, moe=moe, engram=dataclasses.replace(base.engram, layers=[1, 8]))


# --- splitting ------------------------------------------------------------------------------------------------------


def _stage_costs(num_layers: int, cuts: list[int]) -> list[float]:
    bounds = [0, *cuts, num_layers]
    costs = [float(b - a) for a, b in zip(bounds, bounds[1:])]
    costs[0] += 1.0
    costs[-1] += 1.0
    return costs


def test_split_points_are_balanced_group_starts():
    plan = build_layer_plan(_config())
    cuts_ok = allowed_cuts(plan)
    assert cuts_ok == [1, 2, 4, 6, 8, 9, 10]  # SWA layers and group starts; never a Reuse layer
    assert all(plan[c].role != "reuse" for c in cuts_ok)
    for num_stages in range(1, len(cuts_ok) + 2):
        cuts = split_points(plan, num_stages)
        assert len(cuts) == num_stages - 1 and set(cuts) <= set(cuts_ok)
        best = min(max(_stage_costs(12, list(c))) for c in itertools.combinations(cuts_ok, num_stages - 1))
        assert max(_stage_costs(12, cuts)) == best, (num_stages, cuts)
    # 4 stages: [2, 6, 9] and [2, 6, 10] balance equally; 9 ships h_mid (1 tensor), 10 layer 9's KV + keys (2)
    assert split_points(plan, 4) == [2, 6, 9]
    assert split_points(build_layer_plan(load_config("v41_tiny")), 2) == [6]
    flagship = build_layer_plan(load_config("v41_flash"))
    assert split_points(flagship, 2) == [20]
    assert split_points(flagship, 4) == [8, 20, 32]
    assert split_points(flagship, 8) == [2, 8, 14, 20, 24, 28, 36]
    assert max(_stage_costs(40, split_points(flagship, 8, any_layer=True))) == 6.0
    assert stage_ids_for_rank(1, 2, 2, "Interleaved1F1B") == [1, 3]
    assert stage_ids_for_rank(1, 2, 2, "ZBVZeroBubble") == [1, 2]


def test_impossible_splits_fail_naming_the_numbers():
    plan = build_layer_plan(_config())
    with pytest.raises(ValueError, match=r"num_layers=12 into 9 pipeline stages.*at most 8 stages"):
        split_points(plan, 9)
    with pytest.raises(ValueError, match=r"num_layers=40 into 16 pipeline stages.*at most 10 stages"):
        split_points(build_layer_plan(load_config("v41_flash")), 16)
    with pytest.raises(ValueError, match=r"got 0"):
        split_points(plan, 0)
    with pytest.raises(ValueError, match=r"exactly pp_virtual=2 stages per rank, got 1"):
        stage_ids_for_rank(0, 2, 1, "ZBVZeroBubble")
    with pytest.raises(ValueError, match=r"cuts must increase"):
        with torch.device("meta"):
            split_model(model_pkg.build(_config()), [6, 6], [0])


# --- the boundary state ---------------------------------------------------------------------------------------------


def test_each_cut_ships_exactly_what_later_layers_read():
    cfg = _config()

    def names(cut):
        return [(s.name, s.layer) for s in boundary_slots(cfg, cut, 2, 32)]

    common = [("streams", None), ("pre", None)]
    engram8 = [("engram_rows", 8), ("engram_dead", None)]
    aux = [("aux", None)]
    assert names(1) == common + [("engram_rows", 1)] + engram8 + aux
    assert names(3) == common + [("kv_main", 2), ("kv_keys", 2), ("topk", 2)] + engram8 + aux
    assert names(6) == common + engram8 + aux  # h_mid is made by the stage that starts at layer 6
    assert names(7) == common + [("h_mid", None), ("kv_main", 6), ("kv_keys", 6), ("topk", 6), ("pool", None)] \
        + engram8 + aux
    assert names(9) == common + [("h_mid", None)] + aux
    assert names(10) == common + [("kv_main", 9), ("kv_keys", 9)] + aux
    assert names(11) == common + [("kv_main", 9), ("kv_keys", 9), ("topk", 10)] + aux
    shapes = {(s.name, s.layer): (s.shape, s.dtype, s.grad) for s in boundary_slots(cfg, 7, 2, 32)}
    assert shapes[("streams", None)] == ((2, 32, 4, 128), torch.float32, True)
    assert shapes[("kv_keys", 6)] == ((2, 32, 32), torch.float32, True)
    assert shapes[("topk", 6)] == ((2, 32, 4), torch.uint8, False)  # 32 entries, bit-packed
    assert shapes[("engram_rows", 8)] == ((2, 32, 6), torch.int64, False)

    # The flagship figures of the module docstring (bf16, B = 1, T = 4096).
    flagship = load_config("v41_flash")
    T, b, n, dim = 4096, 2, 4, 5120
    expected = b * T * n * dim + 4 * T * n + b * T * (512 + 128) + T * T // 8 + 12  # S, pre, KV + keys, pool, aux
    assert boundary_bytes(flagship, 24, 1, T, act_dtype=torch.bfloat16) == expected
    assert abs(expected / 1e6 - 175.18) < 0.01


@pytest.mark.parametrize("width", [1, 7, 8, 9, 33])
def test_pack_bits_roundtrip(width):
    mask = torch.rand(3, 5, width, generator=torch.Generator().manual_seed(width)) < 0.4
    packed = pack_bits(mask)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, -(-width // 8))
    assert torch.equal(unpack_bits(packed, width), mask)


# --- stage modules in one process -----------------------------------------------------------------------------------


def _build(kernels: str = "auto", cfg=None):
    """cfg: the model config (default `_config(kernels)`)."""
    torch.manual_seed(SEED)
    with torch.device("meta"):
        model = model_pkg.build(cfg or _config(kernels))
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def _chain(stages, input_ids, image_mask=None):
    x = (input_ids,) if image_mask is None else (input_ids, image_mask)
    for stage in stages:
        x = stage(*x)
    return x


@pytest.mark.parametrize("autocast, image_mask, splits", [
    (None, False, ([7], [2, 6, 9], list(range(1, 12)))),  # every layer its own stage
    (None, True, ([3, 5, 8, 11],)),
    # ratio-2 KV (main pooled in fp32, keys in bf16) crosses at 3, ratio-1 KV (bf16) at 7
    (torch.bfloat16, False, ([3, 7],)),
])
def test_stage_modules_chained_equal_the_whole_model(autocast, image_mask, splits):
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 4096, (2, SEQ_LEN), generator=gen)
    mask = (torch.rand(2, SEQ_LEN, generator=gen) < 0.2) if image_mask else None
    model = _build()
    with torch.autocast("cpu", dtype=autocast or torch.float32, enabled=autocast is not None):
        fwd = model(input_ids, image_mask=mask, outputs=True)
        ref, aux = fwd.logits, fwd.aux
    names = set(model.state_dict())
    for cuts in splits:
        stages = split_model(model, cuts, range(len(cuts) + 1), image_mask=image_mask)
        for stage in stages:
            stage.set_shapes(2, SEQ_LEN, autocast_dtype=autocast)
        logits, (kl_sum, kl_count, seq) = _chain(stages, input_ids, mask)
        assert torch.equal(logits, ref), cuts
        torch.testing.assert_close(model.cfg.indexer.loss_coef * kl_sum / kl_count, aux["indexer_kl"])
        torch.testing.assert_close(seq, aux["moe_seq_balance"])
        keys = [k for stage in stages for k in stage.state_dict()]
        assert len(keys) == len(set(keys)) and set(keys) == names, cuts
    if autocast is not None:  # the ratio-2 source's main KV crossed as fp32 and its keys as restored bf16
        slots = [s.name for s in stages[0]._out]
        assert "kv_dtypes" in slots


def _triton_config():
    """The every-role config (tests/helpers.py: its decoder Full layer 3, which builds the pool, is followed by a Reuse
    layer 4 and the pool-restricted Reindex 5, with Engram) and a second decoder Full layer 6: a cut at 4 ships h_{L/2}
    (for 6), layer 3's KV and keys and its top-k (for 4 and 5), the pool (for 5) and Engram's row ids (for 5)."""
    base = every_role_config(kernels="triton")
    c = base.csa2
    csa2 = dataclasses.replace(c, compress_ratios=[*c.compress_ratios, 1], kv_source_layers=[*c.kv_source_layers, 6],
                               index_source_layers=[*c.index_source_layers, 6])
    moe = dataclasses.replace(base.moe, bias_update_rate=0.05, seq_aux_loss_coef=1e-2)  # as `_config`
    return dataclasses.replace(base, num_layers=7, csa2=csa2, moe=moe)


TRITON_CUT = 4


def test_stage_modules_on_the_triton_path_carry_ids():
    """model.kernels=triton (the CUDA default; the CPU interpreter here): the top-k and the pool live in the context
    as int32 ids and cross the cuts as such; chained stages give the whole model's logits and gradients bit for bit
    and its indexer KL to the rounding of its last division (cut at TRITON_CUT: h_{L/2}, KV, a top-k and the pool
    cross). One row of TRITON_SEQ_LEN tokens, one split, the 7-layer `_triton_config`: the interpreter is slow."""
    cfg = _triton_config()
    seq_len = TRITON_SEQ_LEN
    names = {(s.name, s.layer) for s in boundary_slots(cfg, TRITON_CUT, 1, seq_len, ids=True)}
    assert {("h_mid", None), ("kv_main", 3), ("kv_keys", 3), ("topk", 3), ("pool", None), ("engram_rows", 5)} <= names
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 4096, (1, seq_len), generator=gen)
    model = _build(cfg=cfg)
    fwd = model(input_ids, outputs=True)
    ref, aux = fwd.logits, fwd.aux
    (ref.square().mean() + aux["indexer_kl"]).backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    for cuts in ([TRITON_CUT],):
        stages = split_model(model, cuts, range(len(cuts) + 1))
        for stage in stages:
            stage.set_shapes(1, seq_len)
        sent = {(s.name, s.dtype) for stage in stages[:-1] for s in stage._out}
        assert ("topk", torch.int32) in sent and ("pool", torch.int32) in sent, (cuts, sent)
        logits, (kl_sum, kl_count, seq) = _chain(stages, input_ids)
        assert torch.equal(logits, ref), cuts
        kl = model.cfg.indexer.loss_coef * kl_sum / kl_count
        # the same per-layer sums; the coefficient and the division apply in another order than the model's
        torch.testing.assert_close(kl, aux["indexer_kl"], rtol=1e-6, atol=0)
        (logits.square().mean() + kl).backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert grads.keys() == ref_grads.keys(), cuts
        assert all(torch.equal(grads[n], g) for n, g in ref_grads.items()), cuts
        model.zero_grad(set_to_none=True)


# --- the pipeline against the single process ------------------------------------------------------------------------

RUNS = {  # schedule -> (pp_virtual, cuts; None = split_points)
    "1F1B": (1, [7]),
    "Interleaved1F1B": (2, None),
    "ZBVZeroBubble": (2, None),
}


def _batch(step: int):
    gen = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, 4096, (MICROBATCHES * ROWS, SEQ_LEN + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


def _optimizer(params):
    # SGD, as in test_ep.py: AdamW's first step is ~lr * sign(g), which turns rounding-level gradient noise into
    # lr-sized moves; SGD keeps the comparison about the layout.
    return torch.optim.SGD(params, lr=LR, momentum=0.9, weight_decay=0.1)


def _biases(named_buffers) -> dict:
    return {n: b.clone() for n, b in named_buffers if n.endswith(("gate.bias", "gate.bias_image"))}


def _single_run() -> dict:
    model = _build()
    # The trainer's clip and bias update as a single-process job runs them (no meshes: no collectives).
    pm = ParallelModel(model, None, ParallelDims(dp_replicate=1, dp_shard=1, tp=1, pp=1, ep=1, cp=1), False)
    opt = _optimizer(model.parameters())
    out = {"loss": [], "whole_batch_loss": [], "grad_norm": [], "grads": []}
    for step in range(STEPS):
        input_ids, labels = _batch(step)
        with torch.no_grad():  # one forward of the whole batch: the loss the micro-batched run must match
            fwd = model(input_ids, outputs=True)
            logits, aux = fwd.logits, fwd.aux
            out["whole_batch_loss"].append(float(F.cross_entropy(logits.flatten(0, 1), labels.flatten())
                                                 + sum(aux.values())))
        for moe in model.moe_layers():  # that forward counted loads; only the step's may count
            moe.load_text.zero_()
            moe.load_image.zero_()
        opt.zero_grad(set_to_none=True)
        loss = 0.0
        for mb in range(MICROBATCHES):  # the trainer's grad_accum loop
            rows = slice(mb * ROWS, (mb + 1) * ROWS)
            fwd = model(input_ids[rows], outputs=True)
            logits, aux = fwd.logits, fwd.aux
            mb_loss = F.cross_entropy(logits.flatten(0, 1), labels[rows].flatten()) + sum(aux.values())
            (mb_loss / MICROBATCHES).backward()
            loss += float(mb_loss.detach()) / MICROBATCHES
        out["loss"].append(loss)
        out["grad_norm"].append(float(clip_grad_norm_(model.parameters(), MAX_NORM, pm)))
        out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        update_router_biases(pm)
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["biases"] = _biases(model.named_buffers())
    return out


def _pp_train(rank: int, world: int, meshes, schedule: str) -> dict:
    num_virtual, cuts = RUNS[schedule]
    reference = _build().state_dict()
    with torch.device("meta"):
        model = model_pkg.build(_config())
    cuts = cuts or split_points(model.plan, world * num_virtual)
    stages = split_model(model, cuts, stage_ids_for_rank(rank, world, num_virtual, schedule))
    for stage in stages:  # meta -> to_empty -> init_weights, then the single process's weights by name
        stage.to_empty(device="cpu")
        stage.init_weights()
        stage.load_state_dict({k: reference[k] for k in stage.state_dict()})
    pp_group = meshes.pp.get_group()
    pipe = build_pipeline(stages, pp_group, schedule=schedule, n_microbatches=MICROBATCHES, microbatch_size=ROWS,
                          seq_len=SEQ_LEN, device=torch.device("cpu"))
    # What `parallelize` gives this rank (apply.py): its stages as one StageGroup, for the trainer's gradient functions.
    dims = ParallelDims(dp_replicate=1, dp_shard=1, tp=1, pp=world, ep=1, cp=1)
    pm = ParallelModel(StageGroup(stages), meshes, dims, False, stages=stages, pipeline=pipe)
    opt = _optimizer(list(pipe.parameters()))
    out = {"cuts": cuts, "loss": [], "grad_norm": [], "grads": []}
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        out["loss"].append(pipe.step(*_batch(step)))
        out["grad_norm"].append(float(clip_grad_norm_(pipe.parameters(), MAX_NORM, pm)))
        out["grads"].append({n: p.grad.clone() for stage in stages for n, p in stage.named_parameters()
                             if p.grad is not None})
        opt.step()
        update_router_biases(pm)
    out["params"] = {n: p.detach().clone() for stage in stages for n, p in stage.named_parameters()}
    out["biases"] = _biases((n, b) for stage in stages for n, b in stage.named_buffers())
    return out


def _pp_worker(rank: int, world: int) -> dict:
    """Every schedule in one spawn (process start-up dominates); a failure is reported per schedule."""
    meshes = build_mesh(ParallelDims(dp_replicate=1, dp_shard=1, tp=1, pp=world, ep=1, cp=1), "cpu")
    results = {}
    for schedule in RUNS:
        try:
            results[schedule] = _pp_train(rank, world, meshes, schedule)
        except Exception:
            results[schedule] = traceback.format_exc()
            break  # the peers may be stuck in a collective of this schedule: stop here
    return results


_SINGLE: list = []


def single_run() -> dict:
    """`_single_run`, once per session: the reference of this file and of test_pp_torch211.py."""
    if not _SINGLE:
        _SINGLE.append(_single_run())
    return _SINGLE[0]


@pytest.fixture(scope="module")
def single():
    return single_run()


@pytest.fixture(scope="module")
def pp_runs():
    runs, _ = run_distributed(_pp_worker, 2, meanwhile=single_run)  # the reference while the ranks run
    return runs


def _merge(ranks: list[dict], key: str, step: int | None = None) -> dict:
    merged = {}
    for r in ranks:
        part = r[key] if step is None else r[key][step]
        assert not set(part) & set(merged), f"{key}: two pipeline ranks hold the same tensor"
        merged.update(part)
    return merged


def _check(pp_runs, single, schedule):
    ranks = [r.get(schedule, f"{schedule} did not run (an earlier schedule failed)") for r in pp_runs]
    for r in ranks:
        assert not isinstance(r, str), r
    first = ranks[0]
    assert all(r["loss"] == first["loss"] and r["grad_norm"] == first["grad_norm"] for r in ranks)
    assert first["loss"] == pytest.approx(single["loss"], rel=1e-5)
    assert first["loss"] == pytest.approx(single["whole_batch_loss"], rel=1e-5)
    assert first["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-5)
    assert single["grad_norm"][0] > MAX_NORM  # clipping was active
    for step in range(STEPS):
        grads = _merge(ranks, "grads", step)
        assert grads.keys() == single["grads"][step].keys()
        for name, g in single["grads"][step].items():
            assert_rel(grads[name], g, f"{schedule} step {step + 1} grad {name}")
    params = _merge(ranks, "params")
    assert params.keys() == single["params"].keys()
    for name, p in single["params"].items():
        assert_rel(params[name], p, f"{schedule} param {name}")
    biases = _merge(ranks, "biases")
    assert biases.keys() == single["biases"].keys()
    for name, b in single["biases"].items():
        assert torch.equal(biases[name], b), f"{schedule} bias {name}"
    assert any(b.abs().sum() > 0 for b in single["biases"].values())  # the biases did move
    return first["cuts"]


@pytest.mark.distributed
def test_pp2_1f1b_matches_single_process(pp_runs, single):
    assert _check(pp_runs, single, "1F1B") == [7]


@pytest.mark.distributed
def test_pp2_interleaved_1f1b_matches_single_process(pp_runs, single):
    assert _check(pp_runs, single, "Interleaved1F1B") == [2, 6, 9]


@pytest.mark.distributed
def test_pp2_zbv_zero_bubble_matches_single_process(pp_runs, single):
    assert _check(pp_runs, single, "ZBVZeroBubble") == [2, 6, 9]
