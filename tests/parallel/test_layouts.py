"""Proves the trainer's parallel wiring: every layout trains exactly like the single process.

Each layout (dp_replicate, dp_shard (FSDP2), tp with and without sequence parallelism, pp 1F1B and interleaved, ep,
cp, and their combinations up to tp 2 x pp 2 x ep 2 on 8 ranks; under optim=muon `MUON_LAYOUTS`) runs the trainer's
own code path on gloo, fp32, tests/helpers.py's every-role model with Engram, and is compared with one process on
the same global batch: initial weights exactly; at both optimiser steps the loss, every auxiliary loss, the clipped
norm and every gradient within 1e-5 relative (per-tensor floor: test_tolerance_is_the_rounding_floor); after the
steps every parameter within that bound and the balancing biases exactly; every rank the same loss and norm. Not
vacuous: clipping is active, the biases move, the sequence-balance loss is on. Muon layouts are held to their own
rounding floor (MUON_TOL, test_muon_tolerance_is_the_rounding_floor). One spawn per world size.

Design and reasoning: docs/testing.md#parallel-layouts
"""

from __future__ import annotations

import dataclasses
import traceback

import pytest
import torch

from tests.distributed import run_distributed
from model.attention import head_rows
from optim.builder import build_optimizer
from tests.helpers import EVERY_ROLE_SEQ_LEN, every_role_config, load_config, load_optim_config
from trainer.config import ParallelConfig, TrainerConfig
from trainer.parallel.apply import validate_layout
from trainer.parallel.gradients import full_named_tensors, update_router_biases
from trainer.train import build_model, compute_gradients, setup_runtime, trainable_parameters

SEED, ROWS, SEQ_LEN, MICROBATCHES, STEPS, LR, MAX_NORM = 0, 1, 64, 4, 2, 0.1, 0.5

# name -> ParallelConfig fields; the world size is their product
LAYOUTS = {
    "dp_replicate2": dict(dp_replicate=2),
    "dp_shard2": dict(dp_shard=2),
    "tp2": dict(tp=2),
    "tp2_sp": dict(tp=2, sequence_parallel=True),
    "pp2_1f1b": dict(pp=2),
    "pp2_v2_interleaved": dict(pp=2, pp_virtual=2, pp_schedule="Interleaved1F1B"),
    "ep2": dict(ep=2),
    "cp2": dict(cp=2),
    "tp2_pp2": dict(tp=2, pp=2),
    "tp2_sp_pp2": dict(tp=2, sequence_parallel=True, pp=2),
    "dp_shard2_ep2": dict(dp_shard=2, ep=2),
    "tp2_pp2_ep2": dict(tp=2, pp=2, ep=2),
    # two more in the 4-rank spawn, for code paths the list above leaves out: HSDP's 2-D FSDP mesh, and what FSDP
    # leaves to reduce over cp
    "dp_replicate2_dp_shard2": dict(dp_replicate=2, dp_shard=2),
    "dp_shard2_cp2": dict(dp_shard=2, cp=2),
    "tp2_ep2": dict(tp=2, ep=2),  # issue 6's 4-GPU layout
}
# the layouts trained with optim=muon too, in the 2-rank spawn, under the name "muon <layout>"
MUON_LAYOUTS = ["dp_shard2", "tp2", "ep2", "pp2_1f1b"]
MUON_LR, MUON_TOL = 3e-3, 1e-4
# the second step's gradients under optim=muon: taken at parameters one Newton-Schulz update apart, so each layout's
# rounding is lifted once more (the reversed single process: 7.5e-5 on an AMD EPYC, for Engram's wkv)
MUON_STEP2_GRAD_TOL = 5e-4


def _world(fields: dict) -> int:
    """The product of the sizes: the ranks the layout runs on."""
    out = 1
    for key in ("dp_replicate", "dp_shard", "tp", "pp", "ep", "cp"):
        out *= fields.get(key, 1)
    return out


