"""checkpoint.async_save=true: periodic saves write in a background thread (torch.distributed.checkpoint's
async_save) while the run trains on. The checkpoints hold what a blocking save writes, bit for bit, the losses do not
change, and kill -9 while a save is being written leaves the previous checkpoint the one a resume starts from."""

from __future__ import annotations

import signal

import torch
import torch.distributed.checkpoint as dcp

from tests.trainer.harness import kill_9_when, losses, micro_overrides, run_cli, side_by_side
from trainer.checkpoint import complete_checkpoints

STEPS = ["trainer.max_steps=6", "checkpoint.interval=2"]
ASYNC = "checkpoint.async_save=true"


def _weights(ckpt) -> dict:
    md = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    out = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.items()
           if k.startswith("train.model.") and hasattr(v, "size")}
    dcp.load(out, checkpoint_id=str(ckpt))
    return out


def test_async_saves_equal_blocking_ones_and_survive_kill_9(tmp_path, small_data):
    blocking, background, killed = tmp_path / "blocking", tmp_path / "async", tmp_path / "killed"
    results = side_by_side(lambda: run_cli(micro_overrides(blocking, small_data, *STEPS)),
                           lambda: run_cli(micro_overrides(background, small_data, *STEPS, ASYNC)))
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    assert losses(background) == losses(blocking)
    saved = [p.name for p in complete_checkpoints(background / "checkpoints")]
    assert saved == [p.name for p in complete_checkpoints(blocking / "checkpoints")] == \
        ["step_00000002", "step_00000004", "step_00000006"]
    for name in saved:
        a, b = _weights(background / "checkpoints" / name), _weights(blocking / "checkpoints" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name

    args = micro_overrides(killed, small_data, *STEPS, ASYNC)
    writing = killed / "checkpoints" / ".tmp_step_00000004"
    code = kill_9_when(args, lambda: writing.is_dir() and any(writing.iterdir()))
    assert code == -signal.SIGKILL, "the run finished before it could be killed"
    assert [p.name for p in complete_checkpoints(killed / "checkpoints")] == ["step_00000002"]
    r = run_cli(args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout + r.stderr and "step_00000002" in r.stdout + r.stderr
    assert losses(killed) == losses(background)


def test_a_full_disk_during_an_async_write_is_one_line(tmp_path, small_data):
    """The background write of step 4 fails (ENOSPC): the run stops when it completes the save (the next step), exit
    status 4 with the blocking save's one line, its partial files removed; step 2 stays the newest checkpoint."""
    from tests.trainer.harness import run_faulty

    r = run_faulty("enospc_in_save=4", micro_overrides(tmp_path, small_data, *STEPS, ASYNC))
    ckpts = tmp_path / "checkpoints"
    assert r.returncode == 4, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == (
        f"error: saving checkpoint step 4 failed: no space left on device ({ckpts / '.tmp_step_00000004'}); the "
        f"previous checkpoint {ckpts / 'step_00000002'} stays the one a resume starts from")
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000002"]
