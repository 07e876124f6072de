"""Proves parallel.engram_shard in the trainer: Engram tables row-sharded over Meshes.dp_ep_cp train exactly like
the single process, hold only their block, and checkpoint across layouts.

Contract: through the trainer's code path and test_layouts' comparison (`_train_small`, `_check`), dp_replicate 2,
ep 2, dp_shard 2, pp 2, tp 2 and dp_replicate 2 with activation checkpointing on 2 ranks, and pp 2 x dp_replicate 2
and dp_shard 2 x ep 2 (with engram_host_memory) on 4, each with engram_shard, equal the single process; every table
is a DTensor Shard(0) whose blocks add up to it; without a pipeline each micro-batch's row exchange is prefetched
before its forward; DCP checkpoints move between sharded layouts and one process (bit for bit on the same layout,
within 1e-5 resharded, AdamW's moments included); engram_host_memory without engram_shard is refused, naming both
keys.

Design and reasoning: docs/testing.md#sharded-engram-in-the-trainer
"""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch

from optim import LRScheduler, OptimConfig, build_optimizer
from tests.distributed import run_distributed
from tests.helpers import EVERY_ROLE_SEQ_LEN
from tests.parallel import test_layouts as layouts
from trainer.checkpoint import Checkpointer, TrainState, step_dir_name
from trainer.config import CheckpointConfig, ParallelConfig, TrainerConfig
from trainer.parallel.gradients import update_router_biases
from trainer.train import build_model, compute_gradients, setup_runtime, trainable_parameters

LAYOUTS = {
    "dp_replicate2": dict(dp_replicate=2, engram_shard=True),
    "ep2": dict(ep=2, engram_shard=True),
    "dp_shard2": dict(dp_shard=2, engram_shard=True),
    "pp2": dict(pp=2, pp_cuts=[2], engram_shard=True),
    "tp2": dict(tp=2, engram_shard=True),
    "dp_replicate2_recompute": dict(dp_replicate=2, engram_shard=True, activation_checkpoint="full"),
    "dp_shard2_ep2_host": dict(dp_shard=2, ep=2, engram_shard=True, engram_host_memory=True),
    "pp2_dp_replicate2": dict(pp=2, dp_replicate=2, pp_cuts=[2], engram_shard=True),
    # rows split over ep only, a replica of the blocks on each dp replica (row gradients all-reduced over dp)
    "dp_replicate2_ep2_over_ep": dict(dp_replicate=2, ep=2, engram_shard=True, engram_shard_over=["ep"]),
}
CKPT_LAYOUT = LAYOUTS["dp_replicate2"]
EP_CKPT_LAYOUT = dict(ep=2)  # expert-parallel experts (DTensor shards over ep) and whole Engram tables
# AdamW at a constant rate: the checkpoint runs compare one layout with itself, or losses only (test_layouts says why
# it compares gradients under SGD instead).
OPTIM = OptimConfig(lr=1e-3, warmup_steps=0, schedule="constant")


# --- one layout, observed ---------------------------------------------------------------------------------------------

class _Observed:
    """What the trainer's Engram wiring did on this rank during test_layouts' `_train`: the ParallelModel it built,
    the prefetches and the exchanges issued."""

    def __init__(self):
        from trainer.parallel.engram import EngramSharding, ShardedRows

        self.pm, self.prefetches, self.issues = None, 0, 0
        self._patches = [(layouts, "build_model"), (EngramSharding, "prefetch"), (ShardedRows, "issue")]
        self._saved = [getattr(owner, name) for owner, name in self._patches]
        build, prefetch, issue = self._saved

        def build_spy(*args, **kwargs):
            self.pm = build(*args, **kwargs)
            return self.pm

        def prefetch_spy(sharding, *args, **kwargs):
            self.prefetches += 1
            return prefetch(sharding, *args, **kwargs)

        def issue_spy(reader, *args, **kwargs):
            self.issues += 1
            return issue(reader, *args, **kwargs)

        for (owner, name), spy in zip(self._patches, (build_spy, prefetch_spy, issue_spy)):
            setattr(owner, name, spy)

    def close(self) -> None:
        for (owner, name), saved in zip(self._patches, self._saved):
            setattr(owner, name, saved)

    def blocks(self) -> list[dict]:
        """Every sharded table this rank holds: its layout and its local block."""
        from torch.distributed.tensor import DTensor, Shard

        out = []
        for name, p in self.pm.module.named_parameters():
            if not name.endswith("engram.table"):
                continue
            assert isinstance(p, DTensor) and list(p.placements) == [Shard(0)], name
            mesh, block = p.device_mesh, p.to_local()
            out.append(dict(name=name, rows=p.shape[0], width=p.shape[1], group=mesh.size(),
                            group_rank=mesh.get_local_rank(), local=tuple(block.shape), device=block.device.type,
                            pp_rank=self.pm.meshes.pp.get_local_rank()))
        return out


