"""Data-loader throughput (tokens/s) on the prepared default corpus: `python bench/data_throughput.py`.

Prepares the stdlib corpus at data.path first if needed (as the trainer does), then times the loader alone,
steady state (the first batch, which pays for worker start-up, is excluded), and prints one line.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data.config import DataConfig, build_dataloader, ensure_prepared  # noqa: E402


def main() -> None:
    d = DataConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--path", default=d.path)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--num-workers", type=int, default=d.num_workers)
    p.add_argument("--seconds", type=float, default=5.0)
    a = p.parse_args()
    cfg = DataConfig(path=a.path, seq_len=a.seq_len, batch_size=a.batch_size, num_workers=a.num_workers)
    ensure_prepared(cfg)
    loader, _ = build_dataloader(cfg)
    batches = iter(loader)
    next(batches)
    tokens, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < a.seconds:
        tokens += next(batches)["input_ids"].numel()
    corpus_tokens = loader.meta["num_tokens"]
    print(
        f"data_throughput: {tokens / elapsed / 1e6:.1f}M tokens/s (seq_len {a.seq_len}, batch {a.batch_size}, "
        f"workers {a.num_workers}, {tokens / corpus_tokens:.1f} epochs of {corpus_tokens / 1e6:.2f}M tokens "
        f"in {elapsed:.1f} s, {os.cpu_count()} CPUs)"
    )


if __name__ == "__main__":
    main()
