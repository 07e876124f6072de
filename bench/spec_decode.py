"""Speculative decoding against plain decoding in the built-in engine (trainer/engine/spec_decode.py): batch 1,
greedy, the same prompts through `Engine(model)` and `Engine(model, drafter=..., spec_tokens=k)`, the variants
alternated per prompt and repeat (a load that comes and goes slows all alike).

Usage:
  .venv/bin/python bench/spec_decode.py [--device cpu|cuda] [--model v41_tiny] [--random]
      [--drafter-ckpt RUN_OR_CKPT [--backbone-ckpt CKPT]] [--spec-tokens 4] [--schedules fixed,auto]
      [--oracle 0.8,1.0] [--prompts 4] [--prompt-len 64] [--new-tokens 48] [--repeats 2] [--threads N]
      [--json OUT.jsonl]

Weights: `--drafter-ckpt` a DSpark run's checkpoint (trainer/stages/dspark.py `load_drafter`: its backbone is the
checkpoint it was trained on, or `--backbone-ckpt`); otherwise (`--random`, the default) random weights of
`--model`, whose drafts are all but always rejected: what that measures is the cost of drafting and verifying. The
prompts are random token ids, or with `--text GLOB` windows of text the drafter was not trained on (files read in
sorted order, encoded with the backbone run's tokenizer; e.g. Python sources outside the stdlib corpus).
`--save-bundle OUT.pt` writes the weights (backbone and drafter state dicts, the model config) and the prompts' ids
to one file; `--bundle OUT.pt` measures from it: the same weights and prompts on another machine (a GPU).

`--oracle p` adds runs whose drafter drafts the plain run's own token with probability p per slot (another token
otherwise; the drafter's blocks and heads still run, so the drafting cost is the real one): the speed-up the engine
delivers at that acceptance, the ceiling a trained drafter approaches.

Per variant: wall time of the generate calls (prefill included, the same in every variant), decode tokens/s, tokens
per backbone forward (decode tokens / decode forwards: 1 for plain decoding), the mean accepted drafts per verify,
the share of the decode time spent drafting, and the speed-up (plain wall time / the variant's). Every speculative
run's tokens are checked equal to the plain run's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import model as model_pkg  # noqa: E402
from model.dspark import DSpark  # noqa: E402
from trainer.engine import Engine, Request, SamplingParams  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generation import build  # noqa: E402  (bench/generation.py: a model of conf/model on meta, materialised)


class OracleDrafter(DSpark):
    """Drafts the plain run's token at each position with probability `p` (a fixed pseudo-random draw per position),
    another token otherwise; the blocks and heads run as the real drafter's do."""

    def setup(self, script: list[int], p: float) -> None:
        self.script, self.p = script, p

    def draft_hidden(self, embed, ctx, ctx_visible, anchors, anchor_tokens):
        self._anchor, self._slot = int(anchors[0]), 0
        return super().draft_hidden(embed, ctx, ctx_visible, anchors, anchor_tokens)

    def heads(self, head, h, prev_tokens):
        logits, confidence = super().heads(head, h, prev_tokens)
        pos = self._anchor + self._slot + 1
        self._slot += 1
        if pos < len(self.script):
            right = (pos * 2654435761 % 2**32) / 2**32 < self.p
            tok = self.script[pos] if right else (self.script[pos] + 1) % logits.shape[-1]
            logits[0, tok] += 1e4
        return logits, confidence


def random_drafter(cfg, device, seed: int, cls=DSpark):
    torch.manual_seed(seed)
    with torch.device("meta"):
        d = cls(cfg)
    d.to_empty(device=device)
    d.init_weights()
    return d.eval()


def text_prompts(drafter_ckpt: str, pattern: str, n: int, length: int) -> list[list[int]]:
    """n windows of `length` token ids: the first of each file matching `pattern` (sorted) long enough, encoded with
    the tokenizer the backbone's run trained with."""
    import glob

    from data.tokenizer import load_tokenizer
    from trainer.checkpoint import Checkpointer
    from trainer.checkpoint.loading import find_checkpoint, run_tokenizer

    backbone = Checkpointer.marker(find_checkpoint(drafter_ckpt))["backbone"]
    tok = load_tokenizer(run_tokenizer(find_checkpoint(backbone)))
    out = []
    for path in sorted(glob.glob(pattern, recursive=True)):
        ids = tok.encode(Path(path).read_text(errors="replace")).ids
        if len(ids) >= 2 * length:  # skip a file's header: the window starts a length in
            out.append(ids[length:2 * length])
        if len(out) == n:
            return out
    raise SystemExit(f"--text {pattern}: only {len(out)} files of at least {2 * length} tokens")