def _layout(fields: dict) -> dict:
    observed = _Observed()
    try:
        result = layouts._train_small(fields)
    finally:
        observed.close()
    readers = len(observed.pm.engram.readers)
    return dict(train=result, blocks=observed.blocks(), prefetches=observed.prefetches, issues=observed.issues,
                readers=readers, pipeline=observed.pm.pipeline is not None)


# --- checkpoints ------------------------------------------------------------------------------------------------------

def _adamw_run(fields: dict, last_step: int, *, save: str | None = None, load: str | None = None) -> dict:
    """The trainer's AdamW path up to `last_step`: resumed from the step-1 checkpoint under `load`, saving one after
    step 1 under `save`. Returns the losses by step and the optimiser's fused switch."""
    parallel = ParallelConfig(**fields)
    rt = setup_runtime(TrainerConfig(device="cpu", precision="fp32", num_threads=1), parallel)
    data_rank, data_size = (0, 1) if rt.meshes is None else (rt.meshes.data.get_local_rank(), rt.meshes.data.size())
    accum = layouts.MICROBATCHES // data_size
    cfg = layouts._small_config()
    pm = build_model(cfg, rt, parallel, layouts.SEED, batch_size=layouts.ROWS, seq_len=EVERY_ROLE_SEQ_LEN,
                     grad_accum=accum)
    params = trainable_parameters(pm.module, cfg)
    optimizer = build_optimizer(params, OPTIM)
    scheduler = LRScheduler(optimizer, OPTIM, total_steps=10)
    state = TrainState(pm.module, optimizer, scheduler)
    states = {"train": state}
    if load is not None:
        Checkpointer(Path(load), CheckpointConfig(), rt.rank).load(Path(load) / step_dir_name(1), states)
    losses = {}
    pm.module.train()
    while state.step < last_step:
        step = state.step + 1
        mine = layouts._global_batch(step - 1, EVERY_ROLE_SEQ_LEN)[data_rank * accum:(data_rank + 1) * accum]
        losses[step] = compute_gradients(pm, mine, params, layouts.MAX_NORM, step=step).loss
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        update_router_biases(pm)
        state.step = step
        if save is not None and step == 1:
            Checkpointer(Path(save), CheckpointConfig(), rt.rank).save(1, states)
    return {"losses": losses, "fused": [g["fused"] for g in optimizer.param_groups]}


def _checkpoints(single_dir: str, sharded_dir: str, ep_dir: str) -> dict:
    return {
        "from_single": _adamw_run(CKPT_LAYOUT, 3, load=single_dir),
        "saved": _adamw_run(CKPT_LAYOUT, 3, save=sharded_dir),
        "round_trip": _adamw_run(CKPT_LAYOUT, 3, load=sharded_dir),
        "ep_from_single": _adamw_run(EP_CKPT_LAYOUT, 3, load=single_dir),
        "ep_saved": _adamw_run(EP_CKPT_LAYOUT, 3, save=ep_dir),
    }


# --- the spawns -------------------------------------------------------------------------------------------------------

def _worker(rank: int, world: int, names: list[str], ckpt_dirs: tuple[str, ...] | None) -> dict:
    """Every layout of this world size, then the checkpoint runs; a failure is reported and stops the rest (the peers
    may be stuck in a collective of the failed one)."""
    results = {}
    for name in names:
        try:
            results[name] = _layout(LAYOUTS[name])
        except Exception:
            results[name] = traceback.format_exc()
            return results
    if ckpt_dirs is not None:
        try:
            results["checkpoint"] = _checkpoints(*ckpt_dirs)
        except Exception:
            results["checkpoint"] = traceback.format_exc()
    return results


