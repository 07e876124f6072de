"""RL's prompts (trainer/stages/rollout.py): every draw is stratified (levels dealt evenly, one effort from each equal
slice of the range), and a fixed training set (stage.train_prompts) is visited in epochs, each prompt once an epoch,
each epoch in a fresh order; the stage logs the epoch and its per-step figures over the step's own prompts."""

from __future__ import annotations

import math
import random
from collections import Counter
from types import SimpleNamespace

import pytest

from data.envs import sample_problems
from tests.trainer.harness import read_metrics, run_cli
from tests.trainer.test_stages import _args
from trainer.stages.rollout import PromptSet, draw_prompts, stratified_efforts


def _stage(**kw):
    return SimpleNamespace(**{"envs": ["arithmetic"], "difficulty": [1], "effort": [1, 100], **kw})


def test_efforts_take_one_draw_from_each_slice_of_the_range():
    for n, (low, high) in ((16, (1, 100)), (7, (20, 80)), (5, (3, 3)), (40, (1, 10))):
        efforts = stratified_efforts(random.Random(n), low, high, n)
        width = (high - low + 1) / n
        # draw i lies in [low + floor(i w), low + floor((i + 1) w)], so the i-th smallest does
        for i, e in enumerate(sorted(efforts)):
            assert low + math.floor(i * width) <= e <= min(high, low + math.floor((i + 1) * width)), (n, i, e)
    efforts = stratified_efforts(random.Random(0), 1, 100, 16)
    assert efforts != sorted(efforts)  # shuffled: a step's prompts are not ordered by effort


def test_levels_are_dealt_evenly_per_environment():
    problems = sample_problems(["arithmetic", "strings"], 23, seed=4, stratify=True)
    for env, count in (("arithmetic", 12), ("strings", 11)):
        levels = Counter(p.difficulty for p in problems if p.env == env)
        assert sum(levels.values()) == count and set(levels) == {1, 2, 3, 4, 5}
        assert max(levels.values()) - min(levels.values()) <= 1
    chosen = Counter(p.difficulty for p in sample_problems(["arithmetic"], 10, seed=1, difficulty=[2, 4],
                                                           stratify=True))
    assert chosen == {2: 5, 4: 5}
    assert sample_problems(["arithmetic"], 10, seed=1) == sample_problems(["arithmetic"], 10, seed=1)
    assert draw_prompts(_stage(), 12, 3) == draw_prompts(_stage(), 12, 3) != draw_prompts(_stage(), 12, 4)


@pytest.mark.parametrize("size, per_step", [(80, 16), (50, 16), (8, 3)])
def test_the_training_set_is_visited_once_an_epoch_in_a_fresh_order(size, per_step):
    prompts = PromptSet(_stage(), size, seed=11, per_step=per_step)
    assert len(prompts.prompts) == size
    stream = [x for step in range(3 * size) for x in prompts.step_prompts(step)]
    for epoch in range(3 * per_step):
        seen = stream[epoch * size:(epoch + 1) * size]
        assert Counter(map(id, seen)) == Counter(map(id, prompts.prompts)), epoch
    orders = {tuple(map(id, stream[e * size:(e + 1) * size])) for e in range(4)}
    assert len(orders) == 4  # reshuffled every epoch
    assert prompts.epoch(5) == 5 * per_step / size
    assert prompts.step_prompts(7) == PromptSet(_stage(), size, seed=11, per_step=per_step).step_prompts(7)
    assert all(any(x is p for p in prompts.prompts) for x in prompts.sample(9, seed=2))


def test_rl_trains_on_its_training_set_in_epochs(tmp_path, small_data):
    pre = tmp_path / "pretrain"
    assert run_cli(_args(pre, small_data, "trainer.max_steps=1", "checkpoint.interval=1")).returncode == 0
    run = tmp_path / "rl"
    r = run_cli(_args(run, small_data, "stage=rl", f"checkpoint.init_from={pre}", "stage.train_prompts=4",
                      "stage.prompts_per_step=2", "stage.group_size=4", "stage.max_new_tokens=6", "stage.num_eval=2",
                      "stage.eval_every=0", "trainer.max_steps=3", "checkpoint.interval=0"))
    assert r.returncode == 0, r.stderr[-3000:]
    steps = [x for x in read_metrics(run) if "loss" in x]
    assert [x["rl/epoch"] for x in steps] == [0.0, 0.5, 1.0]
    # the step's figures count its own 2 prompts x 4 samples, whatever dynamic sampling drew besides
    assert all(x["rl/success"] * 8 == pytest.approx(round(x["rl/success"] * 8)) for x in steps)
    bad = run_cli(_args(tmp_path / "bad", small_data, "stage=rl", f"checkpoint.init_from={pre}",
                        "stage.train_prompts=-1"))
    assert bad.returncode == 2 and "stage.train_prompts must be >= 0, got -1" in bad.stderr
