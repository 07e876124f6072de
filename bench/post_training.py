"""Post-training figures on CPU (BENCHMARKS.md, issue 15), from a `make pipeline` run (runs/pipeline/):

1. SFT: held-out assistant-token loss at the start and the end; the padding share of length-bucketed batches vs
   random batches vs fixed-length rows over the generated SFT samples (data/sft.py measure_padding);
2. RL: held-out greedy success (number of prompts) at the start and the end, mean response length at effort 20
   vs 80 before and after RL;
3. distillation: held-out KL(student || teacher) at the start and the end;
4. the train/rollout log-prob mismatch (mean K3 KL, max ratio) of RL steps from the SFT checkpoint with the
   engine's router and indexer choices replayed and without (`stage.replay_routing`), measured in one run.

    python bench/post_training.py [--root runs/pipeline] [--mismatch-steps 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def records(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def first_last(run: Path, key: str):
    vals = [(r["step"], r[key]) for r in records(run) if key in r]
    return vals[0], vals[-1]


def mismatch(root: Path, steps: int, threads: int) -> dict:
    out = {}
    for replay in (True, False):
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "trainer.cli.main", "stage=rl", f"checkpoint.init_from={root / 'sft'}",
                   f"trainer.max_steps={steps}", "checkpoint.interval=0", "checkpoint.save_final=false",
                   "stage.eval_every=0", "stage.num_eval=1", f"stage.replay_routing={str(replay).lower()}",
                   "stage.dynamic_sampling=false", "optim.lr=3e-4", "optim.warmup_steps=0",
                   "logger.wandb.mode=disabled", "logger.progress_bar=false", f"trainer.num_threads={threads}",
                   f"hydra.run.dir={tmp}"]
            subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
            rs = [r for r in records(Path(tmp)) if "loss" in r]
            out[replay] = {"mismatch_kl": sum(r["rl/mismatch_kl"] for r in rs) / len(rs),
                           "max_ratio": max(r["rl/max_ratio"] for r in rs),
                           "tokens": sum(r["rl/train_tokens"] for r in rs)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="runs/pipeline")
    ap.add_argument("--mismatch-steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    root = Path(args.root)
    (s0, l0), (s1, l1) = first_last(root / "sft", "eval/loss")
    print(f"SFT held-out assistant loss: step {s0} {l0:.4f} -> step {s1} {l1:.4f}")
    from data.chat import ChatTemplate
    from data.sft import measure_padding
    from data.tokenizer import load_tokenizer
    from trainer.checkpoint.loading import find_checkpoint, run_tokenizer
    from trainer.stages.sft import env_samples

    template = ChatTemplate(load_tokenizer(run_tokenizer(find_checkpoint(str(root / "sft")))))
    samples = env_samples(["arithmetic", "strings"], 4000, 0, [], [1, 100])
    print("SFT padding share (4000 generated samples, B=8, seq_len=128):", measure_padding(samples, template, 128, 8))
    for key in ("eval/success", "eval/success_e20", "eval/success_e80", "eval/len_e20", "eval/len_e80"):
        (a, x), (b, y) = first_last(root / "rl", key)
        print(f"RL {key}: step {a} {x:.4f} -> step {b} {y:.4f}")
    print("RL held-out prompts per effort:", first_last(root / "rl", "eval/prompts")[0][1])
    (a, x), (b, y) = first_last(root / "distill", "eval/kl")
    print(f"distill held-out KL(student || teacher): step {a} {x:.5f} -> step {b} {y:.5f}")
    m = mismatch(root, args.mismatch_steps, args.threads)
    for replay, v in m.items():
        print(f"mismatch, replay_routing={replay}: mean K3 KL {v['mismatch_kl']:.3e}, max ratio {v['max_ratio']:.6f}, "
              f"{int(v['tokens'])} tokens")


if __name__ == "__main__":
    main()
