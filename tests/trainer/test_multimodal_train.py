"""`data=multimodal` end to end (issue 20's contract on the micro model): the trainer feeds each batch's images to
the model, every metrics record carries loss, loss_text and loss_multimodal, and `loss` is the token-weighted mean
of the two kinds; a resumed run continues exactly (losses of both kinds bit for bit, images included); bad
combinations are refused before any process group, naming the key; the loss reaches the tower (its weights move);
the image-text rows' loss falls over a short run (8.2 -> 6.0 in 40 steps)."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from tests.trainer.harness import MICRO_MODEL, QUIET, read_metrics
from trainer.callbacks import Callback


class StopAtStep2(Callback):
    """SIGTERM to this process at the end of step 2: the preemption path stops the run there with a checkpoint."""

    def on_step_end(self, job, step, stats):
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)

RUN_ARGS = ["trainer.num_threads=1", "logger.log_every=1", "optim.warmup_steps=1"]


@pytest.fixture(scope="module")
def mm_data(tmp_path_factory):
    """A small text corpus of 1,024 ids (so the placeholder 4095 is free) and the image-text shards' directory."""
    from data.config import DataConfig, ensure_prepared

    root = tmp_path_factory.mktemp("mm_data")
    ensure_prepared(DataConfig(path=str(root / "text"), max_bytes=300_000, shard_size=16_384, vocab_size=1024),
                    progress=False)
    return root


def _overrides(run_dir, root, *extra: str) -> list[str]:
    return ["model=v41_tiny_mm", "data=multimodal", f"data.path={root / 'text'}", "data.max_bytes=300000",
            "data.shard_size=16384", "data.vocab_size=1024", f"data.multimodal.image_path={root / 'images'}",
            "data.multimodal.num_samples=24", "data.multimodal.size_range=[60,160]",
            "data.multimodal.min_pixels=7056", "data.multimodal.text_to_multimodal=1", "data.seq_len=64",
            "data.batch_size=4", *MICRO_MODEL, *QUIET, *RUN_ARGS, f"hydra.run.dir={run_dir}",
            "checkpoint.async_save=false", *extra]


def _build(run_dir, root, *extra: str):
    """The Job trainer.cli.main builds past Hydra, in this process."""
    from trainer.train import build

    return build(_config(root, *extra), run_dir)


def _train(run_dir, root, *extra: str, outcome: str = "finished"):
    """build + fit in this process; the Job, which ended with `outcome`."""
    from trainer.train import fit

    job = _build(run_dir, root, *extra)
    assert fit(job) == outcome
    return job


def _config(root, *extra: str):
    from trainer.config import to_config
    from trainer.compose import compose

    return to_config(compose([a for a in _overrides("unused", root, *extra) if not a.startswith("hydra.")]))


def test_trains_logs_both_kinds_and_resumes_exactly(tmp_path, mm_data):
    whole = _train(tmp_path / "whole", mm_data, "trainer.max_steps=4", "checkpoint.interval=0")
    rows = read_metrics(tmp_path / "whole")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:  # loss lies between the kinds' means: their token-weighted mean (half the rows are image-text)
        assert {"loss", "loss_text", "loss_multimodal"} <= r.keys()
        lo, hi = sorted((r["loss_text"], r["loss_multimodal"]))
        assert lo - 1e-6 <= r["loss"] <= hi + 1e-6 and lo < hi
    # the images reached the tower: every tower tensor moved
    tower = whole.pm.module.vision
    fresh = _build(tmp_path / "fresh", mm_data, "trainer.max_steps=4").pm.module.vision  # the initial tower
    moved = [n for (n, p), q in zip(tower.named_parameters(), fresh.parameters()) if not torch.equal(p, q)]
    assert len(moved) == len(list(tower.parameters()))
    # preempted after step 2 (SIGTERM: a checkpoint), launched again: steps 3 and 4 are the uninterrupted run's,
    # bit for bit (the model, the optimiser, and the data position: text rows, image samples, the row schedule)
    _train(tmp_path / "resumed", mm_data, "trainer.max_steps=4", "checkpoint.interval=0",
           "trainer.callbacks=[tests.trainer.test_multimodal_train:StopAtStep2]", outcome="stopped")
    from trainer.train import fit

    job = _build(tmp_path / "resumed", mm_data, "trainer.max_steps=4", "checkpoint.interval=0")
    assert job.state.step == 2  # resumed from the preemption's checkpoint, not started afresh
    assert fit(job) == "finished"
    resumed = read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(rows, resumed):
        assert (a["loss"], a["loss_text"], a["loss_multimodal"]) == (b["loss"], b["loss_text"], b["loss_multimodal"])


@pytest.mark.parametrize("extra, message", [
    (["model=v41_tiny"], r"model=v41_tiny has no vision tower \(model.vision.num_layers=0\)"),
    (["model.image_token_id=4094"], r"data.multimodal.image_token_id=4095 differs from model.image_token_id=4094"),
    (["parallel.pp=2"], r"parallel.pp=2: pipeline parallelism does not carry images"),
    (["parallel.cp=2"], r"parallel.cp=2: an image's placeholder run may cross"),
    (["stage=sft"], r"data=multimodal feeds stage=pretrain; stage.name=sft"),
    (["stage.bounded_replay_sim=true"], r"stage.bounded_replay_sim=true: the bounded-replay simulation runs on text"),
])
def test_bad_combinations_are_refused_naming_the_key(mm_data, extra, message):
    """By the trainer's start-up checks, which trainer.cli.preflight (launch/torchrun.sh) runs too."""
    from trainer.compose import compose
    from trainer.memory_plan import check_layout

    node = compose([a for a in _overrides("unused", mm_data, *extra) if not a.startswith("hydra.")])
    with pytest.raises(ValueError, match=message):
        check_layout(node)


def test_text_only_mixture_needs_no_tower(mm_data):
    from trainer.train import check_multimodal

    cfg = _config(mm_data, "model=v41_tiny", "data.multimodal.text_to_multimodal=0")
    check_multimodal(cfg, cfg.model)  # no image reaches the model: any model, any layout


def test_caption_loss_falls(tmp_path, mm_data):
    """40 steps of the micro model on half image-text rows: the image-text rows' loss falls by over a nat (the
    contract job's 400 steps on v41_tiny_mm: BENCHMARKS.md, "Multimodal pretraining")."""
    _train(tmp_path, mm_data, "trainer.max_steps=40", "checkpoint.interval=0", "optim.lr=3e-3",
           "optim.warmup_steps=5")
    rows = read_metrics(tmp_path)
    first = sum(r["loss_multimodal"] for r in rows[:5]) / 5
    last = sum(r["loss_multimodal"] for r in rows[-5:]) / 5
    assert last < first - 1.0, (first, last)
