"""trainer/stages/base.py and trainer/callbacks.py, the seams a new stage plugs into.

- stage.name picks the Stage; an unimplemented one fails naming the implemented ones; pretraining's hooks (FP4 QAT,
  bounded replay refused) are the Stage's model-config transform.
- docs/data_flow.md's example stage runs as printed: registered, built by name, and its loader masks the prompt
  while keeping the wrapped loader's resume state.
- trainer.callbacks: import paths load Callback instances; a bad path or a non-Callback fails naming it.
- The callbacks run at their points of the loop, in order, through a real run (tests/trainer/harness.py's micro
  model): the hooks see every step, the optimiser step only on applied steps, and the periodic checkpoint.
- sft, rl and distill refuse to start from random weights (no checkpoint.init_from) unless
  stage.allow_random_init=true.
"""

from __future__ import annotations

import dataclasses

import json
import re
from pathlib import Path

import pytest
import torch

from tests.trainer.harness import run_cli
from trainer.callbacks import Callback, load_callbacks
from trainer.cli import preflight
from trainer.config import StageConfig
from trainer.stages.base import STAGES, Pretrain, build_stage

ROOT = Path(__file__).resolve().parents[2]


def test_stage_name_picks_the_stage_and_pretrain_applies_its_hooks():
    from model.config import ModelConfig

    stage = build_stage(StageConfig())
    assert isinstance(stage, Pretrain) and stage.name == "pretrain"
    base = ModelConfig()
    assert stage.model_config(base) == base
    q = build_stage(StageConfig(fp4_kv_qat=True)).model_config(base).quant
    assert (q.main_kv, q.index, q.swa_kv) == ("fp4", "fp4", "fp8")  # as the cache stores them (fp4, fp4, fp8)
    off = dataclasses.replace(base, csa2=dataclasses.replace(base.csa2, hierarchical_pool=False))
    assert build_stage(StageConfig(hierarchical_indexer=True)).model_config(off).csa2.hierarchical_pool
    with pytest.raises(ValueError, match="replay_sim_kinds"):
        StageConfig(replay_sim_kinds=["sometimes"])
    from trainer.stages.config import DSparkStageConfig
    from trainer.stages.dspark import DSparkStage

    assert isinstance(build_stage(DSparkStageConfig()), DSparkStage)
    from trainer.stages.config import DistillStageConfig, ModelRef, RLStageConfig, SFTStageConfig
    from trainer.stages.distill import Distill
    from trainer.stages.rl import RL
    from trainer.stages.sft import SFT

    assert isinstance(build_stage(SFTStageConfig()), SFT) and isinstance(build_stage(RLStageConfig()), RL)
    assert isinstance(build_stage(DistillStageConfig(teacher=ModelRef(ckpt="x"))), Distill)
    post = SFTStageConfig()
    assert post.fp4_kv_qat and post.bounded_replay_sim and post.hierarchical_indexer  # on in post-training


class _Loader:
    """A loader with a resume state, as PackedLoader has."""

    skipped_shards = 0

    def __iter__(self):
        for _ in range(2):
            ids = torch.arange(33).view(1, 33)
            yield {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}

    def state_dict(self):
        return {"position": 7}


def test_the_documented_example_stage_runs(monkeypatch):
    doc = (ROOT / "docs" / "data_flow.md").read_text()
    code = re.search(r"## A 20-line example stage.*?```python\n(.*?)```", doc, re.S).group(1)
    assert len(code.strip().splitlines()) <= 30
    monkeypatch.setattr("trainer.stages.base.STAGES", dict(STAGES))
    namespace: dict = {}
    exec(compile(code, "docs/data_flow.md", "exec"), namespace)
    import trainer.stages.base

    cls = trainer.stages.base.STAGES["answers_only"]
    stage_cfg = StageConfig()
    object.__setattr__(stage_cfg, "name", "answers_only")  # the example's own name (a real stage adds it to the set)
    stage = build_stage(stage_cfg)
    assert isinstance(stage, cls)
    monkeypatch.setattr(Pretrain, "batches", lambda self, cfg, r, n, progress=False: (_Loader(), "tok"))
    loader, tok = stage.batches(None, 0, 1)
    batches = list(loader)
    assert tok == "tok" and len(batches) == 2
    assert (batches[0]["labels"][:, :16] == -100).all() and (batches[0]["labels"][:, 16:] >= 0).all()
    assert loader.state_dict() == {"position": 7} and loader.skipped_shards == 0