def _config(base=None):
    """v41_tiny, or `base`, with the MoE settings of the comparison."""
    base = base or load_config("v41_tiny")
    # A bias rate large enough that the first update changes picks of the second step, and the sequence-wise
    # balance loss on (its whole-sequence statistics cross cp chunks). Engram on, at layers 1 and 4.
    moe = dataclasses.replace(base.moe, bias_update_rate=0.05, seq_aux_loss_coef=1e-2)
    return dataclasses.replace(base, moe=moe)


def _small_config():
    """The model this file's layouts train: the every-role config with `_config`'s MoE settings, Engram at 0 and 4."""
    cfg = _config(every_role_config())
    return dataclasses.replace(cfg, engram=dataclasses.replace(cfg.engram, layers=[0, 4]))


def _global_batch(step: int, seq_len: int = SEQ_LEN) -> list[dict]:
    """The step's MICROBATCHES micro-batches of ROWS x seq_len tokens, as the loader hands them out.

    Unequal valid-token counts, so that every layout must normalise the loss over the global batch's valid tokens
    (trainer/loss.py) to match the single process: micro-batch k has its first k / 4 of the labels masked (-100;
    under cp 2 the third micro-batch's first chunk has none valid), and the second step carries per-token loss
    weights in [0.5, 1.5)."""
    gen = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, 4096, (MICROBATCHES, ROWS, seq_len + 1), generator=gen)
    out = []
    for k, mb in enumerate(ids):
        labels = mb[:, 1:].clone()
        labels[:, :k * seq_len // MICROBATCHES] = -100
        batch = {"input_ids": mb[:, :-1], "labels": labels}
        if step == 1:
            batch["loss_weights"] = 0.5 + torch.rand(ROWS, seq_len, generator=gen)
        out.append(batch)
    return out


def _biases(module) -> dict:
    return {n: b.clone() for n, b in module.named_buffers() if n.endswith(("gate.bias", "gate.bias_image"))}


def _train(fields: dict, cfg=None, seq_len: int = SEQ_LEN, compile_backend: str | None = None,
           optim: str | None = None, batches=None, inspect=None) -> dict:
    """One layout through the trainer's code path; what this rank saw (whole tensors, gathered). cfg: the model
    (default `_config()`, v41_tiny); compile_backend: trainer.compile's (tests/parallel/test_compile_layouts.py);
    optim: a conf/optim config the trainer's builder makes (at MUON_LR, no warm-up) instead of SGD; batches:
    step -> the global batch's micro-batches (default `_global_batch`); inspect: pm -> a dict of numbers about the
    built model, kept in the result."""
    parallel = ParallelConfig(**fields)
    rt = setup_runtime(TrainerConfig(device="cpu", precision="fp32", num_threads=1), parallel)
    data_rank, data_size = (0, 1) if rt.meshes is None else (rt.meshes.data.get_local_rank(), rt.meshes.data.size())
    accum = MICROBATCHES // data_size
    cfg = cfg or _config()
    pm = build_model(cfg, rt, parallel, SEED, batch_size=ROWS, seq_len=seq_len, grad_accum=accum,
                     compile_backend=compile_backend)
    params = trainable_parameters(pm.module, cfg)
    if optim is None:
        opt = torch.optim.SGD(params, lr=LR, momentum=0.9, weight_decay=0.1)
    else:
        opt = build_optimizer(params, load_optim_config(optim, lr=MUON_LR, warmup_steps=0),
                              named=pm.module.named_parameters(), head_rows=head_rows(cfg))
    out = {"init": full_named_tensors(pm.module), "loss": [], "grad_norm": [], "grads": [], "aux": [], "extra": []}
    out.update(inspect(pm) if inspect else {})
    pm.module.train()
    for step in range(STEPS):
        batch = batches(step) if batches else _global_batch(step, seq_len)
        mine = batch[data_rank * accum:(data_rank + 1) * accum]
        stats = compute_gradients(pm, mine, params, MAX_NORM, step=step + 1)
        out["loss"].append(stats.loss)
        out["grad_norm"].append(stats.grad_norm)
        out["aux"].append(stats.aux)
        out["extra"].append(stats.extra)
        out["grads"].append(full_named_tensors(pm.module, grads=True))
        opt.step()
        opt.zero_grad(set_to_none=True)
        update_router_biases(pm)
    out["params"] = full_named_tensors(pm.module)
    out["biases"] = _biases(pm.module)
    if rt.meshes is not None:
        coords = dict(zip(rt.meshes.world.mesh_dim_names, rt.meshes.world.get_coordinate()))
        out["pp_rank"] = coords["pp"]
        out["reporter"] = all(c == 0 for axis, c in coords.items() if axis != "pp")
        # every rank's view of the whole parameters, to show that all ranks of a stage hold the same model
        out["checksum"] = {n: float(p.double().sum()) for n, p in out["params"].items()}
        if not out["reporter"]:  # the tensors of one rank per pipeline stage are enough; the rest: numbers
            out = {k: out[k] for k in ("loss", "grad_norm", "reporter", "pp_rank", "checksum")}
    return out


def _train_small(fields: dict, compile_backend: str | None = None, optim: str | None = None) -> dict:
    """`_train` on the model this file compares: `_small_config()` on EVERY_ROLE_SEQ_LEN tokens."""
    return _train(fields, _small_config(), EVERY_ROLE_SEQ_LEN, compile_backend, optim)


def train_each(names: list[str], train) -> dict:
    """train(name) for each layout in turn in one spawn (process start-up dominates); a failure is reported per
    layout and stops the rest (the peers may be stuck in a collective of the failed one)."""
    results = {}
    for name in names:
        try:
            results[name] = train(name)
        except Exception:
            results[name] = traceback.format_exc()
            break
    return results


def _train_named(name: str) -> dict:
    """A layout by its name: LAYOUTS', or "muon <layout>" for that layout under optim=muon."""
    if name.startswith("muon "):
        return _train_small(LAYOUTS[name.removeprefix("muon ")], optim="muon")
    return _train_small(LAYOUTS[name])


def _worker(rank: int, world: int, names: list[str]) -> dict:
    """Every layout of this world size in one spawn."""
    return train_each(names, _train_named)


def _single(train) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs
    try:
        return train({})
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def single():
    """The single process on v41_tiny: the reference of test_zero_bubble.py, which imports it."""
    return _single(_train)


_SINGLE_SMALL: list = []


def single_small_run() -> dict:
    """The single process on the model this file's layouts train, once per session: the reference of this file and of
    test_activation_checkpoint.py's and test_engram_trainer.py's layouts too (the same model, batches and optimiser)."""
    if not _SINGLE_SMALL:
        _SINGLE_SMALL.append(_single(_train_small))
    return _SINGLE_SMALL[0]


@pytest.fixture(scope="module")
def single_small():
    return single_small_run()


@pytest.fixture(scope="module")
def single_small_muon():
    return _single(lambda fields: _train_small(fields, optim="muon"))


_RUNS: dict[int, list] = {}


def _runs(world: int) -> list:
    """The results of every layout of `world` ranks, one spawn per world size, run on first use."""
    if world not in _RUNS:
        names = [n for n, f in LAYOUTS.items() if _world(f) == world]
        names += [f"muon {n}" for n in MUON_LAYOUTS if _world(LAYOUTS[n]) == world]
        _RUNS[world] = run_distributed(_worker, world, names)
    return _RUNS[world]


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected||."""
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def _errors(actual: dict, expected: dict, what: str) -> dict[str, float]:
    """Norm-relative error of each tensor, and of the whole vector ("<what> all"). A tensor's floor is its share of
    the whole vector's norm, sqrt(numel) x the whole vector's RMS (see test_tolerance_is_the_rounding_floor)."""
    assert actual.keys() == expected.keys(), what
    diff = torch.stack([(actual[n] - t).double().norm() for n, t in expected.items()])
    norm = torch.stack([t.double().norm() for t in expected.values()])
    numel = torch.tensor([t.numel() for t in expected.values()], dtype=torch.float64)
    total = norm.square().sum().sqrt()
    floor = total * (numel / numel.sum()).sqrt()  # sqrt(numel) x RMS of the whole vector
    out = dict(zip((f"{what} {n}" for n in expected), (diff / torch.maximum(norm, floor)).tolist()))
    out[f"{what} all"] = float(diff.square().sum().sqrt() / total)
    return out


def _merge(ranks: list[dict], key: str, step: int | None = None) -> dict:
    """One dict of whole tensors from the reporting rank of every pipeline stage."""
    merged = {}
    for r in ranks:
        if not r["reporter"]:
            continue
        part = r[key] if step is None else r[key][step]
        assert not set(part) & set(merged), f"{key}: two pipeline stages hold the same tensor"
        merged.update(part)
    return merged


def _check(name: str, ranks: list, single: dict, tol: float = 1e-5, later_grad_tol: float | None = None) -> None:
    """`later_grad_tol`: the tolerance of the gradients after the first step (default `tol`)."""
    for r in ranks:
        assert not isinstance(r, str), f"{name} failed on a rank:\n{r}"
    first = ranks[0]
    for r in ranks:  # one loss and one norm for the whole job, one model per pipeline stage
        assert r["loss"] == first["loss"] and r["grad_norm"] == first["grad_norm"], name
        (reporter,) = [q for q in ranks if q["reporter"] and q["pp_rank"] == r["pp_rank"]]
        assert r["checksum"] == reporter["checksum"], f"{name}: ranks of one stage hold different parameters"
    assert first["loss"] == pytest.approx(single["loss"], rel=tol), name
    assert first["grad_norm"] == pytest.approx(single["grad_norm"], rel=tol), name
    for step in range(STEPS):
        # a sync-free ep dispatcher logs the share of copies it dropped: none at a capacity that never drops
        assert first["aux"][step].pop("aux_metric/moe_dropped_share", 0.0) == 0.0, name
        assert first["aux"][step].keys() == single["aux"][step].keys()
        for key, value in single["aux"][step].items():
            # a KL is a difference of cross-entropies: its rounding is absolute (fp32's epsilon times a nat), not
            # relative to its small value (the indexer's KL ~1e-4 moved by 1.0e-5 of itself under ep2 with
            # MKL_CBWR=AVX2 and ATEN_CPU_CAPABILITY=default)
            floor = 1e-7 if "kl" in key else 0.0
            assert first["aux"][step][key] == pytest.approx(value, rel=tol, abs=floor), (name, step, key)
    init = _merge(ranks, "init")
    assert init.keys() == single["init"].keys(), name
    mismatched = [n for n, t in single["init"].items() if not torch.equal(init[n], t)]
    assert mismatched == [], f"{name}: initial values differ from the single process's"
    errors = {}
    for step in range(STEPS):
        errors.update(_errors(_merge(ranks, "grads", step), single["grads"][step], f"step {step + 1} grad"))
    errors.update(_errors(_merge(ranks, "params"), single["params"], "param"))
    limit = {k: later_grad_tol if later_grad_tol and " grad" in k and not k.startswith("step 1 ") else tol
             for k in errors}
    bad = {k: v for k, v in errors.items() if not v < limit[k]}
    assert not bad, f"{name}: relative errors above {tol} (later gradients {later_grad_tol or tol}): {bad}"
    biases = _merge(ranks, "biases")
    assert biases.keys() == single["biases"].keys()
    for n, b in single["biases"].items():
        assert torch.equal(biases[n], b), f"{name}: bias {n}"


def _reversed_run(monkeypatch, optim: str | None = None) -> dict:
    """The single process fed each step's micro-batches in reverse order: the same sums in another order."""
    forward_order = _global_batch
    monkeypatch.setattr(__import__(__name__, fromlist=["_global_batch"]), "_global_batch",
                        lambda step, seq_len=SEQ_LEN: forward_order(step, seq_len)[::-1])
    return _single(lambda fields: _train_small(fields, optim=optim))


def test_reference_is_not_vacuous(single_small):
    single = single_small
    assert all(norm > MAX_NORM for norm in single["grad_norm"])  # clipping active at both steps
    assert any(b.abs().sum() > 0 for b in single["biases"].values())  # the biases moved
    assert single["aux"][0]["aux/moe_seq_balance"] > 0 and single["aux"][0]["aux/indexer_kl"] > 0
    assert any(n.endswith("engram.table") for n in single["grads"][0])  # Engram is in the comparison


def test_tolerance_is_the_rounding_floor(single_small, monkeypatch):
    """Why a tensor's error is measured against at least its share of the whole gradient's norm: the single
    process alone, fed the same 4 micro-batches in reverse order (the same sum in another order), moves the
    gradient of some mHC `base` / `scale` parameter (a few entries each, sums that cancel to ~1% of the gradient's
    RMS) by more than 1e-5 of its own norm at the second step, while with the floor every tensor stays below half the
    layouts' tolerance (3.1e-6 at most seen, under MKL_CBWR=AVX2 with ATEN_CPU_CAPABILITY=default)."""
    reversed_run = _reversed_run(monkeypatch)
    grads, twin = single_small["grads"][1], reversed_run["grads"][1]
    own_norm = {n: _rel(twin[n], g) for n, g in grads.items()}
    assert max(own_norm.values()) > 1e-5  # without a floor, the single process would fail against itself
    assert max(_errors(twin, grads, "grad").values()) < 1e-5 / 2


@pytest.mark.distributed
@pytest.mark.parametrize("name", [n for n, f in LAYOUTS.items() if _world(f) == 2])
def test_two_rank_layouts_match_single_process(name, single_small):
    _check(name, [r[name] if name in r else f"{name} did not run" for r in _runs(2)], single_small)


@pytest.mark.distributed
@pytest.mark.parametrize("name", MUON_LAYOUTS)
def test_muon_layouts_match_single_process(name, single_small_muon):
    assert _world(LAYOUTS[name]) == 2
    _check(f"muon {name}", [r.get(f"muon {name}", f"muon {name} did not run") for r in _runs(2)], single_small_muon,
           tol=MUON_TOL, later_grad_tol=MUON_STEP2_GRAD_TOL)


def test_muon_tolerance_is_the_rounding_floor(single_small_muon, monkeypatch):
    """Why optim=muon's layouts are held to MUON_TOL, not 1e-5: the single process alone, fed its micro-batches in
    reverse order, ends more than 1e-5 from itself (Newton-Schulz lifts the rounding in a gradient's near-null
    directions), and less than a quarter of MUON_TOL; while every parameter's update is more than 10 x MUON_TOL of
    its norm, so the tolerance still sees any tensor's update go wrong. The second step's gradients, taken at those
    parameters, move more (7.5e-5 of their share on an AMD EPYC, 2-rank ep 1.0e-4), hence MUON_STEP2_GRAD_TOL; the first
    step's stay at MUON_TOL (no update yet: 1e-7)."""
    reversed_run = _reversed_run(monkeypatch, optim="muon")
    ref = single_small_muon
    floor = max(_errors(reversed_run["params"], ref["params"], "param").values())
    assert 1e-5 < floor < MUON_TOL / 4
    assert max(_errors(reversed_run["grads"][0], ref["grads"][0], "grad").values()) < MUON_TOL / 100
    later = max(_errors(reversed_run["grads"][1], ref["grads"][1], "grad").values())
    assert 1e-5 < later < MUON_STEP2_GRAD_TOL / 4
    moved = {n: _rel(p, ref["init"][n]) for n, p in ref["params"].items()}
    assert min(moved.values()) > 10 * MUON_TOL, min(moved.items(), key=lambda kv: kv[1])


@pytest.mark.distributed
@pytest.mark.parametrize("name", [n for n, f in LAYOUTS.items() if _world(f) == 4])
def test_four_rank_layouts_match_single_process(name, single_small):
    _check(name, [r[name] if name in r else f"{name} did not run" for r in _runs(4)], single_small)


@pytest.mark.distributed
@pytest.mark.parametrize("name", [n for n, f in LAYOUTS.items() if _world(f) == 8])
def test_eight_rank_layout_matches_single_process(name, single_small):
    _check(name, [r[name] if name in r else f"{name} did not run" for r in _runs(8)], single_small)


# --- start-up checks ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, seq_len, grad_accum, message", [
    (dict(tp=3), 64, 1, r"parallel.tp=3 does not divide model.attention.num_heads=4"),
    (dict(tp=4), 64, 1, r"parallel.tp=4 does not divide model.attention.o_groups=2"),
    (dict(tp=2, sequence_parallel=True), 65, 1, r"data.seq_len=65, / cp=1\) does not split into tp=2"),
    (dict(ep=3), 64, 1, r"parallel.ep=3 does not divide model.moe.num_experts=8"),
    (dict(cp=2), 60, 1, r"parallel.cp=2 with data.seq_len=60: .*chunk length 30 .* window halo of 31 rows"),
    (dict(cp=3), 64, 1, r"parallel.cp=3 with data.seq_len=64: .*not divisible by cp=3"),
    (dict(pp=8), 64, 8, r"parallel.pp=8 x parallel.pp_virtual=1: .*num_layers=12 into 8 pipeline stages.*"
                        r"at most 7 stages; use fewer stages, or give the cuts with parallel.pp_cuts"),
    (dict(pp=2, pp_cuts=[12]), 64, 2, r"parallel.pp_cuts=\[12\] must increase strictly inside \(0, "
                                      r"model.num_layers=12\)"),
    (dict(pp=2), 64, 1, r"1F1B needs at least as many micro-batches as stages: trainer.grad_accum=1 < pp \* "
                        r"pp_virtual = 2"),
    (dict(pp=2, pp_virtual=2, pp_schedule="Interleaved1F1B"), 64, 5,
     r"rounds of pp=2: trainer.grad_accum=5 must be below pp or a multiple of 2"),
    (dict(pp=2, pp_virtual=2, pp_schedule="InterleavedZeroBubble"), 64, 5,
     r"InterleavedZeroBubble runs micro-batches in rounds of pp=2: trainer.grad_accum=5 must be below pp or a "
     r"multiple of 2"),
])
def test_impossible_layouts_name_what_to_change(fields, seq_len, grad_accum, message):
    with pytest.raises(ValueError, match=message):
        validate_layout(ParallelConfig(**fields), _config(), seq_len=seq_len, grad_accum=grad_accum)


def test_possible_layouts_pass_and_give_the_cuts():
    cfg = _config()
    assert validate_layout(ParallelConfig(tp=2, sequence_parallel=True, ep=2, cp=2), cfg, seq_len=64,
                           grad_accum=1) == []
    assert validate_layout(ParallelConfig(pp=2), cfg, seq_len=64, grad_accum=2) == [6]
    assert validate_layout(ParallelConfig(pp=2, pp_virtual=2, pp_schedule="Interleaved1F1B"), cfg, seq_len=64,
                           grad_accum=4) == [2, 6, 10]
    assert validate_layout(ParallelConfig(pp=2, pp_cuts=[7]), cfg, seq_len=64, grad_accum=2) == [7]