def _one_thread(fn, *args, **kwargs):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs
    try:
        return fn(*args, **kwargs)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def single():
    return layouts.single_small_run()  # `_train_small({})` on one thread, once per session


@pytest.fixture(scope="module")
def ckpt_dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("engram_ckpt")
    dirs = {"single": str(root / "single"), "sharded": str(root / "sharded"), "ep": str(root / "ep")}
    dirs["single_losses"] = _one_thread(_adamw_run, {}, 3, save=dirs["single"])["losses"]
    return dirs


@pytest.fixture(scope="module")
def two_ranks(ckpt_dirs) -> list[dict]:
    names = [n for n, f in LAYOUTS.items() if layouts._world(f) == 2]
    return run_distributed(_worker, 2, names, (ckpt_dirs["single"], ckpt_dirs["sharded"], ckpt_dirs["ep"]))


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    names = [n for n, f in LAYOUTS.items() if layouts._world(f) == 4]
    return run_distributed(_worker, 4, names, None)


def _ranks(results: list[dict], name: str) -> list[dict]:
    out = [r.get(name, f"{name} did not run") for r in results]
    for r in out:
        assert not isinstance(r, str), f"{name} failed on a rank:\n{r}"
    return out


def _check_layout(name: str, ranks: list[dict], single: dict) -> None:
    layouts._check(name, [r["train"] for r in ranks], single)
    micro = layouts.STEPS * layouts.MICROBATCHES  # micro-batches over all data ranks
    for r in ranks:
        if r["pipeline"]:  # the schedule runs the forwards: every lookup issues its own exchange
            assert r["prefetches"] == 0 and r["issues"] > 0, name
        else:  # one prefetch per micro-batch this rank ran, one exchange per table each, none from a lookup
            assert r["prefetches"] == micro // _data_ranks(name), name
            # ... except the recomputed forward's under activation checkpointing: it finds nothing prefetched
            recomputed = 2 if LAYOUTS[name].get("activation_checkpoint") == "full" else 1
            assert r["issues"] == recomputed * r["prefetches"] * r["readers"], name
    _check_blocks(name, ranks)


def _data_ranks(name: str) -> int:
    fields = LAYOUTS[name]
    return fields.get("dp_replicate", 1) * fields.get("dp_shard", 1) * fields.get("ep", 1)