class Probe(Callback):
    """Writes the hooks a run calls to <run dir>/probe.jsonl (loaded by import path in tests/trainer/test_train.py's
    skipped-steps run, which checks the order) and puts `probe` in every step's metrics."""

    def _note(self, job, *event):
        with open(job.run_dir / "probe.jsonl", "a") as f:
            f.write(json.dumps(list(event)) + "\n")

    def on_train_start(self, job):
        self._note(job, "start", job.state.step)

    def on_step_start(self, job, step):
        self._note(job, "step_start", step)

    def on_before_optimizer_step(self, job, step, stats):
        self._note(job, "before_opt", step)

    def on_after_optimizer_step(self, job, step, stats):
        assert "expert_imbalance" in stats.extra  # the built-in RouterBalance ran first
        self._note(job, "after_opt", step)

    def on_step_end(self, job, step, stats):
        assert job.state.step == step
        stats.extra["probe"] = float(step)
        self._note(job, "step_end", step)

    def on_checkpoint(self, job, step, path):
        self._note(job, "checkpoint", step)

    def on_train_end(self, job):
        self._note(job, "end", job.state.step)


def expected_probe(steps: int, skipped: set[int], checkpoints: set[int]) -> list[list]:
    """The hook sequence a run of `steps` steps with those skipped and saved must call."""
    out = [["start", 0]]
    for step in range(1, steps + 1):
        out.append(["step_start", step])
        if step not in skipped:
            out.append(["before_opt", step])
        out += [["after_opt", step], ["step_end", step]]  # before the built-in metrics and checkpoint
        if step in checkpoints:
            out.append(["checkpoint", step])
    return out + [["end", steps]]


def test_trainer_callbacks_load_by_import_path():
    (probe,) = load_callbacks([f"{__name__}:Probe"])
    assert isinstance(probe, Probe)
    assert isinstance(load_callbacks([f"{__name__}.Probe"])[0], Probe)
    with pytest.raises(ValueError, match="cannot import 'nowhere.at_all:Nothing'"):
        load_callbacks(["nowhere.at_all:Nothing"])
    with pytest.raises(ValueError, match="is not a trainer.callbacks.Callback"):
        load_callbacks([f"{__name__}:_Loader"])


def test_bounded_replay_sim_batches_carry_cuts_the_forward_reads():
    """stage.bounded_replay_sim: the stage's loader adds `replay_cuts` to each batch (drawn from its tokens), the
    trainer hands them to the model (trainer/train.py `_model_extras`), and pp / cp are refused by name."""
    from model.replay import ReplayCuts
    from trainer.config import Config, ParallelConfig
    from trainer.stages.base import with_replay_cuts
    from trainer.train import _model_extras

    cfg = Config()
    ids = torch.randint(0, 100, (4, 256), generator=torch.Generator().manual_seed(0))
    loader = [{"input_ids": ids, "labels": ids}]
    stage = StageConfig(bounded_replay_sim=True, replay_sim_prob=1.0)
    (batch,) = list(with_replay_cuts((loader, "tok"), stage, cfg)[0])
    cuts = batch["replay_cuts"]
    (again,) = list(with_replay_cuts((loader, "tok"), stage, cfg)[0])
    assert isinstance(cuts, ReplayCuts) and torch.equal(again["replay_cuts"].decoder, cuts.decoder)
    window = cfg.model.attention.window
    assert bool(((cuts.decoder >= window) & (cuts.decoder < 256)).all()) and cuts.encoder is not None
    assert _model_extras(batch, torch.device("cpu"))["replay_cuts"].decoder.tolist() == cuts.decoder.tolist()
    assert with_replay_cuts(loader, StageConfig(), cfg) is loader
    for field, message in (("pp", "parallel.pp=2"), ("cp", "parallel.cp=2")):
        bad = dataclasses.replace(cfg, parallel=ParallelConfig(**{field: 2}))
        with pytest.raises(ValueError, match=re.escape(message)):
            with_replay_cuts(loader, stage, bad)


@pytest.mark.parametrize("stage", ["sft", "rl", "distill"])
def test_post_training_refuses_random_weights_unless_asked(stage, tmp_path):
    """sft, rl and distill without checkpoint.init_from would post-train a random model: one line and exit 2 at
    start-up (before any data or model), in the trainer and in the launchers' preflight; stage.allow_random_init=true
    asks for it."""
    teacher = ["stage.teacher.ckpt=/nonexistent"] if stage == "distill" else []
    line = (f"error: stage={stage} post-trains the weights it starts from: set checkpoint.init_from=<a checkpoint, run "
            "directory or Hugging Face directory> (or stage.allow_random_init=true to start from random weights)")
    r = run_cli([f"stage={stage}", *teacher, f"hydra.run.dir={tmp_path / 'run'}", "trainer.num_threads=1"])
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [line], r.stderr[-2000:]
    with pytest.raises(ValueError, match=f"stage={stage} post-trains the weights it starts from"):
        preflight.check(1, [f"stage={stage}", *teacher])
    preflight.check(1, [f"stage={stage}", *teacher, "stage.allow_random_init=true"])
    preflight.check(1, [f"stage={stage}", *teacher, "checkpoint.init_from=/some/run"])
    preflight.check(1, ["stage=pretrain"])
