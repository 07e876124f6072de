"""Generation on the inference cache (model/cache.py, model/serving.py): cache bytes, CED prefill, decode, and the
deviation of bounded replay, each against a baseline measured in the same run.

Usage (subcommands; `all` runs bytes, prefill, decode and batch in turn, and deviation when --checkpoint is given):
  .venv/bin/python bench/generation.py bytes [--models v41_flash,v41_small,v41_tiny]
  .venv/bin/python bench/generation.py prefill [--model v41_tiny] [--prompt-len 2048] [--repeats 5]
  .venv/bin/python bench/generation.py prefill-kernels [--model v41_small] [--prompt-len 8192] [--repeats 3]
      [--replays none,window]
  .venv/bin/python bench/generation.py decode [--long 32768] [--short 2048] [--chunk 1024] [--steps 24] [--profile]
  .venv/bin/python bench/generation.py batch [--context 2048,32768] [--batch-sizes 1,32] [--steps 24]
  .venv/bin/python bench/generation.py deviation --checkpoint RUN_DIR [--prompt-lens 256,512] [--prompts 6]
      [--continue 160]
Common: --device auto|cpu|cuda, --threads N, --model NAME (conf/model), --precision auto|fp32|bf16 (auto: bf16
autocast on CUDA, fp32 on CPU), --json OUT.jsonl (one line per result, written as each is measured).

What each subcommand measures:
- bytes: the cache's allocated buffers on the meta device (`KVCache.nbytes`), per token of context for the global
  KV (persistent: what the prefix cache keeps), against the planner's count (model.accounting.kv_bytes); and per
  request the short-lived state (one SWA ring per layer, the open compression groups), against the planner's
  one-ring figure times the layers. The serving formats are the model config's (fp4 / fp4 / fp8 by default).
- prefill: the wall time of one prompt's prefill (batch 1) with replay "none" (every row through every layer, the
  baseline), "halo" (exact) and "window", the three alternated in every repeat (a load that comes and goes on a
  shared machine slows all alike); medians and the ratio to "none", and the mean time inside the encoder's and the
  decoder's blocks. Checks that "halo"'s last-row logits equal "none"'s. The model's kernel switch is the config's
  ("auto": on a GPU the prefill runs the training forward's kernels; prefill-kernels compares both paths).
- prefill-kernels: the prefill with the kernel switch on (model.kernels="triton": the training forward's kernels,
  model/serving.py `prefill_attention`) and off (the reference path), the same weights, each --replays variant ("none":
  full depth; "window": the CED encoder-only path, the decoder on the last W rows), alternated in every repeat; and in
  the same process the training forward of the same tokens on the kernels (no cache, full depth), eager and compiled
  block by block (trainer.compile's regional compilation). Medians, the speed-up over the reference, the ratio to
  the compiled forward, and the last-row logits' distance from the reference path's.
- decode: the time of one decoded token (batch 1) after a short and after a long context, the caches' single-token
  steps alternated. The long cache gets its context from `synthetic_fill` (random stored entries and ring rows, the
  counts set: prefilling 32K tokens through the reference path would take far longer than the bench), and so does
  one short cache; a second short cache is prefilled in --chunk-token calls (later chunks run the cache's exact
  decode path: no [T, T] logits), the check that the synthetic fill costs what a real one does (--fill prefill
  prefills them all). Per step, the time inside the serving path's pieces (stored entries decoded, ring reads,
  cache writes, compressor, indexer scores, top-k, pool, attention, MoE, mHC coefficients, Engram), and with
  --profile the operators torch.profiler ranks first at the long context.
- batch: decode tokens/s at each batch size on caches of each --context per row (filled as in decode), the batch
  sizes' steps alternated.
- deviation (its code: bench/replay_deviation.py): a trained checkpoint (DCP, `trainer.checkpoint`: the model state
  only), prompts from held-out text (the default corpus' shards that the run's first epoch reaches last), batched per
  prompt length. The exact path is replay "none"; its greedy continuation is fed to "window" and "halo" (teacher
  forcing), and per scored row the logits are compared: max and mean |diff|, KL(exact || replay), top-1 agreement, for
  the last prompt row and for buckets of continuation steps.
The timed subcommands use random weights and random prompts (the cost does not depend on them).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import model as model_pkg  # noqa: E402
from model.accounting import kv_bytes  # noqa: E402
from tests.helpers import load_config  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
_MB = 2**20


# -- set-up ---------------------------------------------------------------------------------------------------------
class Env:
    """Device, autocast and the JSON sink shared by the subcommands."""

    def __init__(self, args):
        dev = args.device
        if dev == "auto":
            dev = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(dev)
        prec = args.precision
        if prec == "auto":
            prec = "bf16" if self.device.type == "cuda" else "fp32"
        self.precision = prec
        self.json = args.json

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.precision == "bf16")

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def now(self) -> float:
        self.sync()
        return time.perf_counter()

    def emit(self, kind: str, row: dict) -> None:
        if self.json:
            with open(self.json, "a") as f:
                f.write(json.dumps({"bench": kind, "device": str(self.device), "precision": self.precision, **row})
                        + "\n")

    def header(self) -> str:
        threads = f", threads {torch.get_num_threads()}" if self.device.type == "cpu" else ""
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        return f"torch {torch.__version__}, {name}{threads}, {self.precision}"


def build(name: str, device, seed: int = 0, kernels: str | None = None):
    """conf/model/<name>.yaml built on meta, materialised on `device`, initialised (fp32 parameters); kernels: the
    kernel switch (model.kernels), None for the config's."""
    torch.manual_seed(seed)
    cfg = load_config(name) if kernels is None else load_config(name, kernels=kernels)
    with torch.device("meta"):
        m = model_pkg.build(cfg)
    m.to_empty(device=device)
    m.init_weights()
    return m.eval()


