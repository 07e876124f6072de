"""The whole pipeline in one command: pretrain -> SFT -> RL -> on-policy distillation -> the DSpark drafter of the
distilled model (`make pipeline`).

`python -m trainer.cli.stage_chain [--root runs/pipeline] [--scale 1.0] [-- <overrides for every stage>]` runs each
stage as its own `python -m trainer.cli.main` launch under --root, each from the previous stage's checkpoint, and
ends with a table of each stage's headline figure (start -> end; RL's held-out success per effort and its training
reward's trend), its wall time and its checkpoint. A stage whose run directory holds its final checkpoint is not run
again, so an interrupted pipeline picks up where it stopped.

Design and reasoning: docs/stages.md#the-stage-chain-make-pipeline
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from trainer.checkpoint import is_complete, step_dir_name
from trainer.cli.options import OneLineParser
from trainer.compose import compose
from trainer.threads import cpu_threads

STAGES = (
    ("pretrain", ["trainer.max_steps=400"]),
    ("sft", ["stage=sft", "trainer.max_steps=400", "stage.envs=[arithmetic]", "stage.difficulty=[1]",
             "stage.num_samples=8000", "data.batch_size=32", "optim.lr=3e-3", "optim.warmup_steps=20",
             "checkpoint.interval=100", "stage.eval_every=50"]),
    # rollouts are prompt (~10 tokens) + at most max_new_tokens (24): micro-batches padded to 64, not to 128.
    # lr 3e-5 held constant (session 21 chose 1e-4 on reduced-scale checkpoints, where 3e-5 cosine-decayed moved
    # nothing; from this pipeline's full-scale SFT, 1e-4 lowered held-out success in 3 of 3 runs and 3e-5 did better
    # on every seed run at both: session 24) and router biases frozen (their balancing update follows loads that are
    # mostly padding and moves the policy without regard to the reward): BENCHMARKS.md, issue 42. A training set
    # of 80 prompts visited in 4 epochs of 5 steps: each epoch's training reward is over the same prompts (fresh
    # draws made the reward's trend the draws' difficulty): session 22. Held-out success over 256 prompts per effort
    # (64 left it to one or two prompts' flips of a weak model's greedy answers): session 23. Rollouts sampled (and
    # scored) at temperature 0.7: the held-out check is greedy, and at 1.0 the samples (success ~0.40 against greedy
    # ~0.70) spent the update on the tail; 0.7 raised held-out success more on both check seeds: session 25
    ("rl", ["stage=rl", "trainer.max_steps=20", "stage.prompts_per_step=16", "stage.train_prompts=80", "optim.lr=3e-5",
            "optim.schedule=constant", "optim.warmup_steps=0", "model.moe.bias_update_rate=0", "data.seq_len=64",
            "stage.num_eval=256", "checkpoint.interval=10", "stage.temperature=0.7"]),
    ("distill", ["stage=distill", "trainer.max_steps=30", "optim.lr=1e-3", "optim.warmup_steps=0", "data.seq_len=64",
                 "checkpoint.interval=10", "stage.envs=[arithmetic]", "stage.difficulty=[1]", "stage.num_eval=64"]),
    ("dspark", ["stage=dspark", "trainer.max_steps=200", "optim.lr=3e-3", "optim.warmup_steps=20",
                "checkpoint.interval=100"]),
)
HEADLINE = {"pretrain": ("loss", "train loss"), "sft": ("eval/loss", "held-out assistant loss"),
            "rl": ("eval/success", "held-out success"), "distill": ("eval/kl", "held-out KL to teacher"),
            "dspark": ("acceptance_len", "held-out acceptance length tau")}
# a second row for a stage with a per-step training figure: its mean over the first and the last TREND_STEPS steps
TREND = {"rl": ("rl/reward", "training reward")}
TREND_STEPS = 5
WALL = "stage_chain.json"  # in a stage's run directory: the seconds its launches took, summed over relaunches


def _records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _start_end(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{values[0]:.4f} -> {values[-1]:.4f}" if len(values) > 1 else f"{values[-1]:.4f}"


def headline(stage: str, run: Path) -> tuple[str, str]:
    """(what the figure is, its first and last value). A figure measured per effort (RL's `eval/success_e20`,
    `eval/success_e80`) shows each effort's start and end."""
    key, what = HEADLINE[stage]
    records = _records(run)
    per_effort = sorted({int(k.rsplit("_e", 1)[1]) for r in records for k in r
                         if k.startswith(f"{key}_e") and k.rsplit("_e", 1)[1].isdigit()})
    if per_effort:
        figures = [f"effort {e}: {_start_end([r[f'{key}_e{e}'] for r in records if r.get(f'{key}_e{e}') is not None])}"
                   for e in per_effort]
        return what, "; ".join(figures)
    return what, _start_end([r[key] for r in records if r.get(key) is not None])


