"""Turn a text corpus into token-id shards: `python -m data.prepare`, or `prepare(...)` from Python.

Contract: `prepare` reads a corpus (default: the running interpreter's standard library; or a directory, a `.jsonl`
file or any file: one document each), trains the tokenizer or loads a given one, and writes the shards of
data/shards.py, deterministically (files in sorted order; non-UTF-8 files and blank documents skipped and counted).
It builds in a private directory and renames into place, meta.json last: a crash leaves the output as it was.
`prepare_once` adds the lock (`PrepareLock`) that lets every rank of every node call it at once on a shared
filesystem. `check_sources` refuses a corpus that cannot be read, naming it.

Design and reasoning: docs/data.md#preparing-a-corpus
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import socket
import sysconfig
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import islice
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

from data.schema import DataConfig
from data.shards import (
    META_NAME,
    TOKENIZER_NAME,
    DataConfigError,
    DataNotFoundError,
    ShardInfo,
    atomic_write,
    file_sha256,
    write_meta,
    write_shard,
)
from data.tokenizer import MIN_VOCAB_SIZE, SPECIAL_TOKENS, ids_dtype, load_tokenizer, tokenizer_info, train_tokenizer

_ENCODE_BATCH = 256  # documents per encode_batch call: enough to keep the tokenizer's thread pool busy
_EXCLUDED_STDLIB_DIRS = {"site-packages", "dist-packages"}  # third-party code installed under the stdlib dir
STDLIB_GLOB = "*.py"
"""what an empty glob means for the stdlib corpus; for a user directory it means every file"""
LOCK_NAME = ".prepare.lock"
_WORK_PREFIX = ".prepare-"  # private build directories inside the output, one per preparing process
STALE_AFTER_S = 120.0
"""a preparer's lock or build directory whose heartbeat (mtime) is older than this belongs to a dead process.
Well above the 10 s heartbeat plus NFS attribute caching (acregmax 60 s by default), so a live one is never taken."""


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def resolve_glob(glob: str, default_corpus: bool) -> str:
    """The file pattern applied inside a corpus directory: `glob`, or for "" the stdlib's `*.py` / every file."""
    return glob or (STDLIB_GLOB if default_corpus else "*")


def load_given_tokenizer(path: str) -> Tokenizer:
    """The tokenizer.json named by data.tokenizer; one-line errors naming the key."""
    if not os.path.exists(path):
        raise DataNotFoundError(f"data.tokenizer={path!r} does not exist")
    if not os.path.isfile(path):
        raise DataConfigError(f"data.tokenizer={path!r} is not a file")
    try:
        return load_tokenizer(path)
    except (OSError, ValueError) as exc:
        cause = " ".join(str(exc.__cause__ or exc).split())  # the Rust message may span lines
        raise DataConfigError(f"data.tokenizer={path!r} cannot be loaded as a tokenizer.json: {cause}") from None


def tokenizer_file_sha256(path: str) -> str:
    """sha256 of the file named by data.tokenizer; one-line errors naming the key."""
    if not os.path.exists(path):
        raise DataNotFoundError(f"data.tokenizer={path!r} does not exist")
    try:
        return file_sha256(path)
    except OSError as exc:
        raise DataConfigError(f"data.tokenizer={path!r} cannot be read ({exc.strerror or exc})") from None


def check_sources(corpus: str, tokenizer: str) -> None:
    """Fail on a missing data.corpus or an unusable data.tokenizer before anything is created or locked."""
    if corpus and not os.path.exists(corpus):
        raise DataNotFoundError(f"data.corpus={os.path.abspath(corpus)!r} does not exist")
    if tokenizer:
        load_given_tokenizer(tokenizer)


