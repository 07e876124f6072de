"""Builders for the data tests: small synthetic text corpora and hand-made shard directories."""

from __future__ import annotations

import os
import random

import numpy as np

from data.shards import write_meta, write_shard

EOS = 1
MARK = 1000
"""synthetic documents start with MARK + their index, so a document is identified by its first token"""

_WORDS = ("alpha beta gamma delta shard token loader epoch rank worker pack window carry tensor batch "
          "def return class import self yield lambda None True False über naïve café 数据 λ").split()


def write_text_corpus(root, num_files: int = 14, seed: int = 0) -> list[str]:
    """Text files `doc_XX.txt` of pseudo-words (some non-ASCII); returns their texts in sorted-name order."""
    rng = random.Random(seed)
    os.makedirs(root, exist_ok=True)
    texts = []
    for i in range(num_files):
        lines = [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12))) for _ in range(rng.randint(1, 20))]
        text = "\n".join(lines) + "\n"
        with open(os.path.join(root, f"doc_{i:02d}.txt"), "w", encoding="utf-8") as f:
            f.write(text)
        texts.append(text)
    return texts


def synthetic_docs(sizes: list[int], seed: int = 0) -> list[np.ndarray]:
    """Documents of the given lengths: [MARK + index, random ids in [3, MARK)...]; never contain EOS."""
    rng = np.random.default_rng(seed)
    return [np.concatenate([[MARK + i], rng.integers(3, MARK, size=n - 1)]).astype(np.uint16)
            for i, n in enumerate(sizes)]


def write_synthetic_shards(root, docs_per_shard: list[int], seed: int = 0, long_every: int = 7):
    """A prepared directory written directly (no tokenizer); returns the documents per shard.

    Lengths are 1..30 tokens, with every `long_every`-th document 90 tokens long, longer than the test batches,
    so a batch can end inside a document with more than a batch still carried.
    """
    rng = np.random.default_rng(seed + 1)
    total = sum(docs_per_shard)
    sizes = [90 if i % long_every == long_every - 1 else int(rng.integers(1, 31)) for i in range(total)]
    docs = synthetic_docs(sizes, seed)
    os.makedirs(root, exist_ok=True)
    infos, per_shard, start = [], [], 0
    for s, n in enumerate(docs_per_shard):
        infos.append(write_shard(str(root), s, docs[start : start + n], start, "<u2"))
        per_shard.append(docs[start : start + n])
        start += n
    write_meta(str(root), {"ids_dtype": "<u2", "vocab_size": MARK + total, "num_documents": total,
                           "num_tokens": int(sum(sizes)), "tokenizer": "", "tokenizer_sha256": ""}, infos)
    return per_shard


def split_docs(stream: np.ndarray) -> list[np.ndarray]:
    """Complete documents of a packed stream (the tail after the last EOS is dropped)."""
    ends = np.flatnonzero(stream == EOS)
    return [stream[a + 1 : b] for a, b in zip(np.concatenate([[-1], ends[:-1]]), ends)]
