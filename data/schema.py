"""The schema of the `data` config group: `DataConfig`, its defaults and its field checks.

Its own module so that data/prepare.py (whose CLI defaults are DataConfig's) and data/config.py (the entry points
the trainer calls, which prepare through data/prepare.py) both import it at the top without an import cycle.
Import it from data.config, as every caller does. No torch here: `python -m data.prepare --help` stays fast.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from config_checks import at_least, positive
from data.tokenizer import MIN_VOCAB_SIZE


@dataclass
class DataConfig:
    path: str = ".data/stdlib"
    """directory of prepared shards (meta.json, tokenizer.json, shard-*.tar); relative to the launch directory.
    Shards there must have been prepared from this config's corpus, corpus_glob, tokenizer / vocab_size and
    (stdlib corpus) caps: anything else is refused at start-up, naming both sides. Use a new path per corpus."""
    seq_len: int = 128
    """tokens per row T; each row reads T + 1 tokens so labels are inputs shifted by one"""
    batch_size: int = 8
    """rows per micro-batch on each data-parallel rank"""
    num_workers: int = 0
    """DataLoader worker processes per rank (0 = read in the trainer's process). Reading pre-tokenised ids is
    cheap next to a training step, and on a 2-core machine workers would only compete with the model."""
    seed: int = 0
    """seeds the per-epoch shard permutation and the buffer shuffle"""
    shuffle: bool = True
    """false: shards and documents in prepared order (for debugging and tests)"""
    shuffle_buffer: int = 64
    """documents permuted together after shard shuffling (a chunk is re-read on resume, so keep it modest)"""
    tokenizer: str = ""
    """an existing tokenizer.json: prepare encodes with it instead of training one, and the shards must have been
    made with it (same sha256; the copy in data.path counts); "" = prepare trains a BPE of vocab_size, and the
    loader reads the tokenizer.json next to the shards"""
    vocab_size: int = 4096
    """size of the byte-level BPE trained by prepare (the v41_tiny model's vocabulary); only meaningful with
    data.tokenizer empty"""
    corpus: str = ""
    """source to prepare: a directory, a .jsonl file ("text" field) or a text file; "" = the Python stdlib"""
    corpus_glob: str = ""
    """files taken from a corpus directory, recursively (names starting with "." never): "" = `*.py` for the
    stdlib corpus and every file for a directory of yours; ignored for a single-file corpus. An explicit pattern
    that matches nothing is an error."""
    max_files: int = 0
    """cap on documents read from the default (stdlib) corpus; 0 = no cap. A user corpus is never capped."""
    max_bytes: int = 8_000_000
    """cap on bytes read from the default corpus: ~700 files, ~2.4M tokens, prepared in a few seconds on 2 cores"""
    shard_size: int = 1 << 17
    """bytes of token ids per shard. 128 KiB cuts the capped stdlib corpus into ~35 shards, enough for 8 ranks x 4
    workers (the loader needs a shard per reader); raise it for real corpora (webdataset favours 100 MB+).
    Used when preparing only: shards of another size hold the same ids, so they are used as they are."""
    auto_prepare: bool = True
    """prepare `corpus` into `path` when `path` holds no prepared data, instead of failing"""
    prepare_timeout_s: float = 3600.0
    """seconds a process waits for another one (any node) to finish preparing `path` before giving up; a dead
    preparer's lock is taken over after ~2 minutes without heartbeat whatever this says"""

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch_size", "shuffle_buffer", "shard_size", "prepare_timeout_s"):
            positive(f"data.{name}", getattr(self, name))
        for name in ("num_workers", "seed", "max_files", "max_bytes"):
            at_least(f"data.{name}", getattr(self, name), 0)
        if self.vocab_size < MIN_VOCAB_SIZE:
            raise ValueError(
                f"data.vocab_size must be >= {MIN_VOCAB_SIZE} (256 bytes + the special tokens), got {self.vocab_size}"
            )
        if not self.path:
            raise ValueError("data.path must be a directory, got ''")
        if os.path.isabs(self.corpus_glob):
            raise ValueError(f"data.corpus_glob must be a pattern relative to data.corpus, got {self.corpus_glob!r}")