def random_ids(cfg, batch: int, n: int, seed: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, cfg.vocab_size, (batch, n), generator=g).to(device)


def fill(m, cache, ids: torch.Tensor, chunk: int, env: Env) -> torch.Tensor:
    """Append ids [B, T] to the cache in calls of `chunk` tokens; the last call's logits."""
    logits = None
    for i in range(0, ids.shape[1], chunk):
        with env.autocast():
            logits = m(ids[:, i:i + chunk], cache=cache)
    return logits


def synthetic_fill(m, cache, n: int, seed: int) -> None:
    """Put the cache in the state of n tokens per row without running the model: every stored entry (main KV,
    indexer key) and every SWA ring row an encoded random vector (unit RMS, as the normed latents are), the counts
    set. A decode step's work depends on the counts, not on the values, and this takes seconds where prefilling 32K
    tokens through the reference path takes tens of minutes on a 2-core CPU (its cost grows with the square of the
    context); `run_decode` checks the two against each other at the short context."""
    B, dev = cache.batch_size, cache.lengths.device
    g = torch.Generator(device=dev).manual_seed(seed)
    W = m.cfg.attention.window

    def put(store, rows: int) -> None:
        if rows == 0:
            return
        value = torch.randn(B, rows, store.dim, generator=g, device=dev).to(store.dtype)
        b = torch.arange(B, device=dev).repeat_interleave(rows)
        r = torch.arange(rows, device=dev).repeat(B)
        store.write(b, r, tuple(p.flatten(0, 1) for p in store.encode(value, None, None)))

    for spec in m.plan:
        lc = cache.layers[spec.index]
        put(lc.swa, min(W, n))
        if lc.main is not None:
            if n % spec.ratio:
                raise ValueError(f"synthetic fill: {n} tokens leave an open group at ratio {spec.ratio}")
            put(lc.main, n // spec.ratio)
            put(lc.keys, n // spec.ratio)
            lc.entries.fill_(n // spec.ratio)
    cache.tokens[:, :n] = torch.randint(3, m.cfg.vocab_size, (B, n), generator=g, device=dev)
    cache.lengths.fill_(n)
    cache.prefilled.fill_(True)


# -- 1. bytes -------------------------------------------------------------------------------------------------------
def run_bytes(args, env: Env) -> None:
    B, L = 2, args.bytes_len
    print(f"cache bytes on the meta device: batch {B} x max_len {L}; formats main KV / indexer keys / SWA "
          f"(model.quant.cache_*: the config's serving formats, then bf16 throughout as the baseline)")
    print(f"{'model':10s} {'formats':15s} {'global KV B/token':>18s} {'planner':>9s} {'MiB at 2^20 tokens':>19s} "
          f"{'SWA rings / request':>20s} {'planner':>10s} {'open groups':>12s}")
    for name in args.models.split(","):
        base = load_config(name)
        for q in (base.quant, dataclasses.replace(base.quant, cache_main_kv="bf16", cache_index="bf16",
                                                  cache_swa_kv="bf16")):
            with torch.device("meta"):
                m = model_pkg.build(dataclasses.replace(base, quant=q))
            cache = m.new_cache(B, L)
            per_token = cache.nbytes(persistent=True) / (B * L)
            plan = kv_bytes(m)
            rings = sum(lc.swa.nbytes() for lc in cache.layers.values()) / B
            groups = cache.nbytes(persistent=False) / B - rings
            plan_rings = plan["swa_kv_bytes_per_layer"] * m.cfg.num_layers
            fmts = f"{q.cache_main_kv}/{q.cache_index}/{q.cache_swa_kv}"
            print(f"{name:10s} {fmts:15s} {per_token:18.2f} {plan['kv_bytes_per_token_persistent']:9.2f} "
                  f"{per_token:19.1f} {rings / 1024:17.1f} KB {plan_rings / 1024:7.1f} KB {groups / 1024:9.1f} KB")
            env.emit("bytes", dict(model=name, formats=fmts, global_bytes_per_token=per_token,
                                   planner_bytes_per_token=plan["kv_bytes_per_token_persistent"],
                                   swa_ring_bytes_per_request=rings, planner_swa_ring_bytes=plan_rings,
                                   open_group_bytes_per_request=groups))


# -- 2. prefill -----------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def timed_blocks(m, env: Env, totals: dict):
    """Wall time inside each Block's forward, added into totals[layer index] (forward hooks)."""
    start: dict[int, float] = {}

    def pre(block, _):
        start[block.spec.index] = env.now()

    def post(block, _, __):
        totals[block.spec.index] += env.now() - start[block.spec.index]

    hooks = [h for b in m.layers for h in (b.register_forward_pre_hook(pre), b.register_forward_hook(post))]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def run_prefill(args, env: Env) -> None:
    m = build(args.model, env.device)
    T = args.prompt_len
    ids = random_ids(m.cfg, 1, T, 1, env.device)
    from model.serving import _kept_rows

    variants = ("none", "halo", "window")
    times: dict[str, list[float]] = defaultdict(list)
    blocks = {v: defaultdict(float) for v in variants}
    last: dict[str, torch.Tensor] = {}
    print(f"prefill, {args.model}, batch 1 x {T} tokens, {args.repeats} repeats after one warm-up "
          f"({env.header()})")
    with torch.no_grad():
        for r in range(args.repeats + 1):
            for v in variants if r % 2 == 0 else variants[::-1]:  # alternate the order too
                cache = m.new_cache(1, T, replay=v)
                with timed_blocks(m, env, blocks[v] if r > 0 else defaultdict(float)):
                    t0 = env.now()
                    with env.autocast():
                        logits = m(ids, cache=cache)
                    dt = env.now() - t0
                if r > 0:
                    times[v].append(dt)
                last[v] = logits[:, -1].float()
                del cache, logits
    base = statistics.median(times["none"])
    n_enc = m.cfg.num_encoder_layers
    for v in variants:
        med = statistics.median(times[v])
        kept = _kept_rows(m.new_cache(1, 1, replay=v), m, T)
        diff = float((last[v] - last["none"]).abs().max())
        per = {i: t / args.repeats * 1e3 for i, t in blocks[v].items()}  # mean ms per layer
        enc, first = sum(per[i] for i in range(n_enc)), per[n_enc]
        dec = sum(t for i, t in per.items() if i >= n_enc)
        print(f"  replay={v:7s} decoder rows {kept:5d}  {med * 1e3:9.1f} ms  ({min(times[v]) * 1e3:.1f}-"
              f"{max(times[v]) * 1e3:.1f})  {T / med:8.0f} tok/s  ratio to none {med / base:.3f}  "
              f"last-row max |logit diff| vs none {diff:.2e}")
        print(f"  {'':14s} mean ms in the blocks: encoder {enc:8.1f}, decoder {dec:8.1f} (its first layer "
              f"{first:7.1f})")
        env.emit("prefill", dict(model=args.model, prompt_len=T, replay=v, decoder_rows=kept, median_s=med,
                                 ratio_to_none=med / base, times_s=times[v], last_row_max_abs_diff=diff,
                                 block_ms=per))


def run_prefill_kernels(args, env: Env) -> None:
    """The prefill on the training forward's kernels against the reference path (the same weights, kernels
    "triton" and "reference"), for each --replays variant, alternated in every repeat; then the training forward of
    the same tokens (no cache, full depth) on the kernels, eager and compiled block by block as trainer.compile
    compiles it (trainer/parallel/compile.py), in the same process. No hooks inside the timed calls."""
    from trainer.parallel.compile import compile_blocks

    T = args.prompt_len
    ref = build(args.model, env.device, kernels="reference")
    tri = build(args.model, env.device, kernels="triton")
    tri.load_state_dict(ref.state_dict())
    models = {"reference": ref, "triton": tri}
    ids = random_ids(ref.cfg, 1, T, 1, env.device)
    variants = [(k, r) for k in models for r in args.replays.split(",")]
    times: dict = defaultdict(list)
    last: dict = {}
    print(f"prefill on the kernels, {args.model}, batch 1 x {T} tokens, {args.repeats} repeats after one warm-up "
          f"({env.header()})", flush=True)

    def timed(fn) -> tuple[float, torch.Tensor]:
        t0 = env.now()
        with env.autocast():
            out = fn()
        return env.now() - t0, out

    with torch.no_grad():
        for rep in range(args.repeats + 1):
            for k, r in variants if rep % 2 == 0 else variants[::-1]:
                cache = models[k].new_cache(1, T, replay=r)
                dt, logits = timed(lambda: models[k](ids, cache=cache))
                if rep:
                    times[(k, r)].append(dt)
                last[(k, r)] = logits[:, -1].float()
                del cache, logits
        forward = {}
        # (torch.compile cannot trace the Triton interpreter's launches: on the CPU the eager forward alone)
        for label in ("eager", "compiled") if env.device.type == "cuda" else ("eager",):
            if label == "compiled":
                compile_blocks(tri)
                compile_s, _ = timed(lambda: tri(ids))
                print(f"  (compiling the blocks and the first compiled forward: {compile_s:.1f} s)", flush=True)
            forward[label] = [timed(lambda: tri(ids))[0] for _ in range(args.repeats + 1)][1:]
    base_label = "compiled" if "compiled" in forward else "eager"
    base = statistics.median(forward[base_label])
    for label, ts in forward.items():
        med = statistics.median(ts)
        print(f"  training forward (kernels, no cache, full depth), {label:8s} {med * 1e3:9.1f} ms  "
              f"({min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f})")
        env.emit("prefill_kernels", dict(model=args.model, prompt_len=T, what=f"training forward, {label}",
                                         median_s=med, times_s=ts))
    for k, r in variants:
        med = statistics.median(times[(k, r)])
        ref_med = statistics.median(times[("reference", r)])
        diff = float((last[(k, r)] - last[("reference", r)]).abs().max())
        print(f"  prefill kernels={k:9s} replay={r:6s} {med * 1e3:9.1f} ms  ({min(times[(k, r)]) * 1e3:.1f}-"
              f"{max(times[(k, r)]) * 1e3:.1f})  {ref_med / med:6.2f}x the reference  {med / base:6.3f} of the "
              f"{base_label} forward  last-row max |logit diff| vs the reference {diff:.2e}")
        env.emit("prefill_kernels", dict(model=args.model, prompt_len=T, kernels=k, replay=r, median_s=med,
                                         speedup=ref_med / med, ratio_to=f"{base_label} forward",
                                         ratio_to_forward=med / base,
                                         times_s=times[(k, r)], last_row_max_abs_diff=diff))


# -- 3. decode ------------------------------------------------------------------------------------------------------
# The serving path's pieces, timed by wrapping the functions it calls (none calls another of the list, so the times
# add up; the rest of a step is "other": projections, norms, mHC, Engram, head, bookkeeping).
_PIECES = (
    ("stored entries decoded (Store.read_prefix)", "model.cache", "Store", "read_prefix"),
    ("SWA ring read (Store.read)", "model.cache", "Store", "read"),
    ("cache writes (Store.write)", "model.cache", "Store", "write"),
    ("compressor (_compress_new)", "model.serving", None, "_compress_new"),
    ("indexer scores (index_scores)", "model.serving", None, "index_scores"),
    ("top-k (select_topk)", "model.serving", None, "select_topk"),
    ("candidate pool (candidate_pool)", "model.serving", None, "candidate_pool"),
    ("attention (attend)", "model.serving", None, "attend"),
    ("MoE (MoE.forward)", "model.moe", "MoE", "forward"),
    ("mHC coefficients (HCSite.forward, Sinkhorn)", "model.mhc", "HCSite", "forward"),
    ("Engram (Engram.forward)", "model.engram", "Engram", "forward"),
)


@contextlib.contextmanager
def timed_pieces(env: Env, totals: dict):
    """Wrap the serving path's pieces with wall-clock timers adding into totals[label] while inside."""
    import importlib

    undo = []
    for label, mod_name, cls, fn in _PIECES:
        owner = importlib.import_module(mod_name)
        if cls is not None:
            owner = getattr(owner, cls)
        orig = getattr(owner, fn)

        def wrapped(*a, _orig=orig, _label=label, **kw):
            t0 = env.now()
            out = _orig(*a, **kw)
            totals[_label] += env.now() - t0
            return out

        setattr(owner, fn, wrapped)
        undo.append((owner, fn, orig))
    try:
        yield
    finally:
        for owner, fn, orig in undo:
            setattr(owner, fn, orig)


def decode_steps(m, cache, tok: torch.Tensor, steps: int, env: Env) -> list[float]:
    """`steps` single-token decode calls on the cache (feeding the greedy token); wall time of each."""
    out = []
    for _ in range(steps):
        t0 = env.now()
        with env.autocast():
            logits = m(tok, cache=cache)
        out.append(env.now() - t0)
        tok = logits[:, -1:].argmax(-1)
    return out


def run_decode(args, env: Env) -> None:
    m = build(args.model, env.device)
    n_short, n_long = args.short, args.long
    # three caches: the short context built by prefilling (the check), then the short and long contexts filled
    # synthetically (--fill synthetic, the default) or by prefilling too (--fill prefill)
    ctx = {"short, prefilled": (n_short, "prefill"), "short": (n_short, args.fill), "long": (n_long, args.fill)}
    print(f"decode, {args.model}, batch 1, contexts {n_short} and {n_long} (--fill {args.fill}; prefilled caches "
          f"in calls of {args.chunk} tokens), {args.steps} steps each after 2 warm-up steps ({env.header()})")
    caches = {}
    tok = random_ids(m.cfg, 1, 1, 4, env.device)
    with torch.no_grad():
        for k, (n, how) in ctx.items():
            cache = m.new_cache(1, n + args.steps + 16, replay="none")
            t0 = time.perf_counter()
            if how == "prefill":
                fill(m, cache, random_ids(m.cfg, 1, n, 2, env.device), args.chunk, env)
            else:
                synthetic_fill(m, cache, n, 2)
            print(f"  {k:17s} {n:6d} tokens: cache filled in {time.perf_counter() - t0:6.1f} s ({how}), global KV "
                  f"{cache.nbytes(persistent=True) / _MB:.2f} MB allocated")
            caches[k] = cache
            decode_steps(m, cache, tok, 2, env)  # warm-up
        times: dict[str, list[float]] = defaultdict(list)
        pieces = {k: defaultdict(float) for k in ctx}
        for i in range(args.steps):  # the caches' steps alternate, the order turning every step
            for k in (list(ctx) if i % 2 == 0 else list(ctx)[::-1]):
                with timed_pieces(env, pieces[k]):
                    times[k].append(decode_steps(m, caches[k], tok, 1, env)[0])  # (the same token every step)
        med = {k: statistics.median(v) for k, v in times.items()}
        for k, (n, how) in ctx.items():
            print(f"  {k:17s} context {n:6d}: {med[k] * 1e3:8.1f} ms/token ({min(times[k]) * 1e3:.1f}-"
                  f"{max(times[k]) * 1e3:.1f}), {1 / med[k]:6.1f} tok/s")
        print(f"  long / short: {med['long'] / med['short']:.2f}x (the planner's decode FLOPs, "
              f"model.accounting.decode_flops_per_token: {_flops_ratio(m, n_long, n_short):.3f}x); synthetic / "
              f"prefilled short cache: {med['short'] / med['short, prefilled']:.2f}x")
        print("  where a step's time goes (mean ms per token; on CUDA each timer adds a sync):")
        print(f"  {'piece':46s} " + " ".join(f"{k:>17s}" for k in ctx) + f" {'long - short':>13s}")
        rows = {}
        for label, *_ in _PIECES:
            rows[label] = [pieces[k][label] / args.steps * 1e3 for k in ctx]
        mean = [statistics.mean(times[k]) * 1e3 for k in ctx]
        rows["other (projections, norms, mHC mixing, head)"] = [
            mu - sum(pieces[k].values()) / args.steps * 1e3 for mu, k in zip(mean, ctx)]
        rows["whole step (mean)"] = mean
        for label, vals in rows.items():
            print(f"  {label:46s} " + " ".join(f"{v:17.2f}" for v in vals) + f" {vals[2] - vals[1]:+13.2f}")
        env.emit("decode", dict(model=args.model, contexts={k: v[0] for k, v in ctx.items()}, fill=args.fill,
                                median_s=med, times_s=times,
                                pieces_ms={label: dict(zip(ctx, vals)) for label, vals in rows.items()}))
        if args.profile:
            profile_step(m, caches["long"], tok, env, n_long)


def _flops_ratio(m, long: int, short: int) -> float:
    from model.accounting import decode_flops_per_token

    return decode_flops_per_token(m, long) / decode_flops_per_token(m, short)


def profile_step(m, cache, tok, env: Env, n: int, steps: int = 3) -> None:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if env.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        decode_steps(m, cache, tok, steps, env)
    key = "self_device_time_total" if env.device.type == "cuda" else "self_cpu_time_total"
    print(f"  torch.profiler, {steps} decode steps at context {n}, operators by self time:")
    print(prof.key_averages().table(sort_by=key, row_limit=12, max_name_column_width=40))


# -- 4. batch -------------------------------------------------------------------------------------------------------
def run_batch(args, env: Env) -> None:
    from model.serving import compiled_decode_step
    from trainer.engine.engine import _DecodeGraph

    m = build(args.model, env.device)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    modes = args.step.split(",")
    bad = [s for s in modes if s not in _STEP_MODES]
    cuda_only = [s for s in modes if s in ("graph", "compiled") and env.device.type != "cuda"]
    if bad or cuda_only:
        raise SystemExit(f"--step: {bad or cuda_only} not one of {list(_STEP_MODES)} (graph, compiled: CUDA only)")
    for n in (int(c) for c in args.context.split(",")):
        print(f"decode throughput, {args.model}, context {n} per row (--fill {args.fill}), {args.steps} steps after 2 "
              f"warm-up steps, the steps of one batch size alternated; steps: "
              f"{', '.join(f'{s} = {_STEP_MODES[s]}' for s in modes)} ({env.header()})")
        base = None
        for B in sizes:  # one batch size at a time: its caches (and graphs) freed before the next
            steps = {}
            with torch.no_grad(), env.autocast():
                for mode in modes:
                    cache = m.new_cache(B, n + 3 * args.steps + 16, replay="none")
                    if args.fill == "prefill":
                        fill(m, cache, random_ids(m.cfg, B, n, 3, env.device), max(1, args.chunk // B), env)
                    else:
                        synthetic_fill(m, cache, n, 3)
                    if mode == "graph":
                        step = _DecodeGraph(m, cache)
                    elif mode == "compiled":
                        step = _DecodeGraph(m, cache, compiled_decode_step(m))
                    elif mode == "static":
                        step = (lambda c: lambda x: m(x, cache=c, static=True))(cache)
                    else:
                        step = (lambda c: lambda x: m(x, cache=c))(cache)
                    for _ in range(2):
                        step(random_ids(m.cfg, B, 1, 4, env.device))
                    steps[mode] = step
                    if args.count_kernels and mode in ("static", "compiled"):
                        count_kernels(m, cache, B, mode, n, env)
                times: dict[str, list[float]] = defaultdict(list)
                for i in range(args.steps):
                    for mode in modes if i % 2 == 0 else modes[::-1]:
                        tok = random_ids(m.cfg, B, 1, 4 + i, env.device)
                        t0 = env.now()
                        steps[mode](tok)
                        times[mode].append(env.now() - t0)
            del steps
            for mode in modes:
                med = statistics.median(times[mode])
                tps = B / med
                base = base or tps
                print(f"  batch {B:3d} {mode:7s}: {med * 1e3:8.2f} ms/step  {tps:9.1f} tokens/s  ({tps / base:.2f}x "
                      f"batch {sizes[0]} {modes[0]})")
                env.emit("batch", dict(model=args.model, context=n, fill=args.fill, batch=B, step=mode,
                                       median_step_s=med, tokens_per_s=tps, times_s=times[mode]))


_STEP_MODES = {"dynamic": "the serving forward (model(ids, cache=cache))",
               "static": "model.serving.decode_step (static shapes, op by op)",
               "graph": "decode_step replayed from a CUDA graph (Engine(cuda_graph=True))",
               "compiled": "decode_step through torch.compile (Inductor) replayed from a CUDA graph "
                           "(Engine(cuda_graph=True, compile_decode='inductor'))"}


def count_kernels(m, cache, B: int, mode: str, n: int, env: Env) -> None:
    """The device kernels one decode step launches (torch.profiler over the step outside a graph: what a graph of
    it replays), in all and per layer."""
    from torch.profiler import ProfilerActivity, profile

    from model.serving import compiled_decode_step

    step = compiled_decode_step(m) if mode == "compiled" else (lambda x, c: m(x, cache=c, static=True))
    tok = random_ids(m.cfg, B, 1, 5, env.device)
    step(tok, cache)
    env.sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(tok, cache)
        env.sync()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith(("Memcpy", "Memset"))]
    copies = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA) - len(kernels)
    layers = len(m.layers)
    print(f"  kernels of one {mode} decode step, batch {B}, context {n}: {len(kernels)} ({len(kernels) / layers:.1f} "
          f"per layer of {layers}; {copies} memcpy/memset besides)")
    env.emit("kernels", dict(mode=mode, batch=B, context=n, kernels=len(kernels), per_layer=len(kernels) / layers,
                             copies=copies))


# -- 5. deviation ---------------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("bytes", "prefill", "prefill-kernels", "decode", "batch", "deviation", "all"))
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--model", default="v41_tiny")
    ap.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16"))
    ap.add_argument("--json", default=None, help="append one JSON line per result")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (torch.set_num_threads); 0 = torch's default")
    ap.add_argument("--models", default="v41_flash,v41_small,v41_tiny", help="bytes: the configs to count")
    ap.add_argument("--bytes-len", type=int, default=4096, help="bytes: max_len of the counted cache")
    ap.add_argument("--prompt-len", type=int, default=2048, help="prefill: prompt tokens")
    ap.add_argument("--repeats", type=int, default=5, help="prefill: timed repeats of each variant")
    ap.add_argument("--replays", default="none,window", help="prefill-kernels: cache replays (comma list; none is "
                    "full depth, window the CED encoder-only path)")
    ap.add_argument("--short", type=int, default=2048, help="decode: the short context")
    ap.add_argument("--long", type=int, default=32768, help="decode: the long context")
    ap.add_argument("--chunk", type=int, default=1024, help="decode, batch: tokens per cache-filling call (batch: "
                                                            "divided by the batch size)")
    ap.add_argument("--steps", type=int, default=24, help="decode, batch: timed decode steps per variant")
    ap.add_argument("--fill", default="synthetic", choices=("synthetic", "prefill"),
                    help="decode, batch: how the timed caches get their context (synthetic_fill or prefilling)")
    ap.add_argument("--profile", action="store_true", help="decode: torch.profiler table at the long context")
    ap.add_argument("--count-kernels", action="store_true",
                    help="batch: count the device kernels of one static / compiled step (torch.profiler)")
    ap.add_argument("--context", default="2048,32768", help="batch: context tokens per row (comma list: one run each)")
    ap.add_argument("--batch-sizes", default="1,32", help="batch: batch sizes to compare")
    ap.add_argument("--step", default="dynamic", help="batch: decode steps to compare (comma list of dynamic, static, "
                    "graph, compiled)")
    ap.add_argument("--checkpoint", default="", help="deviation: run dir, checkpoints/ dir or a step_<N> dir")
    ap.add_argument("--data-path", default=str(ROOT / ".data" / "stdlib"), help="deviation: prepared shards")
    ap.add_argument("--data-seed", type=int, default=0, help="deviation: the run's data.seed (its shard order)")
    ap.add_argument("--prompt-lens", default="256,512", help="deviation: prompt lengths (one batch each)")
    ap.add_argument("--prompts", type=int, default=6, help="deviation: prompts per length")
    ap.add_argument("--continue", dest="continue_tokens", type=int, default=160,
                    help="deviation: greedy continuation tokens")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    env = Env(args)
    from bench.replay_deviation import run_deviation

    todo = {"bytes": run_bytes, "prefill": run_prefill, "prefill-kernels": run_prefill_kernels, "decode": run_decode,
            "batch": run_batch, "deviation": run_deviation}
    names = [n for n in todo if n != "prefill-kernels"] if args.what == "all" else [args.what]
    if args.what == "all" and not args.checkpoint:
        names.remove("deviation")
    for name in names:
        t0 = time.perf_counter()
        todo[name](args, env)
        print(f"[{name}: {time.perf_counter() - t0:.0f} s]\n", flush=True)


if __name__ == "__main__":
    main()
