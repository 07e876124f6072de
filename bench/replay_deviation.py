"""The deviation of bounded replay on a trained checkpoint, `python bench/generation.py deviation --checkpoint RUN_DIR
[--prompt-lens 256,512] [--prompts 6] [--continue 160]` (bench/generation.py's docstring says what it measures; its
options and Env are generation.py's): held-out prompts, the exact path's greedy continuation teacher-forced into the
"window" and "halo" replays, and their logits compared.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import torch


def load_checkpoint(path: str, device, tokenizer_path: str):
    """(model, checkpoint dir) from a run directory, its checkpoints/ folder or one step_<N> directory: the newest
    complete checkpoint in one process (trainer/checkpoint/loading.py, what `python -m trainer.cli.generate` loads), with
    Engram's canonical map from the run's tokenizer."""
    from trainer.checkpoint.loading import find_checkpoint, load_model, model_config, read_marker

    p = find_checkpoint(path)
    cfg = model_config(read_marker(p).get("model"), None, [], p)
    return load_model(p, cfg, device, tokenizer_path), p


def held_out_prompts(data_path: str, seed: int, lengths: list[int], per_length: int) -> tuple[dict, str]:
    """{length: [per_length, length] ids}: windows of distinct documents from the shards epoch 0 reads last
    (data/loader.py's order for one reader), one window of each document, from a quarter of its length on (less where
    it is short)."""
    from data.loader import epoch_shards
    from data.shards import read_meta, read_shard

    meta, shards = read_meta(data_path)
    order = epoch_shards(len(shards), 0, seed, True, 0, 1)
    need = per_length * len(lengths)
    docs, used, before = [], [], sum(s.num_tokens for s in shards)
    longest = max(lengths)
    for idx in reversed(order):
        for d in read_shard(str(Path(data_path) / shards[idx].name), shards[idx], meta["ids_dtype"]):
            if len(d) >= longest * 5 // 4:
                docs.append(d)
        used.append(idx)
        before -= shards[idx].num_tokens
        if len(docs) >= need:
            break
    if len(docs) < need:
        raise SystemExit(f"error: only {len(docs)} documents of >= {longest * 5 // 4} tokens in {data_path}")
    out, k = {}, 0
    for n in lengths:
        rows = []
        for _ in range(per_length):
            d = docs[k]
            k += 1
            s = min(len(d) // 4, len(d) - n)
            rows.append(torch.from_numpy(d[s:s + n].astype("int64")))
        out[n] = torch.stack(rows)
    where = (f"{len(used)} of {len(shards)} shards, the last in epoch 0's order ({before / 1e6:.2f}M of "
             f"{meta['num_tokens'] / 1e6:.2f}M tokens come before them)")
    return out, where


def compare(exact: torch.Tensor, other: torch.Tensor) -> dict:
    """exact, other [N, V] fp32 logits -> max |diff|, mean |diff|, mean KL(exact || other), top-1 agreement."""
    d = (exact - other).abs()
    lp, lq = exact.double().log_softmax(-1), other.double().log_softmax(-1)  # fp32 rounding would swamp a small KL
    kl = (lp.exp() * (lp - lq)).sum(-1)
    return dict(max_abs=float(d.max()), mean_abs=float(d.mean()), kl_mean=float(kl.mean()), kl_max=float(kl.max()),
                top1=float((exact.argmax(-1) == other.argmax(-1)).float().mean()), rows=exact.shape[0])


def run_deviation(args, env: Env) -> None:
    if not args.checkpoint:
        raise SystemExit("error: deviation needs --checkpoint RUN_DIR (a trained model; a random one says little)")
    m, where_ckpt = load_checkpoint(args.checkpoint, env.device, str(Path(args.data_path) / "tokenizer.json"))
    lengths = [int(x) for x in args.prompt_lens.split(",")]
    prompts, where = held_out_prompts(args.data_path, args.data_seed, lengths, args.prompts)
    G, W = args.continue_tokens, m.cfg.attention.window
    edges = [0] + [e for e in (W // 2, W, 2 * W, 4 * W, 8 * W) if e < G] + [G]
    print(f"bounded replay deviation, {where_ckpt} ({m.cfg.name}), {args.prompts} prompts per length {lengths} from "
          f"{where}; greedy continuation of {G} tokens by the exact path (replay none), teacher-forced into the "
          f"others; window {W} ({env.header()})")
    results = defaultdict(lambda: defaultdict(list))  # variant -> bucket -> [exact rows, other rows]
    with torch.no_grad():
        for n, ids in prompts.items():
            ids = ids.to(env.device)
            B = ids.shape[0]
            with env.autocast():
                full = m(ids)[:, :-1].float()
            nll = torch.nn.functional.cross_entropy(full.flatten(0, 1), ids[:, 1:].flatten())
            print(f"  prompts of {n} tokens: the model's next-token loss on them {float(nll):.3f} nats "
                  f"(uniform: {math.log(m.cfg.vocab_size):.3f}); logits' std over the vocabulary "
                  f"{float(full.std(-1).mean()):.2f}")
            runs = {}
            for v in ("none", "window", "halo"):
                cache = m.new_cache(B, n + G, replay=v)
                with env.autocast():
                    rows = [m(ids, cache=cache)[:, -1].float()]
                    feed = runs["none"][1] if v != "none" else None
                    toks = []
                    for g in range(G):
                        tok = rows[-1].argmax(-1, keepdim=True) if feed is None else feed[:, g:g + 1]
                        toks.append(tok)
                        rows.append(m(tok, cache=cache)[:, -1].float())
                runs[v] = (torch.stack(rows[:G + 1], 1), torch.cat(toks, 1))  # logits [B, G + 1, V]
            for v in ("window", "halo"):
                ex, ot = runs["none"][0], runs[v][0]
                buckets = [("last prompt row", 0, 1)] + [(f"continuation steps {a + 1}-{b}", a + 1, b + 1)
                                                         for a, b in zip(edges, edges[1:])]
                for label, a, b in buckets:
                    results[v][label].append((ex[:, a:b].flatten(0, 1), ot[:, a:b].flatten(0, 1)))
    print(f"  {'replay':7s} {'rows':36s} {'n':>5s} {'max |diff|':>11s} {'mean |diff|':>12s} {'mean KL':>10s} "
          f"{'max KL':>10s} {'top-1 agree':>12s}")
    for v, buckets in results.items():
        for label, pairs in buckets.items():
            c = compare(torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs]))
            print(f"  {v:7s} {label:36s} {c['rows']:5d} {c['max_abs']:11.3e} {c['mean_abs']:12.3e} "
                  f"{c['kl_mean']:10.3e} {c['kl_max']:10.3e} {c['top1']:12.3f}")
            env.emit("deviation", dict(checkpoint=str(where_ckpt), replay=v, rows_label=label, prompt_lens=lengths,
                                       prompts=args.prompts, **c))


# -- entry point ----------------------------------------------------------------------------------------------------
