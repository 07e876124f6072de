"""optim=muon (conf/optim/muon.yaml: Muon, head-wise Muon, Sinkhorn momentum and AdamW by rules) through the
trainer: the micro model learns, the groups' table is logged, and a run killed with SIGKILL resumes from its last
checkpoint to the uninterrupted run's losses bit for bit (the momentum buffers are checkpointed with the rest)."""

from __future__ import annotations

import signal

import pytest

from tests.trainer.harness import kill_9_when, losses, micro_overrides, read_metrics, run_cli, side_by_side

MAX_STEPS, INTERVAL = 12, 3
# (optim.lr 3e-2: Muon's updates have RMS 0.2 from the first step, where AdamW's early ones are near 1, so over 12
# steps the default 3e-3 moves the micro model's loss by 0.03 (AdamW's by 0.2); at 3e-2 by 0.7)
ARGS = ["optim=muon", "optim.lr=3e-2", "optim.warmup_steps=3", f"trainer.max_steps={MAX_STEPS}",
        f"checkpoint.interval={INTERVAL}", "checkpoint.keep_last=2"]


@pytest.mark.slow
def test_muon_trains_and_resumes_after_kill_9_bit_for_bit(tmp_path, small_data):
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "killed"
    killed_args = micro_overrides(run_dir, small_data, *ARGS)

    def killed() -> int:
        return kill_9_when(killed_args, lambda: (run_dir / "metrics.jsonl").exists()
                           and len(read_metrics(run_dir)) >= 2 * INTERVAL + 1)

    ref, code = side_by_side(lambda: run_cli(micro_overrides(ref_dir, small_data, *ARGS)), killed)
    assert ref.returncode == 0, ref.stderr
    log = ref.stdout + ref.stderr
    assert "optimiser groups (optim.rules)" in log and "Q/K projections" in log and "Engram tables" in log
    reference = losses(ref_dir)
    assert sorted(reference) == list(range(1, MAX_STEPS + 1))
    assert sum(reference[s] for s in (10, 11, 12)) / 3 < reference[1] - 0.5  # it learns
    assert code == -signal.SIGKILL, "the run finished before it could be killed"
    r = run_cli(killed_args)
    assert r.returncode == 0, r.stderr
    assert "resumed from" in r.stdout + r.stderr
    assert losses(run_dir) == reference
