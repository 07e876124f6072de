"""Held-out success of an RL checkpoint sampled at the training temperature instead of greedy (issue 42): the RL
stage's own held-out evaluation (trainer/stages/rl.py `RL.evaluate`) with its completions sampled at --temperature,
on one checkpoint, printed as one JSON line, then exit (no training step).

    python bench/rl_sampled_eval.py CKPT [--num-eval 1024] [--temperature 1.0] [-- overrides]

CKPT: a run directory or checkpoint (checkpoint.init_from). The stage runs with the pipeline's RL overrides
(trainer/cli/stage_chain.py) and trainer.seed 0, so every checkpoint is evaluated on the same prompts with the same
sample seeds (paired comparisons).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trainer.stages.rl as rl  # noqa: E402
from trainer.cli.stage_chain import STAGES  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ckpt")
    p.add_argument("--num-eval", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=1.0)
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    generate, evaluate = rl.RL.generate_held_out, rl.RL.evaluate

    def sampled(self, prompts, seed, **kw):
        return generate(self, prompts, seed, **{**kw, "temperature": args.temperature})

    def report(self):
        out = evaluate(self)
        print(json.dumps({"ckpt": args.ckpt, "temperature": args.temperature, **(out or {})}), flush=True)
        os._exit(0)  # the evaluation is all this asks for

    rl.RL.generate_held_out, rl.RL.evaluate = sampled, report
    run_dir = tempfile.mkdtemp(prefix="rl_sampled_eval_")
    sys.argv = ["main", *dict(STAGES)["rl"], f"stage.num_eval={args.num_eval}", f"checkpoint.init_from={args.ckpt}",
                f"hydra.run.dir={run_dir}", "logger.progress_bar=false", "logger.wandb.mode=disabled",
                *extra]
    from trainer.cli.main import main as train_main
    train_main()


if __name__ == "__main__":
    main()
