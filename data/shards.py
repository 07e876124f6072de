"""The on-disk format of prepared data: webdataset tar shards of token ids, plus `meta.json`.

Contract: a prepared directory holds `shard-NNNNNN.tar` (one sample per document: `<key>.ids`, its token ids as raw
little-endian uint16 or uint32, no header, no <eos>; a document never spans two shards), `tokenizer.json`, and
`meta.json`, written last (its presence marks a complete preparation): the format, ids dtype, vocabulary and special
ids, counts, provenance and one entry per shard with its sha256. `read_shard` / `read_verified` trust only the
shards meta.json lists, each checked against its sha256 before any tar parsing (`ShardError`). Every file is written
under a temporary name and renamed into place (`atomic_write`); the same corpus gives byte-identical shards.

Design and reasoning: docs/data.md#token-id-shards
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import socket
import tarfile
from dataclasses import asdict, dataclass

import numpy as np

FORMAT = "cedar-ids-v1"
META_NAME = "meta.json"
TOKENIZER_NAME = "tokenizer.json"
IDS_FIELD = "ids"


class ShardError(Exception):
    """A shard that cannot be read back exactly as it was written."""


class DataConfigError(ValueError):
    """A data.* setting that cannot work as given (shards prepared from something else, an unreadable file),
    as one line naming the key. A ValueError, so the trainer's entry point prints it as `error: ...` and exits 2."""


class DataNotFoundError(DataConfigError, FileNotFoundError):
    """A data.* path that does not exist. Also a FileNotFoundError, for callers that catch missing files."""


@dataclass(frozen=True)
class ShardInfo:
    name: str
    num_docs: int
    num_tokens: int
    sha256: str


def shard_name(index: int) -> str:
    return f"shard-{index:06d}.tar"


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def atomic_write(path: str, data: bytes) -> None:
    # Host and pid in the temporary name keep two processes (of one node or of several sharing a filesystem)
    # from writing the same temporary file.
    tmp = f"{path}.tmp-{socket.gethostname()}-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def encode_shard(docs: list[np.ndarray], first_key: int, dtype: str) -> bytes:
    """The tar bytes of one shard; document i gets key first_key + i."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i, doc in enumerate(docs):
            payload = np.ascontiguousarray(doc, dtype=dtype).tobytes()
            member = tarfile.TarInfo(f"{first_key + i:09d}.{IDS_FIELD}")
            member.size = len(payload)
            member.mode = 0o644
            member.mtime = 0
            tar.addfile(member, io.BytesIO(payload))
    return buf.getvalue()


def write_shard(directory: str, index: int, docs: list[np.ndarray], first_key: int, dtype: str) -> ShardInfo:
    data = encode_shard(docs, first_key, dtype)
    name = shard_name(index)
    atomic_write(os.path.join(directory, name), data)
    return ShardInfo(
        name=name,
        num_docs=len(docs),
        num_tokens=int(sum(len(d) for d in docs)),
        sha256=hashlib.sha256(data).hexdigest(),
    )


def read_verified(path: str, sha256: str) -> bytes:
    """A shard file's bytes, checked against the sha256 its meta.json records; ShardError if unreadable or corrupt."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ShardError(f"cannot read: {exc}") from exc
    if hashlib.sha256(data).hexdigest() != sha256:
        raise ShardError(f"checksum mismatch ({len(data)} bytes): corrupt or truncated")
    return data


def read_shard(path: str, info: ShardInfo, dtype: str) -> list[np.ndarray]:
    """The documents of one shard, in key order, as read-only arrays; ShardError if anything is off."""
    data = read_verified(path, info.sha256)
    docs = []
    itemsize = np.dtype(dtype).itemsize
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            for member in tar:
                # Other fields a future writer may add (e.g. `.txt`) are ignored, not an error.
                if not member.isfile() or not member.name.endswith(f".{IDS_FIELD}"):
                    continue
                if member.size % itemsize:
                    raise ShardError(f"member {member.name} has {member.size} bytes, not a multiple of {itemsize}")
                payload = tar.extractfile(member).read()
                docs.append(np.frombuffer(payload, dtype=dtype))
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise ShardError(f"bad tar: {exc}") from exc
    num_tokens = sum(len(d) for d in docs)
    if len(docs) != info.num_docs or num_tokens != info.num_tokens:
        raise ShardError(
            f"holds {len(docs)} documents / {num_tokens} tokens, meta.json says {info.num_docs} / {info.num_tokens}"
        )
    return docs


def write_meta(directory: str, meta: dict, shards: list[ShardInfo]) -> None:
    full = {"format": FORMAT, **meta, "num_shards": len(shards), "shards": [asdict(s) for s in shards]}
    atomic_write(os.path.join(directory, META_NAME), (json.dumps(full, indent=1) + "\n").encode())


def read_meta(directory: str, prepare_cmd: str = "") -> tuple[dict, list[ShardInfo]]:
    """meta.json of a prepared directory (`data.path`).

    DataNotFoundError naming data.path and how to prepare it (`prepare_cmd`, default a generic
    `python -m data.prepare` line) if it was never (fully) prepared; DataConfigError if meta.json is unreadable.
    """
    path = os.path.join(directory, META_NAME)
    if not os.path.isfile(path):
        what = (f"has no {META_NAME} (not prepared, or unfinished)" if os.path.exists(directory)
                else "does not exist")
        cmd = prepare_cmd or f"python -m data.prepare --corpus ... --out {directory}"
        raise DataNotFoundError(
            f"data.path={directory!r} {what}; prepare it with `{cmd}` or set data.auto_prepare=true"
        )
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as exc:
        raise DataConfigError(
            f"data.path={directory!r}: cannot read {META_NAME} ({exc}); re-run python -m data.prepare"
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise DataConfigError(
            f"data.path={directory!r}: {META_NAME} has format {found!r}, expected {FORMAT!r}; "
            "re-run python -m data.prepare"
        )
    shards = [ShardInfo(**s) for s in meta["shards"]]
    return meta, shards
