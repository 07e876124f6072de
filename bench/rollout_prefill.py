"""An RL rollout's prefill in the engine (issue 40): the samples of a prompt prefilled in one call with their routing
records split by row (trainer/engine/engine.py `_prefill_groups`), against one call a row (what the engine did
before whenever records were kept: every RL rollout, stage.replay_routing being on by default).

    python3 bench/rollout_prefill.py [--model v41_tiny] [--prompts 4] [--group 8] [--prompt-len 96]
                                     [--new-tokens 4] [--repeats 3] [--device auto|cpu|cuda] [--json OUT.jsonl]

Random weights; requests as the RL stage makes them (--prompts prompts of --prompt-len tokens, --group samples each,
temperature 1, return_routing=True), one engine batch. Per repeat, both ways alternated; reported: the medians of
the engine's prefill seconds (its `prefill_s`), the speed-up, and whether the two gave the same tokens, log-probs
and routing records (on the CPU in fp32 they must: the same requests and seeds; log-probs within 1e-5). On a GPU
the grouped prefill also runs on the training kernels (model/serving.py `on_kernels`), which records kept forbade
before.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.generation import build, random_ids  # noqa: E402
from trainer.engine import Engine, Request, SamplingParams  # noqa: E402


LP_ATOL = 1e-5  # fp32 log-probs of a batched call against one row's


def one_row_at_a_time(chunk) -> list[tuple[int, int]]:
    return [(b, b + 1) for b in range(len(chunk))]


def run(eng: Engine, reqs, grouped: bool):
    if not grouped:
        eng._prefill_groups = one_row_at_a_time  # the engine before: a row a call whenever records were kept
    else:
        eng.__dict__.pop("_prefill_groups", None)
    eng.stats["prefill_s"] = 0.0
    out = eng.generate(reqs)
    if eng.device.type == "cuda":
        torch.cuda.synchronize()
    return eng.stats["prefill_s"], out


def compare(a, b) -> dict:
    """Rows whose tokens agree, the largest log-prob difference over them, rows whose records agree."""
    tok = [x.token_ids == y.token_ids for x, y in zip(a, b)]
    lp = max((abs(p - q) for x, y, t in zip(a, b, tok) if t for p, q in zip(x.model_logprobs, y.model_logprobs)),
             default=0.0)
    rec = sum(all(getattr(x.routing, key).keys() == getattr(y.routing, key).keys()
                  and all(torch.equal(v, getattr(y.routing, key)[k]) for k, v in getattr(x.routing, key).items())
                  for key in ("topk", "experts")) for x, y, t in zip(a, b, tok) if t)
    return dict(rows=len(a), tokens_equal=sum(tok), max_logprob_diff=lp, records_equal=rec)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="v41_tiny")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=96)
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--json", default=None)
    args = p.parse_args()
    dev = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                       "cpu" if args.device == "auto" else args.device)
    m = build(args.model, dev)
    B = args.prompts * args.group
    eng = Engine(m, max_batch=B, max_len=args.prompt_len + args.new_tokens + 8, replay="none")
    reqs = []
    for i in range(args.prompts):
        ids = random_ids(m.cfg, 1, args.prompt_len + i, 11 + i, "cpu")[0].tolist()  # lengths differ by prompt
        reqs += [Request(ids, SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, seed=100 * i + g),
                         request_id=(i, g), return_routing=True) for g in range(args.group)]
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda")
    times = {True: [], False: []}
    outs = {}
    with autocast:
        run(eng, reqs, True)  # warm-up (kernels compiled)
        for r in range(args.repeats):
            for grouped in (True, False) if r % 2 == 0 else (False, True):
                t, outs[grouped] = run(eng, reqs, grouped)
                times[grouped].append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    cmp = compare(outs[True], outs[False])
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"rollout prefill, {args.model} on {name}: {args.prompts} prompts x {args.group} samples, "
          f"{args.prompt_len}+ tokens, records kept")
    print(f"  one call a row (before): {med[False] * 1e3:9.1f} ms   grouped by prompt: {med[True] * 1e3:9.1f} ms   "
          f"{med[False] / med[True]:.2f}x")
    print(f"  the two rollouts: tokens equal in {cmp['tokens_equal']}/{cmp['rows']} rows, routing records in "
          f"{cmp['records_equal']} of those, log-probs within {cmp['max_logprob_diff']:.1e} (a batch of rows rounds "
          f"its GEMMs apart from one row)")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(dict(bench="rollout_prefill", model=args.model, device=name, prompts=args.prompts,
                                    group=args.group, prompt_len=args.prompt_len, row_at_a_time_s=med[False],
                                    grouped_s=med[True], **cmp)) + "\n")
    exact = cmp["tokens_equal"] == cmp["records_equal"] == cmp["rows"] and cmp["max_logprob_diff"] <= LP_ATOL
    if dev.type == "cpu" and not exact:  # fp32: the two must agree (a GPU's bf16 may flip a near-tied sample)
        sys.exit(f"error: grouped and row-at-a-time prefills gave different rollouts on the CPU: {cmp}")


if __name__ == "__main__":
    main()