def _check_blocks(name: str, ranks: list[dict]) -> None:
    """Each rank holds ceil(rows / group) rows of each table of its stage (the last ranks the remainder); a stage's
    blocks add up to the table."""
    per_table: dict[tuple, dict[int, int]] = {}
    for r in ranks:
        for b in r["blocks"]:
            per_rows = -(-b["rows"] // b["group"])
            first = min(b["group_rank"] * per_rows, b["rows"])
            assert b["local"] == (min(per_rows, b["rows"] - first), b["width"]), (name, b)
            assert b["device"] == "cpu"
            per_table.setdefault((b["name"], b["pp_rank"]), {})[b["group_rank"]] = b["local"][0]
    tables = {n for n, _ in per_table}
    assert tables == {"layers.0.engram.table", "layers.4.engram.table"}, name
    for (table, _), blocks in per_table.items():
        whole = next(b["rows"] for r in ranks for b in r["blocks"] if b["name"] == table)
        assert sum(blocks.values()) == whole, (name, table, blocks)


@pytest.mark.distributed
@pytest.mark.parametrize("name", [n for n, f in LAYOUTS.items() if layouts._world(f) == 2])
def test_two_rank_layouts_with_sharded_engram_match_single_process(name, single, two_ranks):
    _check_layout(name, _ranks(two_ranks, name), single)


@pytest.mark.distributed
def test_pipeline_layouts_put_the_tables_on_different_stages(two_ranks, four_ranks):
    for results, name, group in ((two_ranks, "pp2", 1), (four_ranks, "pp2_dp_replicate2", 2)):
        ranks = _ranks(results, name)
        stages = {b["name"]: r["train"]["pp_rank"] for r in ranks for b in r["blocks"]}
        assert stages == {"layers.0.engram.table": 0, "layers.4.engram.table": 1}, name
        assert {b["group"] for r in ranks for b in r["blocks"]} == {group}, name


@pytest.mark.distributed
def test_blocks_are_split_over_the_group(two_ranks, four_ranks):
    """A group of 2 (dp_replicate 2) and of 4 (dp_shard 2 x ep 2): every rank holds a strict part of each table, the
    first rank of the group ceil(rows / group) rows."""
    for results, name, group in ((two_ranks, "dp_replicate2", 2), (four_ranks, "dp_shard2_ep2_host", 4)):
        for r in _ranks(results, name):
            for b in r["blocks"]:
                per_rank = -(-b["rows"] // group)
                assert b["group"] == group and b["local"][0] <= per_rank < b["rows"], (name, b)
                assert b["group_rank"] > 0 or b["local"][0] == per_rank, (name, b)


@pytest.mark.distributed
@pytest.mark.parametrize("name", [n for n, f in LAYOUTS.items() if layouts._world(f) == 4])
def test_four_rank_layouts_with_sharded_engram_match_single_process(name, single, four_ranks):
    _check_layout(name, _ranks(four_ranks, name), single)


@pytest.mark.distributed
def test_checkpoints_move_between_sharded_and_single(ckpt_dirs, two_ranks):
    ranks = _ranks(two_ranks, "checkpoint")
    single = ckpt_dirs["single_losses"]
    for r in ranks:
        # the single process's step-1 checkpoint resumed by the sharded layout
        assert sorted(r["from_single"]["losses"]) == [2, 3]
        for step in (2, 3):
            assert r["from_single"]["losses"][step] == pytest.approx(single[step], rel=1e-5), step
        # the sharded layout's own checkpoint, resumed by a fresh sharded model: the same run, bit for bit
        saved = r["saved"]["losses"]
        assert r["round_trip"]["losses"] == {2: saved[2], 3: saved[3]}
        # the fused step (optim.impl=auto) although DTensor blocks sit beside plain weights: the builder's AdamW
        # splits its multi-tensor step by kind (optim/builder.py)
        assert set(r["saved"]["fused"]) == {True}
    files = sorted(p.name for p in (Path(ckpt_dirs["sharded"]) / step_dir_name(1)).glob("*.distcp"))
    assert files == ["__0_0.distcp", "__1_0.distcp"]  # each rank wrote its blocks
    # ... and by one process (the tables gathered from both ranks' blocks)
    resumed = _one_thread(_adamw_run, {}, 3, load=ckpt_dirs["sharded"])
    assert set(resumed["fused"]) == {True}  # one process: the fused step too
    for step in (2, 3):
        assert resumed["losses"][step] == pytest.approx(saved[step], rel=1e-5), step
        assert saved[step] == pytest.approx(single[step], rel=1e-5), step


def test_host_memory_needs_engram_shard():
    with pytest.raises(ValueError, match=r"parallel.engram_host_memory=true .* needs parallel.engram_shard=true"):
        ParallelConfig(dp_replicate=2, engram_host_memory=True)
    ParallelConfig(engram_shard=True, engram_host_memory=True)


@pytest.mark.distributed
def test_expert_parallel_checkpoints_move_to_and_from_one_process(ckpt_dirs, two_ranks):
    """ep 2 resumes the single process's step-1 checkpoint (its experts split over the ranks) and one process
    resumes ep 2's (the expert shards gathered): the next steps' losses equal the other side's within 1e-5, AdamW
    state and biases included (step 3 depends on the step-2 update)."""
    single = ckpt_dirs["single_losses"]
    ranks = _ranks(two_ranks, "checkpoint")
    for r in ranks:
        for step in (2, 3):
            assert r["ep_from_single"]["losses"][step] == pytest.approx(single[step], rel=1e-5), step
    saved = ranks[0]["ep_saved"]["losses"]
    resumed = _one_thread(_adamw_run, {}, 3, load=ckpt_dirs["ep"])
    assert sorted(resumed["losses"]) == [2, 3]
    for step in (2, 3):
        assert resumed["losses"][step] == pytest.approx(saved[step], rel=1e-5), step
