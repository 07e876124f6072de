"""trainer/cli/stage_chain.py's final table (`make pipeline`): each stage's headline figure from its first to its last
value, RL's held-out success per evaluation effort (20 and 80, each start and end) and its training reward's trend
(the mean of the first 5 steps -> the last 5), the wall time the chain's launches of the stage took (summed over
relaunches), and its checkpoint; before the first stage it says the CPU threads the stages pick
(trainer/threads.py)."""

import json

from trainer.cli import stage_chain


def _metrics(run, records):
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_the_table_shows_both_efforts_and_the_wall_time(tmp_path):
    rl, sft = tmp_path / "rl", tmp_path / "sft"
    _metrics(rl, [{"step": 0, "eval/success_e20": 0.25, "eval/success_e80": 0.125, "eval/success": 0.1875},
                  {"step": 1, "loss": 0.1},
                  {"step": 20, "eval/success_e20": 0.5, "eval/success_e80": 0.375, "eval/success": 0.4375}])
    _metrics(sft, [{"step": 0, "eval/loss": 2.0}, {"step": 5, "eval/loss": 1.5}])
    assert stage_chain.headline("rl", rl) == ("held-out success",
                                              "effort 20: 0.2500 -> 0.5000; effort 80: 0.1250 -> 0.3750")
    assert stage_chain.headline("sft", sft) == ("held-out assistant loss", "2.0000 -> 1.5000")
    assert stage_chain.headline("distill", tmp_path / "none") == ("held-out KL to teacher", "-")

    stage_chain._add_wall(rl, 100.4)
    stage_chain._add_wall(rl, 30.0)  # a relaunch adds its time
    assert stage_chain.wall_time(rl) == "2m 10s" and stage_chain.wall_time(sft) == "-"
    stage_chain._add_wall(sft, 42.2)
    assert stage_chain.wall_time(sft) == "42s"

    rows = [("sft", *stage_chain.headline("sft", sft), stage_chain.wall_time(sft), "ckpt/sft"),
            ("rl", *stage_chain.headline("rl", rl), stage_chain.wall_time(rl), "ckpt/rl")]
    lines = stage_chain.table(rows).splitlines()
    assert lines[0].split() == ["stage", "figure", "start", "->", "end", "wall", "time", "checkpoint"]
    assert "effort 20: 0.2500 -> 0.5000; effort 80: 0.1250 -> 0.3750" in lines[2] and "2m 10s" in lines[2]
    assert lines[1].startswith("sft ") and lines[1].endswith("ckpt/sft") and "42s" in lines[1]


def test_the_chain_says_the_cpu_threads_before_the_first_stage(tmp_path, monkeypatch, capsys):
    """Each stage's launch picks its threads with trainer/threads.py; the chain says the choice once, first."""
    launched = []
    monkeypatch.setattr(stage_chain.subprocess, "call", lambda cmd: launched.append(cmd) or 1)  # pretrain fails
    code = stage_chain.main(["--root", str(tmp_path), "--", "trainer.device=cpu", "trainer.num_threads=1"])
    out = capsys.readouterr().out.splitlines()
    assert code == 1 and len(launched) == 1
    assert out[0] == "== every stage on the CPU, threads 1 (set); `-- trainer.num_threads=<n>` sets them"
    assert out[1].startswith("== pretrain: -m trainer.cli.main")


def test_rl_gets_a_row_for_the_training_reward_trend(tmp_path):
    rl, short = tmp_path / "rl", tmp_path / "short"
    rewards = [0.1, 0.2, 0.3, 0.2, 0.2, 0.5, 0.5, 0.4, 0.3, 0.3, 0.3, 0.4]
    _metrics(rl, [{"step": 0, "eval/success_e20": 0.25}]
             + [{"step": i + 1, "rl/reward": r} for i, r in enumerate(rewards)])
    assert stage_chain.trend("rl", rl) == ("training reward, mean of the first 5 -> last 5 steps", "0.2000 -> 0.3400")
    _metrics(short, [{"step": i + 1, "rl/reward": r} for i, r in enumerate([0.1, 0.3, 0.5])])
    assert stage_chain.trend("rl", short) == ("training reward, mean of the first 1 -> last 1 steps",
                                              "0.1000 -> 0.5000")
    assert stage_chain.trend("rl", tmp_path / "none")[1] == "-"
    assert stage_chain.trend("sft", rl) is None
