"""Proves checkpoints move between layouts: saved by one process, resumed under tp 2 x pp 2 (4 gloo ranks, torchrun),
and the reverse, through the real CLI (trainer.cli.main) with optim=muon (conf/optim/muon.yaml: Muon and head-wise Muon
momentum, Sinkhorn momentum for the embedding, head and Engram table, AdamW's moments for the rest, every state a
DTensor like its parameter under tp), the micro model with Engram on.

- A: one process trains steps 1-4; B: tp 2 x pp 2 resumes from A's step 2 (asynchronous saves) and logs A's
  losses and gradient norms at steps 3 and 4 (1e-5 relative); C: one process resumes from B's step 4 and logs B's
  steps 5 and 6.
- Resuming with a model whose parameters differ fails before training, exit status 2, naming the key.

In full, with the reasoning: docs/testing.md#resharding-checkpoints
"""

from __future__ import annotations

import subprocess

import pytest

from data.config import DataConfig, ensure_prepared
from tests.trainer.harness import micro_overrides, read_metrics, run_cli, run_ranks, side_by_side

# The runs stop at different steps (trainer.max_steps); the LR warms up over 100 steps, so it does not depend on that.
# checkpoint.piece_mb=0.01: every tensor above 10 KB (and every tp shard of one) stored as row pieces
STEPS = ["optim=muon", "checkpoint.interval=2", "trainer.grad_accum=2", "data.batch_size=2",
         "optim.warmup_steps=100", "checkpoint.piece_mb=0.01"]
# B saves asynchronously (checkpoint.async_save): the 4 ranks' background writes, their own process group, the
# per-step completion poll; C resumes from what they wrote
TP2_PP2 = ["parallel.tp=2", "parallel.pp=2", "checkpoint.async_save=true"]


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "stdlib-small"
    ensure_prepared(DataConfig(path=str(path), max_bytes=400_000, shard_size=16_384), progress=False)
    return path


def _args(run_dir, data, *extra):
    # the micro model with two output groups, so tp = 2 splits them
    args = [a for a in micro_overrides(run_dir, data, *STEPS, *extra) if not a.startswith("data.batch_size=4")]
    return [a.replace("model.attention.o_groups=1", "model.attention.o_groups=2") for a in args]


def _run(ranks: int, args: list[str]) -> subprocess.CompletedProcess:
    if ranks == 1:
        return run_cli(args)
    return run_ranks(ranks, args)  # torchrun's ranks, forked (launch/torchrun.sh: tests/trainer/cli/test_torchrun.py)


def _steps(run_dir) -> dict[int, tuple[float, float]]:
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in read_metrics(run_dir)}


def _assert_close(a: dict, b: dict, steps) -> None:
    for step in steps:
        assert a[step] == pytest.approx(b[step], rel=1e-5), step


def _refused_args(run_dir, data, ckpt) -> list[str]:
    """A resume of `ckpt` with another model.dim."""
    return [a.replace("model.dim=32", "model.dim=64")
            for a in _args(run_dir, data, "trainer.max_steps=4", f"checkpoint.resume={ckpt}")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_data):
    """A, B and C; C side by side with the refused resume of B's step-4 checkpoint (both only read it), whose
    CompletedProcess is out["refused"] (its run directory out["refused_dir"])."""
    root = tmp_path_factory.mktemp("reshard")
    out = {}
    for name, ranks, layout, steps, source in (
        ("single", 1, [], 4, None),
        ("tp2_pp2_from_single", 4, TP2_PP2, 6, ("single", 2)),
        ("single_from_tp2_pp2", 1, [], 6, ("tp2_pp2_from_single", 4)),
    ):
        extra = [*layout, f"trainer.max_steps={steps}"]
        if source is not None:
            extra.append(f"checkpoint.resume={out[source[0]] / 'checkpoints' / f'step_{source[1]:08d}'}")
        args = _args(root / name, small_data, *extra)
        if name == "single_from_tp2_pp2":
            ckpt = out["tp2_pp2_from_single"] / "checkpoints" / "step_00000004"
            refused = _refused_args(root / "refused", small_data, ckpt)
            r, out["refused"] = side_by_side(lambda: _run(ranks, args), lambda: run_cli(refused))
            out["refused_dir"] = root / "refused"
        else:
            r = _run(ranks, args)
        assert r.returncode == 0, r.stderr[-3000:]
        if source is not None:
            assert "resumed from" in r.stdout + r.stderr
        out[name] = root / name
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_tp2_pp2_checkpoint_resumes_in_one_process(runs):
    files = sorted(p.name for p in (runs["tp2_pp2_from_single"] / "checkpoints" / "step_00000004").glob("*.distcp"))
    assert files == [f"__{r}_0.distcp" for r in range(4)]  # every rank wrote its part
    resumed, source = _steps(runs["single_from_tp2_pp2"]), _steps(runs["tp2_pp2_from_single"])
    assert sorted(resumed) == [5, 6]
    _assert_close(resumed, source, [5, 6])


@pytest.mark.slow
@pytest.mark.distributed
def test_single_process_checkpoint_resumes_under_tp2_pp2(runs):
    resumed, source = _steps(runs["tp2_pp2_from_single"]), _steps(runs["single"])
    assert sorted(source) == [1, 2, 3, 4] and sorted(resumed) == [3, 4, 5, 6]
    _assert_close(resumed, source, [3, 4])


@pytest.mark.slow
def test_incompatible_model_config_fails_before_training(runs):
    ckpt = runs["tp2_pp2_from_single"] / "checkpoints" / "step_00000004"  # the 4 ranks' parts
    r = runs["refused"]  # run_cli(_refused_args(runs["refused_dir"], small_data, ckpt)), launched by the fixture
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert f"checkpoint {ckpt} was saved with another model: model.dim=32 there, 64 here" in last
    assert "(model.dim=32)" in last and "checkpoint.resume=none" in last
    assert not (runs["refused_dir"] / "metrics.jsonl").exists()
