"""Issue 42's criterion for the pipeline's RL stage, over seeds: for each SFT checkpoint and each trainer.seed, one run
of the RL stage exactly as `make pipeline` configures it (trainer/cli/stage_chain.py's overrides), then per run the
training reward's mean over the first 5 steps -> the last 5 (and over each 5 steps), the held-out greedy success
(mean of efforts 20 and 80) at the start -> the end, and the held-out mean response length at effort 20 and 80
(start -> end); per SFT checkpoint, in how many runs each rose (the issue asks for at least 4 of 5).

    python bench/rl_seeds.py --sft runs42/sft0 --sft runs42/sft1 --seeds 0 1 2 3 4 --root runs42/rl [-- overrides]

Runs one training process at a time, each with trainer.num_threads=1 (pass other overrides after `--`); a run whose
final checkpoint exists is not run again, so `--report` (no training) or a relaunch reprints the table. The table
also goes to <root>/rl_seeds.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainer.cli.stage_chain import STAGES, TREND_STEPS, _records, _steps, final_checkpoint  # noqa: E402

EFFORTS = (20, 80)
WALL = "rl_seeds_wall.json"  # in a run's directory: the seconds its launch took (reprinted by --report)


def rl_overrides() -> tuple[list[str], int]:
    """The pipeline's RL overrides (at scale 1) and its step count."""
    return _steps(dict(STAGES)["rl"], 1.0)


def figures(run: Path) -> dict:
    """One run's criterion figures from its metrics.jsonl."""
    records = _records(run)
    rewards = [r["rl/reward"] for r in records if "rl/reward" in r]
    evals = [r for r in records if "eval/success" in r]
    k = min(TREND_STEPS, len(rewards) // 2)
    if k == 0 or len(evals) < 2:
        raise ValueError(f"{run}: no finished RL run there (metrics.jsonl has {len(rewards)} steps, "
                         f"{len(evals)} evaluations)")
    first, last = evals[0], evals[-1]
    windows = [rewards[i:i + TREND_STEPS] for i in range(0, len(rewards), TREND_STEPS)]
    out = {"reward_first": sum(rewards[:k]) / k, "reward_last": sum(rewards[-k:]) / k,
           "reward_windows": [sum(w) / len(w) for w in windows],
           "success_start": first["eval/success"], "success_end": last["eval/success"], "steps": len(rewards)}
    for e in EFFORTS:
        out[f"success_e{e}"] = (first[f"eval/success_e{e}"], last[f"eval/success_e{e}"])
        out[f"len_e{e}"] = (first[f"eval/len_e{e}"], last[f"eval/len_e{e}"])
    return out


def run_one(sft: Path, seed: int, run: Path, overrides: list[str], steps: int, extra: list[str]) -> float | None:
    """Train one run unless its final checkpoint exists; its wall seconds (None when skipped)."""
    if final_checkpoint(run, steps) is not None:
        return None
    cmd = [sys.executable, "-m", "trainer.cli.main", *overrides, f"checkpoint.init_from={sft}",
           f"trainer.seed={seed}", "trainer.num_threads=1", f"hydra.run.dir={run}", "logger.progress_bar=false",
           *extra]
    print("==", " ".join(cmd[1:]), flush=True)
    start = time.perf_counter()
    code = subprocess.call(cmd, cwd=REPO)
    if code != 0:
        raise SystemExit(f"error: the run in {run} failed with exit status {code}")
    return time.perf_counter() - start


def table(rows: list[dict]) -> str:
    lines = ["| SFT | seed | reward first 5 -> last 5 | reward by 5 steps | held-out success (mean of e20, e80) "
             "start -> end | e20 | e80 | length e20 | length e80 | wall |", "|" + " --- |" * 10]
    for r in rows:
        f = r["figures"]
        up = "up" if f["reward_last"] > f["reward_first"] else "not up"
        held = "up" if f["success_end"] > f["success_start"] else "not up"
        lines.append(
            f"| {r['sft']} | {r['seed']} | {f['reward_first']:.3f} -> {f['reward_last']:.3f} ({up}) | "
            + ", ".join(f"{w:.3f}" for w in f["reward_windows"]) + " | "
            f"{f['success_start']:.3f} -> {f['success_end']:.3f} ({held}) | "
            + " | ".join(f"{a:.3f} -> {b:.3f}" for a, b in (f["success_e20"], f["success_e80"])) + " | "
            + " | ".join(f"{a:.1f} -> {b:.1f}" for a, b in (f["len_e20"], f["len_e80"])) + " | "
            + (f"{r['wall_s'] / 60:.1f} min" if r.get("wall_s") else "-") + " |")
    for sft in dict.fromkeys(r["sft"] for r in rows):
        mine = [r["figures"] for r in rows if r["sft"] == sft]
        rose = sum(f["reward_last"] > f["reward_first"] for f in mine)
        held = sum(f["success_end"] > f["success_start"] for f in mine)
        lines.append(f"\n{sft}: training reward rose in {rose} of {len(mine)} runs, held-out success (mean of both "
                     f"efforts) ended above its start in {held} of {len(mine)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sft", action="append", required=True, help="an SFT run directory (repeat for several)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--root", default="runs/rl_seeds", help="a run directory per (SFT, seed) under here")
    ap.add_argument("--report", action="store_true", help="only print the table of the runs already made")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after --)")
    args = ap.parse_args(argv)
    root = Path(args.root).resolve()
    overrides, steps = rl_overrides()
    rows = []
    for sft in map(Path, args.sft):
        if not args.report and not sft.is_dir():
            print(f"error: --sft {sft} is not a directory", file=sys.stderr)
            return 2
        for seed in args.seeds:
            run = root / f"{sft.name}_seed{seed}"
            wall = None if args.report else run_one(sft.resolve(), seed, run, overrides, steps, args.overrides)
            if args.report and final_checkpoint(run, steps) is None:
                continue
            wall_file = run / WALL
            if wall is not None:
                wall_file.write_text(json.dumps({"wall_s": wall}))
            elif wall_file.is_file():
                wall = json.loads(wall_file.read_text())["wall_s"]
            rows.append({"sft": sft.name, "seed": seed, "run": str(run), "wall_s": wall, "figures": figures(run)})
    root.mkdir(parents=True, exist_ok=True)
    (root / "rl_seeds.json").write_text(json.dumps(rows, indent=1))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
