"""Turn a text corpus into token-id shards: `python -m data.prepare`, or `prepare(...)` from Python.

Corpus sources (one document each):
- "" (default): the Python standard library of the running interpreter (`sysconfig` "stdlib"), every file
  matching the glob (default `*.py`), site-/dist-packages excluded. Real text on every machine, nothing
  downloaded; the caps (max_files / max_bytes) keep `make train`'s preparation to a few seconds.
- a directory: every file under it matching the glob, recursively;
- a `.jsonl` file: the "text" field of every line;
- any other file: the whole file.
Files are taken in sorted (relative POSIX path) order and shards are deterministic, so the same corpus gives
the same bytes. Files that are not UTF-8, and blank documents, are skipped and counted in meta.json.

Two passes over the corpus (train the tokenizer, then encode), so memory stays flat on large corpora.
See data/shards.py for the shard format and data/tokenizer.py for the special-token ids.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sysconfig
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

import numpy as np
from tqdm import tqdm

from data.shards import META_NAME, TOKENIZER_NAME, ShardInfo, atomic_write, file_sha256, write_meta, write_shard
from data.tokenizer import MIN_VOCAB_SIZE, ids_dtype, load_tokenizer, tokenizer_info, train_tokenizer

_ENCODE_BATCH = 256  # documents per encode_batch call: enough to keep the tokenizer's thread pool busy
_EXCLUDED_STDLIB_DIRS = {"site-packages", "dist-packages"}  # third-party code installed under the stdlib dir


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


class Corpus:
    """The documents of a corpus source with the caps applied, readable more than once; counts what it skipped."""

    def __init__(self, source: str = "", glob: str = "*.py", max_files: int = 0, max_bytes: int = 0):
        self.source = os.path.abspath(source) if source else stdlib_dir()
        self.glob = glob
        self.max_files, self.max_bytes = max_files, max_bytes
        self.num_docs = self.num_skipped = 0
        self.truncated = False
        if not os.path.exists(self.source):
            raise FileNotFoundError(f"corpus path {self.source!r} does not exist")
        if os.path.isdir(self.source):
            self.files = self._capped_files()
            if not self.files:
                raise ValueError(f"corpus {self.source!r} is empty: no file matches {glob!r}")
        else:
            self.files = [self.source]

    def _capped_files(self) -> list[str]:
        root = Path(self.source)
        exclude = _EXCLUDED_STDLIB_DIRS if self.source == stdlib_dir() else set()
        rel = sorted(
            p.relative_to(root).as_posix()
            for p in root.rglob(self.glob)
            if p.is_file() and not exclude.intersection(p.relative_to(root).parts)
        )
        # Caps are resolved on file sizes up front so both passes (and the progress bar) see the same list.
        files, total = [], 0
        for r in rel:
            if (self.max_files and len(files) >= self.max_files) or (self.max_bytes and total >= self.max_bytes):
                self.truncated = True
                break
            files.append(os.path.join(self.source, r))
            total += os.path.getsize(files[-1])
        return files

    @property
    def size_hint(self) -> int | None:
        """documents before skipping (progress-bar total); unknown for .jsonl"""
        return None if self._is_jsonl() else len(self.files)

    def _is_jsonl(self) -> bool:
        return not os.path.isdir(self.source) and self.source.endswith(".jsonl")

    def _raw(self) -> Iterator[bytes | str]:
        if not self._is_jsonl():
            for path in self.files:
                with open(path, "rb") as f:
                    yield f.read()
            return
        count = size = 0
        with open(self.source, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if (self.max_files and count >= self.max_files) or (self.max_bytes and size >= self.max_bytes):
                    self.truncated = True
                    return
                count, size = count + 1, size + len(line)
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    text = record["text"]
                except (ValueError, KeyError, TypeError) as exc:
                    raise ValueError(f"{self.source}:{lineno}: not a JSON object with a 'text' field ({exc})") from None
                yield text if isinstance(text, str) else ""

    def texts(self, desc: str = "", progress: bool = False) -> Iterator[str]:
        """The documents; the progress bar counts every file or line read, skipped ones included."""
        self.num_docs = self.num_skipped = 0
        for raw in tqdm(self._raw(), total=self.size_hint, desc=desc, unit="doc", disable=not progress):
            try:
                text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
            except UnicodeDecodeError:
                text = ""
            if not text.strip():
                self.num_skipped += 1
                continue
            self.num_docs += 1
            yield text


def _write_tokenizer(out: str, tokenizer: str, tok) -> str:
    """Put the tokenizer next to the shards; returns its path there."""
    dst = os.path.join(out, TOKENIZER_NAME)
    if tokenizer and os.path.abspath(tokenizer) == os.path.abspath(dst):
        return dst
    if tokenizer:
        with open(tokenizer, "rb") as f:
            atomic_write(dst, f.read())
    else:
        atomic_write(dst, tok.to_str().encode())
    return dst


def _remove_stale_shards(out: str, keep: set[str]) -> None:
    # Leftovers of an earlier, larger preparation: harmless (meta.json lists the live shards) but confusing.
    for name in os.listdir(out):
        if re.fullmatch(r"shard-\d{6}\.tar", name) and name not in keep:
            os.remove(os.path.join(out, name))


def prepare(
    out: str,
    corpus: str = "",
    *,
    tokenizer: str = "",
    vocab_size: int = 4096,
    glob: str = "*.py",
    max_files: int = 0,
    max_bytes: int = 0,
    shard_size: int = 1 << 17,
    progress: bool = True,
) -> dict:
    """Tokenize `corpus` ("" = stdlib) into shards under `out`; returns the meta.json contents.

    tokenizer: an existing tokenizer.json to use as is ("" = train a byte-level BPE of `vocab_size`).
    shard_size: bytes of token ids per shard; a shard closes once it reaches this (documents are never split).
    max_files / max_bytes: stop reading the corpus after this many documents / bytes (0 = no cap).
    """
    if shard_size <= 0:
        raise ValueError(f"shard_size must be > 0, got {shard_size}")
    docs = Corpus(corpus, glob, max_files, max_bytes)
    os.makedirs(out, exist_ok=True)
    # Without meta.json the directory reads as unprepared, so a crash below cannot leave it looking valid.
    if os.path.exists(os.path.join(out, META_NAME)):
        os.remove(os.path.join(out, META_NAME))

    if tokenizer:
        tok = load_tokenizer(tokenizer)
    else:
        if vocab_size < MIN_VOCAB_SIZE:
            raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE}, got {vocab_size}")
        tok = train_tokenizer(docs.texts("train tokenizer", progress), vocab_size)
        if not docs.num_docs:
            raise ValueError(f"corpus {docs.source!r} is empty: no non-blank UTF-8 document")
    tok_path = _write_tokenizer(out, tokenizer, tok)
    info = tokenizer_info(tok, tok_path)
    dtype = ids_dtype(info.vocab_size)

    shards: list[ShardInfo] = []
    pending: list[np.ndarray] = []
    pending_bytes = num_docs = 0
    texts = docs.texts(f"tokenize -> {out}", progress)
    while batch := list(islice(texts, _ENCODE_BATCH)):
        # add_special_tokens=False: a loaded tokenizer's post-processor must not add <bos>/<eos> here;
        # the packer inserts the separators itself.
        for enc in tok.encode_batch(batch, add_special_tokens=False):
            pending.append(np.asarray(enc.ids, dtype=dtype))
            pending_bytes += pending[-1].nbytes
            if pending_bytes >= shard_size:
                shards.append(write_shard(out, len(shards), pending, num_docs, dtype))
                num_docs += len(pending)
                pending, pending_bytes = [], 0
    if pending:
        shards.append(write_shard(out, len(shards), pending, num_docs, dtype))
        num_docs += len(pending)
    if not num_docs:
        raise ValueError(f"corpus {docs.source!r} is empty: no non-blank UTF-8 document")
    _remove_stale_shards(out, {s.name for s in shards})

    meta = {
        "ids_dtype": dtype,
        "vocab_size": info.vocab_size,
        "special_ids": {"bos": info.bos_id, "eos": info.eos_id, "pad": info.pad_id},
        "num_documents": num_docs,
        "num_tokens": sum(s.num_tokens for s in shards),
        "tokenizer": TOKENIZER_NAME,
        "tokenizer_sha256": file_sha256(tok_path),
        "tokenizer_source": os.path.abspath(tokenizer) if tokenizer else f"trained (byte-level BPE, {vocab_size})",
        "source": docs.source,
        "glob": docs.glob if os.path.isdir(docs.source) else None,
        "files_skipped": docs.num_skipped,
        "truncated_by_cap": docs.truncated,
    }
    write_meta(out, meta, shards)
    return {**meta, "num_shards": len(shards)}


def main(argv: list[str] | None = None) -> None:
    from data.config import DataConfig  # imported here: data.config imports this module

    d = DataConfig()
    p = argparse.ArgumentParser(prog="python -m data.prepare", description=__doc__.split("\n")[0])
    p.add_argument("--corpus", default=d.corpus, help="directory, .jsonl or text file ('' = Python stdlib)")
    p.add_argument("--out", default=d.path, help="output directory (default: %(default)s)")
    p.add_argument("--tokenizer", default=d.tokenizer, help="existing tokenizer.json ('' = train one)")
    p.add_argument("--vocab-size", type=int, default=d.vocab_size)
    p.add_argument("--glob", default=d.corpus_glob, help="file pattern inside a corpus directory")
    p.add_argument("--max-files", type=int, default=None,
                   help=f"document cap (default: {d.max_files} for the stdlib corpus, none otherwise; 0 = none)")
    p.add_argument("--max-bytes", type=int, default=None,
                   help=f"byte cap (default: {d.max_bytes} for the stdlib corpus, none otherwise; 0 = none)")
    p.add_argument("--shard-size", type=int, default=d.shard_size, help="bytes of token ids per shard")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    stdlib = not a.corpus
    try:
        meta = prepare(
            a.out, a.corpus, tokenizer=a.tokenizer, vocab_size=a.vocab_size, glob=a.glob,
            max_files=a.max_files if a.max_files is not None else (d.max_files if stdlib else 0),
            max_bytes=a.max_bytes if a.max_bytes is not None else (d.max_bytes if stdlib else 0),
            shard_size=a.shard_size, progress=not a.no_progress,
        )
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"data.prepare: error: {exc}") from None
    print(
        f"data.prepare: {meta['num_documents']} documents, {meta['num_tokens']} tokens, {meta['num_shards']} shards, "
        f"vocab {meta['vocab_size']} -> {os.path.abspath(a.out)}"
    )


if __name__ == "__main__":
    main()