class Corpus:
    """The documents of a corpus source with the caps applied, readable more than once; counts what it skipped."""

    def __init__(self, source: str = "", glob: str = "", max_files: int = 0, max_bytes: int = 0):
        self.source = os.path.abspath(source) if source else stdlib_dir()
        self.glob = resolve_glob(glob, default_corpus=not source)  # the pattern applied, as meta.json records it
        self.max_files, self.max_bytes = max_files, max_bytes
        self.num_docs = self.num_skipped = 0
        self.truncated = False
        if not os.path.exists(self.source):
            raise DataNotFoundError(f"data.corpus={self.source!r} does not exist")
        if os.path.isdir(self.source):
            if os.path.isabs(self.glob):
                raise DataConfigError(f"data.corpus_glob={glob!r} must be relative to data.corpus, e.g. '*.txt'")
            self.files = self._capped_files()
            if not self.files and glob:
                raise DataConfigError(
                    f"data.corpus_glob={glob!r} matches no file under data.corpus={self.source!r} "
                    "(data.corpus_glob='' takes every file)"
                )
            if not self.files:
                raise DataConfigError(f"data.corpus={self.source!r} is empty: it holds no file (hidden ones skipped)")
        else:
            self.files = [self.source]

    def _capped_files(self) -> list[str]:
        root = Path(self.source)
        exclude = _EXCLUDED_STDLIB_DIRS if self.source == stdlib_dir() else set()

        def wanted(rel: tuple[str, ...]) -> bool:
            return not exclude.intersection(rel) and not any(part.startswith(".") for part in rel)

        rel = sorted(
            p.relative_to(root).as_posix()
            for p in root.rglob(self.glob)
            if wanted(p.relative_to(root).parts) and p.is_file()
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

    def _open(self, path: str):
        try:
            return open(path, "rb")
        except OSError as exc:
            raise DataConfigError(f"data.corpus={self.source!r}: cannot read {path} ({exc.strerror or exc})") from None

    def _raw(self) -> Iterator[bytes | str]:
        if not self._is_jsonl():
            for path in self.files:
                with self._open(path) as f:
                    yield f.read()
            return
        count = size = 0
        with self._open(self.source) as f:
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


def _write_tokenizer(out: str, tokenizer: str, tok: Tokenizer) -> str:
    """Put the tokenizer (a copy of the file `tokenizer`, or the trained `tok`) into `out`; returns its path there."""
    dst = os.path.join(out, TOKENIZER_NAME)
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
            try:
                os.remove(os.path.join(out, name))
            except FileNotFoundError:  # a concurrent preparer removed it first
                pass


def _make_dir(out: str) -> None:
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as exc:
        raise DataConfigError(f"data.path={out!r} cannot be created ({exc.strerror or exc})") from None


class _Heartbeat:
    """Refreshes the mtime of `paths` every `interval_s` from a daemon thread while the `with` block runs, so other
    processes can tell a live preparer (tokenizer training can take minutes without writing a file) from a dead one."""

    def __init__(self, paths: list[str], interval_s: float):
        self._paths, self._interval_s = paths, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prepare-heartbeat", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            for path in self._paths:
                try:
                    os.utime(path)
                except OSError:  # taken over or removed: the preparer's own next step decides what that means
                    pass

    def __enter__(self) -> _Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _process_tag() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


@contextmanager
def _work_dir(out: str, stale_after_s: float) -> Iterator[str]:
    """A private build directory inside `out` (same filesystem, so publishing is a rename), removed afterwards."""
    # Build directories of preparers that died (SIGKILL, a lost node): their heartbeat stopped.
    for name in os.listdir(out):
        if name.startswith(_WORK_PREFIX):
            try:
                if time.time() - os.stat(os.path.join(out, name)).st_mtime > stale_after_s:
                    shutil.rmtree(os.path.join(out, name), ignore_errors=True)
            except FileNotFoundError:
                pass
    work = os.path.join(out, _WORK_PREFIX + _process_tag())
    os.mkdir(work)
    try:
        with _Heartbeat([work], stale_after_s / 12):
            yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _publish(work: str, out: str, shard_names: list[str]) -> None:
    """Move a finished build from `work` into `out`; meta.json goes first and comes back last, so in between `out`
    reads as unprepared, never as a mix of two preparations. A concurrent publisher moves identical bytes."""
    try:
        os.remove(os.path.join(out, META_NAME))
    except FileNotFoundError:
        pass
    for name in (TOKENIZER_NAME, *shard_names):
        os.replace(os.path.join(work, name), os.path.join(out, name))
    _remove_stale_shards(out, set(shard_names))
    os.replace(os.path.join(work, META_NAME), os.path.join(out, META_NAME))


def prepare(
    out: str,
    corpus: str = "",
    *,
    tokenizer: str = "",
    vocab_size: int = 4096,
    glob: str = "",
    max_files: int = 0,
    max_bytes: int = 0,
    shard_size: int = 1 << 17,
    progress: bool = True,
    stale_after_s: float = STALE_AFTER_S,
) -> dict:
    """Tokenize `corpus` ("" = stdlib) into shards under `out`; returns the meta.json contents.

    tokenizer: an existing tokenizer.json to use as is ("" = train a byte-level BPE of `vocab_size`).
    glob: files taken from a corpus directory ("" = `*.py` for the stdlib, every file otherwise).
    shard_size: bytes of token ids per shard; a shard closes once it reaches this (documents are never split).
    max_files / max_bytes: stop reading the corpus after this many documents / bytes (0 = no cap).
    Errors name the data.* key at fault (the CLI options mirror them).
    """
    if shard_size <= 0:
        raise DataConfigError(f"data.shard_size must be > 0, got {shard_size}")
    docs = Corpus(corpus, glob, max_files, max_bytes)
    if tokenizer:
        tok = load_given_tokenizer(tokenizer)
    elif vocab_size < MIN_VOCAB_SIZE:
        raise DataConfigError(f"data.vocab_size must be >= {MIN_VOCAB_SIZE}, got {vocab_size}")
    empty = f"data.corpus={docs.source!r} is empty: no non-blank UTF-8 document"
    _make_dir(out)
    with _work_dir(out, stale_after_s) as work:
        if not tokenizer:
            tok = train_tokenizer(docs.texts("train tokenizer", progress), vocab_size)
            if not docs.num_docs:
                raise DataConfigError(f"{empty} ({docs.num_skipped} skipped)")
        tok_path = _write_tokenizer(work, tokenizer, tok)
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
                    shards.append(write_shard(work, len(shards), pending, num_docs, dtype))
                    num_docs += len(pending)
                    pending, pending_bytes = [], 0
        if pending:
            shards.append(write_shard(work, len(shards), pending, num_docs, dtype))
            num_docs += len(pending)
        if not num_docs:
            raise DataConfigError(f"{empty} ({docs.num_skipped} skipped)")

        # Nothing here may depend on `out` or on the process: concurrent preparers must publish the same bytes.
        meta = {
            "ids_dtype": dtype,
            "vocab_size": info.vocab_size,
            "special_ids": {"bos": info.bos_id, "eos": info.eos_id, "pad": info.pad_id},
            "num_documents": num_docs,
            "num_tokens": sum(s.num_tokens for s in shards),
            "tokenizer": TOKENIZER_NAME,
            "tokenizer_sha256": file_sha256(tok_path),
            "tokenizer_source": os.path.abspath(tokenizer) if tokenizer else f"trained (byte-level BPE, {vocab_size})",
            # The special tokens a trained BPE reserved (ids 0, 1, ...); a later build that reserves others refuses
            # these shards (data/config.py). null with a given tokenizer, which its sha256 pins.
            "special_tokens": None if tokenizer else list(SPECIAL_TOKENS),
            "source": docs.source,
            "glob": docs.glob if os.path.isdir(docs.source) else None,
            "files_skipped": docs.num_skipped,
            "truncated_by_cap": docs.truncated,
            # What was asked for, in data.* terms: data/config.py compares it with the config that uses the shards.
            "requested": {
                "corpus": corpus,
                "corpus_glob": glob,
                "tokenizer": tokenizer,
                "vocab_size": None if tokenizer else vocab_size,
                "max_files": max_files,
                "max_bytes": max_bytes,
                "shard_size": shard_size,
            },
        }
        write_meta(work, meta, shards)
        _publish(work, out, [s.name for s in shards])
    return {**meta, "num_shards": len(shards)}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class PrepareLock:
    """The right to prepare one directory, held by one process among all that share its filesystem.

    flock is unreliable on NFS and Lustre, so the lock is a file created with O_CREAT | O_EXCL (atomic there too)
    that holds the holder's host, pid and start time, and whose mtime a thread refreshes while it is held (the
    heartbeat). A lock whose heartbeat is older than `stale_after_s`, or whose holder on this host is no longer
    running, was left by a dead preparer and is taken over. Correctness does not rest on the lock: preparation
    builds privately and publishes identical bytes, so two holders at once (two waiters taking over the same stale
    lock, a badly skewed clock) only cost duplicated work.
    """

    def __init__(self, directory: str, stale_after_s: float = STALE_AFTER_S):
        self.path = os.path.join(directory, LOCK_NAME)
        self.stale_after_s = stale_after_s
        self.token = _process_tag()
        self._heartbeat: _Heartbeat | None = None

    def acquire(self) -> bool:
        """Take the lock if nobody holds it; False otherwise (never blocks)."""
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump({"host": socket.gethostname(), "pid": os.getpid(), "time": time.time(), "token": self.token}, f)
            f.flush()
            os.fsync(f.fileno())
        self._heartbeat = _Heartbeat([self.path], self.stale_after_s / 12).__enter__()
        return True

    def release(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.__exit__()
            self._heartbeat = None
        holder = self.holder()
        if holder is not None and holder[0].get("token") == self.token:  # not a lock that replaced a taken-over one
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass

    def holder(self) -> tuple[dict, float] | None:
        """(what the lock file says, its mtime), or None when there is no lock. The file may be momentarily empty
        (just created, not yet written): then the dict is empty and only the mtime speaks."""
        try:
            mtime = os.stat(self.path).st_mtime
            with open(self.path) as f:
                text = f.read()
        except FileNotFoundError:
            return None
        try:
            info = json.loads(text)
        except ValueError:
            info = {}
        return (info if isinstance(info, dict) else {}), mtime

    def _stale(self, info: dict, mtime: float) -> bool:
        pid = info.get("pid")
        if info.get("host") == socket.gethostname() and isinstance(pid, int) and pid != os.getpid():
            if not _pid_alive(pid):
                return True
        return time.time() - mtime > self.stale_after_s

    def take_over_if_stale(self) -> bool:
        """Remove a dead preparer's lock; True when the lock is gone (so acquiring may now succeed)."""
        holder = self.holder()
        if holder is None:
            return True
        info, mtime = holder
        if not self._stale(info, mtime):
            return False
        again = self.holder()
        if again is not None and again[0].get("token") != info.get("token"):  # replaced meanwhile: look again
            return True
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass
        return True

    def describe(self) -> str:
        holder = self.holder()
        if holder is None:
            return "no process"
        info, mtime = holder
        who = f"host {info.get('host', '?')} pid {info.get('pid', '?')}" if info else "an unknown process"
        return f"{who} (heartbeat {time.time() - mtime:.0f} s ago, lock file {self.path})"


def prepare_once(
    out: str, build: Callable[[], object], *, timeout_s: float = 3600.0, stale_after_s: float = STALE_AFTER_S
) -> bool:
    """Run `build()` (which publishes `out`/meta.json) unless `out` holds meta.json already; True if this call ran it.

    Every rank of every node may call this at once on one directory of a shared filesystem: the PrepareLock holder
    builds while the others poll for meta.json. A holder that fails releases the lock, so the next caller tries (and
    reports the same error); a dead one's lock is taken over. Waiting longer than `timeout_s` raises DataConfigError.
    """
    meta_path = os.path.join(out, META_NAME)
    if os.path.isfile(meta_path):
        return False
    _make_dir(out)
    lock = PrepareLock(out, stale_after_s)
    deadline = time.monotonic() + timeout_s
    poll_s = 0.05  # doubling to 2 s: prompt when the preparation is quick, light on a metadata server when it is not
    while not os.path.isfile(meta_path):
        if lock.acquire():
            try:
                if os.path.isfile(meta_path):  # published between our last look and the lock
                    return False
                build()
                return True
            finally:
                lock.release()
        if lock.take_over_if_stale():
            continue
        left = deadline - time.monotonic()
        if left <= 0:
            raise DataConfigError(
                f"data.path={out!r} is still being prepared by {lock.describe()} after {timeout_s:g} s of waiting; "
                "raise data.prepare_timeout_s, or delete the lock file if that process is gone"
            )
        time.sleep(min(poll_s, left))
        poll_s = min(2 * poll_s, 2.0)
    return False


def main(argv: list[str] | None = None) -> None:
    d = DataConfig()  # the CLI's defaults are the config's, so prepare_command can leave them out
    p = argparse.ArgumentParser(prog="python -m data.prepare", description=__doc__.split("\n")[0])
    p.add_argument("--corpus", default=d.corpus, help="directory, .jsonl or text file ('' = Python stdlib)")
    p.add_argument("--out", default=d.path, help="output directory (default: %(default)s)")
    p.add_argument("--tokenizer", default=d.tokenizer, help="existing tokenizer.json ('' = train one)")
    p.add_argument("--vocab-size", type=int, default=d.vocab_size)
    p.add_argument("--glob", default=d.corpus_glob,
                   help=f"file pattern inside a corpus directory ('' = {STDLIB_GLOB} for the stdlib, every file "
                        "for a directory of yours)")
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
