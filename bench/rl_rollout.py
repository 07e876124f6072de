"""An RL step's rollouts on one GPU, issue 40: the RL stage of a model (random weights: the speed, not the learning)
run for a few steps with the engine's reference decode and again with its fast path, and per run the rollout
tokens/s and generation's share of the step (the stage's own `rl/rollout_tokens_per_s`, `rl/generate_share`).

    python3 bench/rl_rollout.py [--model v41_small] [--prompts 64] [--group 8] [--new-tokens 256] [--steps 2]
                                [--grad-accum 8] [--modes reference,graph,graph+triton] [--root DIR] [--json OUT.jsonl]

Modes: `reference` (op by op, no CUDA graph), `graph` (stage.rollout_cuda_graph=on), `triton`
(stage.rollout_kernels=triton), `graph+triton` (both), `compiled+graph+triton` (the three, with the step through
torch.compile: stage.rollout_compile=inductor). Each run: stage=rl with stage.allow_random_init=true,
dynamic sampling off (a random model's groups all score 0: with it on, every step would draw its refills and train
on nothing), one held-out prompt, no checkpoints, no W&B; the first step includes the CUDA graph's capture and the
kernels' compilation, so the figures are the last step's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = {"reference": ("off", "reference", "off"), "graph": ("on", "reference", "off"),
         "triton": ("off", "triton", "off"), "graph+triton": ("on", "triton", "off"),
         "compiled+graph+triton": ("on", "triton", "inductor")}


def overrides(args, graph: str, kernels: str, compile_: str, run_dir: Path) -> list[str]:
    return [f"model={args.model}", "stage=rl", "stage.allow_random_init=true", "stage.dynamic_sampling=false",
            f"trainer.max_steps={args.steps}", f"stage.prompts_per_step={args.prompts}",
            f"stage.group_size={args.group}", f"stage.max_new_tokens={args.new_tokens}",
            f"stage.max_batch={args.max_batch}", f"data.seq_len={args.new_tokens + 64}", "stage.num_eval=1",
            f"trainer.grad_accum={args.grad_accum}",
            "stage.eval_every=0", "logger.wandb.mode=disabled", "checkpoint.interval=0",
            "checkpoint.save_final=false", f"stage.rollout_cuda_graph={graph}", f"stage.rollout_kernels={kernels}",
            f"stage.rollout_compile={compile_}",
            f"hydra.run.dir={run_dir}"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="v41_small")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--grad-accum", type=int, default=8,
                   help="micro-batches per step: the step's rollouts are split into this many (at 64 x 8 x 256 one "
                        "micro-batch of 512 rows x 320 tokens ran an H100 out of memory)")
    p.add_argument("--modes", default="reference,graph,graph+triton")
    p.add_argument("--root", default="runs/bench_rl_rollout")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a run may take")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    modes = args.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad or args.steps < 1:
        sys.exit(f"error: --modes takes {', '.join(MODES)} (got {', '.join(bad)}); --steps at least 1")
    print(f"RL rollouts: {args.model}, {args.prompts} prompts x {args.group} samples, {args.new_tokens} new tokens, "
          f"engine batch {args.max_batch}, {args.steps} steps a run (figures: the last step's)")
    rows = []
    for mode in modes:
        graph, kernels, compile_ = MODES[mode]
        run_dir = Path(args.root) / mode.replace("+", "_")
        cmd = [sys.executable, "-m", "trainer.cli.main", *overrides(args, graph, kernels, compile_, run_dir)]
        t0 = time.perf_counter()
        try:
            r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            log = REPO / run_dir / "main.log"
            lines = [x for x in (log.read_text().splitlines() if log.is_file() else []) if " - step " in x]
            print(f"{mode:>13}: did not finish within {args.timeout:.0f} s; its last progress line: "
                  f"{lines[-1].split(' - ', 1)[-1] if lines else '(none)'}")
            continue
        wall = time.perf_counter() - t0
        if r.returncode != 0:
            tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["(no output)"]
            print(f"{mode:>13}: exit {r.returncode}: {tail[0]}")
            continue
        steps = [json.loads(x) for x in (REPO / run_dir / "metrics.jsonl").read_text().splitlines()
                 if x.strip() and "rl/rollout_tokens_per_s" in x]
        last = steps[-1]
        row = {"mode": mode, "model": args.model, "prompts": args.prompts, "group": args.group,
               "new_tokens": args.new_tokens, "rollout_tokens_per_s": last["rl/rollout_tokens_per_s"],
               "generate_share": last["rl/generate_share"], "train_tokens_per_s": last["tokens_per_s"],
               "response_len": last["rl/response_len"], "run_wall_s": wall}
        rows.append(row)
        print(f"{mode:>13}: rollout {row['rollout_tokens_per_s']:,.0f} tokens/s, generation {row['generate_share']:.1%}"
              f" of the step, mean response {row['response_len']:.0f} tokens (run {wall:.0f} s)")
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    base = next((r for r in rows if r["mode"] == "reference"), None)
    for r in rows:
        if base is not None and r is not base:
            print(f"{r['mode']} / reference rollout tokens/s: {r['rollout_tokens_per_s'] / base['rollout_tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()
