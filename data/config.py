"""Typed data configuration (the schema of the `data` config group) and the two entry points the trainer calls.

`ensure_prepared(cfg)` makes sure shards exist (preparing the configured corpus when allowed);
`build_dataloader(cfg, rank, world_size)` returns the packed loader and what the model needs to know about the
tokenizer. Everything else about data lives in data/prepare.py (writing) and data/loader.py (reading).
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass

from data.prepare import prepare
from data.shards import META_NAME, file_sha256, read_meta
from data.tokenizer import MIN_VOCAB_SIZE, TokenizerInfo, load_tokenizer, tokenizer_info


@dataclass
class DataConfig:
    path: str = ".data/stdlib"
    """directory of prepared shards (meta.json, tokenizer.json, shard-*.tar); relative to the launch directory"""
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
    """an existing tokenizer.json: prepare encodes with it instead of training one, and the loader checks the
    shards were made with it; "" = the tokenizer.json next to the shards"""
    vocab_size: int = 4096
    """size of the byte-level BPE trained by prepare (the v41_tiny model's vocabulary)"""
    corpus: str = ""
    """source to prepare: a directory, a .jsonl file ("text" field) or a text file; "" = the Python stdlib"""
    corpus_glob: str = "*.py"
    """files taken from a corpus directory (the stdlib corpus is Python source)"""
    max_files: int = 0
    """cap on documents read from the default (stdlib) corpus; 0 = no cap. A user corpus is never capped."""
    max_bytes: int = 8_000_000
    """cap on bytes read from the default corpus: ~700 files, ~2.4M tokens, prepared in a few seconds on 2 cores"""
    shard_size: int = 1 << 17
    """bytes of token ids per shard. 128 KiB cuts the capped stdlib corpus into ~35 shards, enough for 8 ranks x 4
    workers (the loader needs a shard per reader); raise it for real corpora (webdataset favours 100 MB+)."""
    auto_prepare: bool = True
    """prepare `corpus` into `path` when `path` holds no prepared data, instead of failing"""

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch_size", "shuffle_buffer", "shard_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"data.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("num_workers", "seed", "max_files", "max_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"data.{name} must be >= 0, got {getattr(self, name)!r}")
        if self.vocab_size < MIN_VOCAB_SIZE:
            raise ValueError(
                f"data.vocab_size must be >= {MIN_VOCAB_SIZE} (256 bytes + <bos>, <eos>, <pad>), got {self.vocab_size}"
            )
        if not self.path:
            raise ValueError("data.path must be a directory, got ''")
        if not self.corpus_glob:
            raise ValueError("data.corpus_glob must be a file pattern such as '*.py', got ''")


def ensure_prepared(cfg: DataConfig, progress: bool = True) -> str:
    """Make sure `cfg.path` holds prepared shards; returns the path.

    Without them: prepares `cfg.corpus` when `cfg.auto_prepare`, else raises FileNotFoundError naming the path
    and the command to run. Safe to call from every rank of a node at once: an exclusive lock lets one process
    prepare while the others wait and then find meta.json.
    """
    if os.path.isfile(os.path.join(cfg.path, META_NAME)):
        return cfg.path
    if not cfg.auto_prepare:
        read_meta(cfg.path)  # raises the FileNotFoundError with the suggestion
    os.makedirs(cfg.path, exist_ok=True)
    with open(os.path.join(cfg.path, ".prepare.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isfile(os.path.join(cfg.path, META_NAME)):
            default = not cfg.corpus
            prepare(
                cfg.path, cfg.corpus, tokenizer=cfg.tokenizer, vocab_size=cfg.vocab_size, glob=cfg.corpus_glob,
                max_files=cfg.max_files if default else 0, max_bytes=cfg.max_bytes if default else 0,
                shard_size=cfg.shard_size, progress=progress,
            )
    return cfg.path


def build_dataloader(cfg: DataConfig, rank: int = 0, world_size: int = 1):
    """(PackedLoader, TokenizerInfo) for data-parallel `rank` of `world_size` over the shards at `cfg.path`.

    Peers that must see the same batches (tensor / pipeline parallel) pass the same rank.
    """
    # Imported here so `python -m data.prepare` (which reads DataConfig's defaults) does not pay for torch.
    import torch

    from data.loader import PackedLoader

    meta, _ = read_meta(cfg.path)
    tok_path = cfg.tokenizer or os.path.join(cfg.path, meta["tokenizer"])
    if file_sha256(tok_path) != meta["tokenizer_sha256"]:
        raise ValueError(
            f"data.tokenizer {tok_path!r} is not the tokenizer the shards in {cfg.path!r} were made with; "
            "re-run `python -m data.prepare` with it, or leave data.tokenizer empty"
        )
    info: TokenizerInfo = tokenizer_info(load_tokenizer(tok_path), tok_path)
    loader = PackedLoader(
        cfg.path, seq_len=cfg.seq_len, batch_size=cfg.batch_size, eos_id=info.eos_id, num_workers=cfg.num_workers,
        seed=cfg.seed, shuffle=cfg.shuffle, shuffle_buffer=cfg.shuffle_buffer, rank=rank, world_size=world_size,
        pin_memory=torch.cuda.is_available(),
    )
    return loader, info