def trend(stage: str, run: Path) -> tuple[str, str] | None:
    """(what, the mean of the first TREND_STEPS steps' values -> the last TREND_STEPS') for a stage with a per-step
    training figure (RL's reward); the windows shrink to half the steps when there are fewer than twice as many.
    None for the other stages."""
    if stage not in TREND:
        return None
    key, what = TREND[stage]
    values = [r[key] for r in _records(run) if r.get(key) is not None]
    k = min(TREND_STEPS, len(values) // 2)
    if k == 0:
        return f"{what}, mean of the first and last steps", "-"
    return (f"{what}, mean of the first {k} -> last {k} steps",
            f"{sum(values[:k]) / k:.4f} -> {sum(values[-k:]) / k:.4f}")


def wall_time(run: Path) -> str:
    """The wall time of a stage's launches (`WALL`), as `12m 34s`; "-" when the chain did not run it."""
    path = run / WALL
    if not path.is_file():
        return "-"
    seconds = round(json.loads(path.read_text())["wall_s"])
    return f"{seconds // 60}m {seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def _add_wall(run: Path, seconds: float) -> None:
    path = run / WALL
    before = json.loads(path.read_text())["wall_s"] if path.is_file() else 0.0
    run.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"wall_s": before + seconds}))


def table(rows: list[tuple[str, ...]]) -> str:
    """The final table: a header, then per stage its headline figure, start -> end, wall time and checkpoint."""
    header = ("stage", "figure", "start -> end", "wall time", "checkpoint")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows])


def final_checkpoint(run: Path, steps: int) -> Path | None:
    ckpt = run / "checkpoints" / step_dir_name(steps)
    return ckpt if ckpt.is_dir() and is_complete(ckpt) else None


def _steps(overrides: list[str], scale: float) -> tuple[list[str], int]:
    out, steps = [], 0
    for o in overrides:
        if o.startswith("trainer.max_steps="):
            steps = max(1, round(int(o.split("=", 1)[1]) * scale))
            o = f"trainer.max_steps={steps}"
        out.append(o)
    return out, steps


def _chain(name: str, runs: dict[str, Path]) -> list[str]:
    """The overrides that place stage `name` in its run directory and start it from the stage before it."""
    extra = [f"hydra.run.dir={runs[name]}", "logger.progress_bar=false"]
    if name == "sft":
        extra.append(f"checkpoint.init_from={runs['pretrain']}")
    elif name == "rl":
        extra.append(f"checkpoint.init_from={runs['sft']}")
    elif name == "distill":
        extra += [f"checkpoint.init_from={runs['pretrain']}", f"stage.teacher.ckpt={runs['rl']}"]
    elif name == "dspark":
        extra.append(f"checkpoint.init_from={runs['distill']}")
    return extra


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m trainer.cli.stage_chain", description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default="runs/pipeline", help="a run directory per stage under here")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every stage's trainer.max_steps")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for every stage (after --)")
    args = ap.parse_args(argv)
    root = Path(args.root).resolve()
    runs = {name: root / name for name, _ in STAGES}
    launches = [(name, *_steps(overrides, args.scale), _chain(name, runs)) for name, overrides in STAGES]
    try:  # every stage's config before the first one trains: a bad override is one line, not a failed stage later
        configs = [compose([*overrides, *extra, *args.overrides]) for _, overrides, _, extra in launches]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    trainer_cfg = configs[0].trainer
    if trainer_cfg.device == "cpu" or (trainer_cfg.device == "auto" and not torch.cuda.is_available()):
        # each stage's launch picks the same way (trainer/threads.py); said once here, before the first one starts
        print(f"== every stage on the CPU, {cpu_threads(trainer_cfg.num_threads).describe()}; "
              "`-- trainer.num_threads=<n>` sets them", flush=True)
    rows = []
    for name, overrides, steps, extra in launches:
        run = runs[name]
        if final_checkpoint(run, steps) is None:
            cmd = [sys.executable, "-m", "trainer.cli.main", *overrides, *extra, *args.overrides]
            print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
            start = time.perf_counter()
            code = subprocess.call(cmd)
            _add_wall(run, time.perf_counter() - start)
            if code != 0:
                print(f"error: stage {name} failed with exit status {code} (its run directory: {run}); fix it and "
                      "run the pipeline again: finished stages are kept", file=sys.stderr)
                return code
        else:
            print(f"== {name}: already finished in {run}", flush=True)
        what, figure = headline(name, run)
        rows.append((name, what, figure, wall_time(run), str(final_checkpoint(run, steps) or "-")))
        if (extra_row := trend(name, run)) is not None:
            rows.append((name, *extra_row, "", ""))
    print("\n" + table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