def load_bundle(path: str, device):
    """(backbone, drafter, prompts, description) from a --save-bundle file."""
    from omegaconf import OmegaConf

    from model.config import ModelConfig

    b = torch.load(path, map_location="cpu", weights_only=False)
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), b["model"]))
    with torch.device("meta"):
        backbone, drafter = model_pkg.build(cfg), DSpark(cfg)
    for m, sd in ((backbone, b["backbone"]), (drafter, b["drafter"])):
        m.to_empty(device=device)
        with torch.no_grad():
            m.init_weights()  # the buffers no state dict holds
        m.load_state_dict(sd)
        m.eval()
    if b["canonical_map"] is not None:
        backbone.set_canonical_vocab(b["canonical_map"])
    return backbone, drafter, b["prompts"], f"{b['weights']} (bundle {path})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--model", default="v41_tiny", help="conf/model config of the random weights")
    ap.add_argument("--random", action="store_true", help="random weights (the default without --drafter-ckpt)")
    ap.add_argument("--drafter-ckpt", default="", help="a DSpark run's checkpoint or run directory")
    ap.add_argument("--backbone-ckpt", default="", help="the backbone's checkpoint (default: the one the drafter's "
                                                        "marker names)")
    ap.add_argument("--spec-tokens", type=int, default=0, help="drafts verified per step; 0 = the block size")
    ap.add_argument("--schedules", default="fixed,auto")
    ap.add_argument("--oracle", default="", help="comma list of acceptance probabilities for oracle-drafter runs")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--replay", default="halo", choices=("none", "window", "halo"))
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (torch.set_num_threads); 0 = torch's default")
    ap.add_argument("--json", default=None, help="append one JSON line per variant")
    ap.add_argument("--text", default="", help="glob of text files the prompts are cut from (with --drafter-ckpt)")
    ap.add_argument("--save-bundle", default="", help="write weights and prompts to this file")
    ap.add_argument("--bundle", default="", help="weights and prompts from this file (--save-bundle's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.drafter_ckpt and args.random:
        ap.error("--random and --drafter-ckpt exclude each other")
    if args.backbone_ckpt and not args.drafter_ckpt:
        ap.error("--backbone-ckpt goes with --drafter-ckpt (the drafter of that backbone)")
    prompts = None
    if args.bundle:
        backbone, drafter, prompts, weights = load_bundle(args.bundle, device)
    elif args.drafter_ckpt:
        from trainer.stages.dspark import load_drafter

        backbone, drafter = load_drafter(args.drafter_ckpt, device, backbone=args.backbone_ckpt or None)
        weights = f"drafter {args.drafter_ckpt}"
        if args.text:
            prompts = text_prompts(args.drafter_ckpt, args.text, args.prompts, args.prompt_len)
            weights += f", prompts from {args.text}"
    else:
        backbone = build(args.model, device, seed=0)
        drafter = random_drafter(backbone.cfg, device, seed=1)
        weights = f"random {args.model}"
    cfg = backbone.cfg
    K = args.spec_tokens or cfg.dspark.block_size
    if prompts is None:
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, cfg.vocab_size, (args.prompt_len,), generator=g).tolist()
                   for _ in range(args.prompts)]
    args.prompts, args.prompt_len = len(prompts), len(prompts[0])
    if args.save_bundle:
        import dataclasses

        hasher = getattr(backbone, "hasher", None)  # Engram's canonical map: a buffer no state dict holds
        torch.save({"model": dataclasses.asdict(cfg), "backbone": backbone.state_dict(), "weights": weights,
                    "drafter": drafter.state_dict(), "prompts": prompts,
                    "canonical_map": None if hasher is None else hasher.canonical_map.cpu()}, args.save_bundle)
    params = SamplingParams(temperature=0, max_new_tokens=args.new_tokens)
    oracles = [float(p) for p in args.oracle.split(",") if p]
    oracle = random_drafter(cfg, device, seed=1, cls=OracleDrafter) if oracles else None
    if oracle is not None:
        oracle.load_state_dict(drafter.state_dict())

    plain = Engine(backbone, max_batch=1, max_len=args.prompt_len + args.new_tokens, replay=args.replay)
    variants: dict[str, tuple[Engine, float | None]] = {"plain": (plain, None)}
    for s in args.schedules.split(","):
        variants[f"spec {s}"] = (Engine(backbone, max_batch=1, max_len=plain.max_len, replay=args.replay,
                                        drafter=drafter, spec_tokens=K, spec_schedule=s), None)
    for p in oracles:
        variants[f"oracle p={p:g} fixed"] = (Engine(backbone, max_batch=1, max_len=plain.max_len, replay=args.replay,
                                                    drafter=oracle, spec_tokens=K), p)
    threads = f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"speculative decoding, {weights}, batch 1, greedy, {args.prompts} prompts x {args.prompt_len} tokens, "
          f"{args.new_tokens} new tokens, spec_tokens {K}, replay {args.replay}, {args.repeats} repeats after a "
          f"warm-up (torch {torch.__version__}, {name}{threads})")

    def run(eng: Engine, prompt: list[int], p: float | None, script: list[int]):
        if p is not None:
            oracle.setup(script, p)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = eng.generate([Request(prompt, params)])[0]
        if device.type == "cuda":
            torch.cuda.synchronize()
        return out, time.perf_counter() - t0

    wall = {v: [0.0] * args.repeats for v in variants}
    scripts = []
    for i, prompt in enumerate(prompts):  # warm-up (and the plain tokens the oracles and the checks read)
        out, _ = run(plain, prompt, None, [])
        scripts.append(out.prompt_ids + out.token_ids)
        for v, (eng, p) in variants.items():
            if v != "plain":
                run(eng, prompt, p, scripts[i])
    for eng, _ in variants.values():
        eng.stats = {k: type(x)(0) for k, x in eng.stats.items()}
    for r in range(args.repeats):
        for i, prompt in enumerate(prompts):
            order = list(variants) if (r + i) % 2 == 0 else list(variants)[::-1]
            for v in order:
                eng, p = variants[v]
                out, dt = run(eng, prompt, p, scripts[i])
                wall[v][r] += dt
                if out.prompt_ids + out.token_ids != scripts[i]:
                    raise RuntimeError(f"{v}: prompt {i}'s tokens differ from plain decoding's")
    base = statistics.median(wall["plain"])
    print(f"  {'variant':22s} {'wall s':>8s} {'decode tok/s':>13s} {'tok/forward':>12s} {'accepted/verify':>16s} "
          f"{'acceptance':>11s} {'drafting':>9s} {'speed-up':>9s}")
    for v, (eng, p) in variants.items():
        s = eng.stats
        med = statistics.median(wall[v])
        rows = max(s["decode_row_forwards"], 1)
        row = dict(variant=v, wall_s=med, wall_runs_s=wall[v], decode_tokens_per_s=s["decode_tokens"] / s["decode_s"],
                   tokens_per_forward=s["decode_tokens"] / rows, accepted_per_verify=s["accepted_tokens"] / rows,
                   acceptance=s["accepted_tokens"] / max(s["drafted_tokens"], 1),
                   drafting_share=s["draft_s"] / s["decode_s"], speed_up=base / med)
        print(f"  {v:22s} {med:8.2f} {row['decode_tokens_per_s']:13.1f} {row['tokens_per_forward']:12.2f} "
              f"{row['accepted_per_verify']:16.2f} {row['acceptance']:11.2f} {row['drafting_share']:9.2f} "
              f"{row['speed_up']:9.2f}")
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps({"bench": "spec_decode", "device": str(device), "weights": weights,
                                    "spec_tokens": K, "prompts": args.prompts, "prompt_len": args.prompt_len,
                                    "new_tokens": args.new_tokens, "threads": torch.get_num_threads(), **row}) + "\n")


if __name__ == "__main__":
    main()
