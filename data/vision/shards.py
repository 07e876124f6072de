"""The on-disk format of image-text data: webdataset tar shards of captioned images and interleaved documents, plus
`meta.json`; a reader that resumes from a saved (shard, offset).

Contract: a sample is a list of segments in reading order, each a text (str) or an image (PIL): a captioned image
([image, caption]: `<key>.png` + `<key>.txt`) or an interleaved document (`<key>.json` plus one `<key>.<i>.png` per
image). `write_image_text_shards` writes byte-identical shards for the same samples, `meta.json` last (its presence
marks a complete directory); `index_webdataset` writes the meta.json of an existing webdataset image-caption corpus.
`ImageTextReader` reads the shards meta.json lists, each checked against its sha256 (one that fails is skipped with
a warning), in order, once; `state_dict` / `load_state_dict` resume exactly after the last sample handed out, never
on other shards.

Design and reasoning: docs/data.md#image-text-shards
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass

from PIL import Image

from data.shards import (META_NAME, DataConfigError, DataNotFoundError, ShardError, atomic_write, read_verified,
                         shard_name)

FORMAT = "cedar-image-text-v1"
STATE_VERSION = 1

Segment = str | Image.Image


@dataclass(frozen=True)
class ImageShardInfo:
    name: str
    num_samples: int
    sha256: str


def _is_caption(segments: list[Segment]) -> bool:
    return len(segments) == 2 and isinstance(segments[0], Image.Image) and isinstance(segments[1], str)


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _members(key: str, segments: list[Segment]) -> list[tuple[str, bytes]]:
    """(member name, payload) of one sample."""
    if not segments:
        raise ValueError(f"sample {key} has no segment")
    if _is_caption(segments):
        return [(f"{key}.png", _png(segments[0])), (f"{key}.txt", segments[1].encode())]
    doc, images = [], []
    for seg in segments:
        if isinstance(seg, str):
            doc.append({"text": seg})
        elif isinstance(seg, Image.Image):
            field = f"{len(images)}.png"
            doc.append({"image": field})
            images.append((f"{key}.{field}", _png(seg)))
        else:
            raise TypeError(f"sample {key}: a segment is a str or a PIL image, got {type(seg).__name__}")
    return [(f"{key}.json", json.dumps(doc, ensure_ascii=False).encode()), *images]


def encode_shard(samples: list[list[Segment]], first_key: int) -> bytes:
    """The tar bytes of one shard; sample i gets key first_key + i."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i, segments in enumerate(samples):
            for name, payload in _members(f"{first_key + i:09d}", segments):
                member = tarfile.TarInfo(name)
                member.size, member.mode, member.mtime = len(payload), 0o644, 0
                tar.addfile(member, io.BytesIO(payload))
    return buf.getvalue()


def write_image_text_shards(directory: str, samples: Iterable[list[Segment]], *, samples_per_shard: int,
                            meta: dict | None = None) -> list[ImageShardInfo]:
    """Write `samples` (each a list of segments) as shards of `samples_per_shard`, then meta.json (with `meta`'s
    keys added); returns the shard list."""
    if samples_per_shard < 1:
        raise ValueError(f"samples_per_shard must be >= 1, got {samples_per_shard!r}")
    os.makedirs(directory, exist_ok=True)
    infos: list[ImageShardInfo] = []
    batch: list[list[Segment]] = []
    total = 0

    def flush():
        data = encode_shard(batch, total - len(batch))
        name = shard_name(len(infos))
        atomic_write(os.path.join(directory, name), data)
        infos.append(ImageShardInfo(name, len(batch), hashlib.sha256(data).hexdigest()))
        batch.clear()

    for segments in samples:
        batch.append(segments)
        total += 1
        if len(batch) == samples_per_shard:
            flush()
    if batch:
        flush()
    full = {"format": FORMAT, **(meta or {}), "num_samples": total, "num_shards": len(infos),
            "shards": [asdict(s) for s in infos]}
    atomic_write(os.path.join(directory, META_NAME), (json.dumps(full, indent=1) + "\n").encode())
    return infos


def read_image_meta(directory: str) -> tuple[dict, list[ImageShardInfo]]:
    """meta.json of an image-text directory; DataNotFoundError / DataConfigError naming the directory."""
    path = os.path.join(directory, META_NAME)
    if not os.path.isfile(path):
        raise DataNotFoundError(f"image-text directory {directory!r} has no {META_NAME} (not written, or unfinished)")
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as exc:
        raise DataConfigError(f"image-text directory {directory!r}: cannot read {META_NAME} ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise DataConfigError(f"image-text directory {directory!r}: {META_NAME} has format {found!r}, "
                              f"expected {FORMAT!r}")
    return meta, [ImageShardInfo(**s) for s in meta["shards"]]


IMAGE_FIELDS = ("png", "jpg", "jpeg", "webp")
"""image members a captioned sample may hold (the first present is its image)"""


def _decode(key: str, fields: dict[str, bytes]) -> list[Segment]:
    """One sample's segments from its members (docs/data.md#image-text-shards; a caption's image may be any of
    IMAGE_FIELDS, and other members, e.g. a webdataset corpus's metadata json beside an image and its txt, are
    ignored)."""
    def image(field: str) -> Image.Image:
        if field not in fields:
            raise ShardError(f"sample {key} names image {field!r}, which it does not hold")
        with Image.open(io.BytesIO(fields[field])) as im:
            im.load()
            return im.copy()

    picture = next((f for f in IMAGE_FIELDS if f in fields), None)
    if picture is not None and "txt" in fields:
        return [image(picture), fields["txt"].decode().strip()]
    if "json" in fields:
        doc = json.loads(fields["json"])
        if isinstance(doc, list):
            return [seg["text"] if "text" in seg else image(seg["image"]) for seg in doc]
    raise ShardError(f"sample {key} is neither a captioned image (one of {'/'.join(IMAGE_FIELDS)} and txt) nor a "
                     f"document (a json list of segments): it has {sorted(fields)}")


def _group(data: bytes) -> dict[str, dict[str, bytes]]:
    """A tar's file members grouped by sample key (webdataset's split: the name up to its first dot), in order."""
    grouped: dict[str, dict[str, bytes]] = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        for member in tar:
            if not member.isfile():
                continue
            key, _, field = os.path.basename(member.name).partition(".")
            grouped.setdefault(key, {})[field] = tar.extractfile(member).read()
    return grouped


def index_webdataset(directory: str, pattern: str = ".tar") -> dict:
    """Write meta.json for webdataset tars already in `directory` (every file ending in `pattern`, in name order),
    so the multimodal loader reads them: each sample a captioned image (png / jpg / jpeg / webp and txt) or a
    document (json list); every sample is decoded once here, and one that is neither is refused, naming its shard
    and key. The tars are not rewritten. Returns the meta written. `python -m data.vision.shards index DIR`."""
    if os.path.exists(os.path.join(directory, META_NAME)):
        raise DataConfigError(f"image-text directory {directory!r} already has a {META_NAME}")
    names = sorted(n for n in os.listdir(directory) if n.endswith(pattern))
    if not names:
        raise DataNotFoundError(f"no *{pattern} file in {directory!r} to index")
    infos = []
    for name in names:
        with open(os.path.join(directory, name), "rb") as f:
            data = f.read()
        try:
            grouped = _group(data)
            for key, fields in grouped.items():
                _decode(key, fields)
        except (ShardError, tarfile.TarError, EOFError, OSError, ValueError, KeyError) as exc:
            raise DataConfigError(f"{os.path.join(directory, name)}: {exc}") from None
        infos.append(ImageShardInfo(name, len(grouped), hashlib.sha256(data).hexdigest()))
    meta = {"format": FORMAT, "source": "webdataset", "num_samples": sum(i.num_samples for i in infos),
            "num_shards": len(infos), "shards": [asdict(i) for i in infos]}
    atomic_write(os.path.join(directory, META_NAME), (json.dumps(meta, indent=1) + "\n").encode())
    return meta


def read_image_shard(path: str, info: ImageShardInfo) -> list[tuple[str, list[Segment]]]:
    """(key, segments) of every sample of one shard, in order; ShardError if anything is off."""
    data = read_verified(path, info.sha256)
    try:
        samples = [(key, _decode(key, fields)) for key, fields in _group(data).items()]
    except (tarfile.TarError, EOFError, OSError, ValueError, KeyError) as exc:
        raise ShardError(f"bad shard: {exc}") from exc
    if len(samples) != info.num_samples:
        raise ShardError(f"holds {len(samples)} samples, meta.json says {info.num_samples}")
    return samples


class ImageTextReader:
    """One pass over an image-text directory, yielding (key, segments); resumable (docs/data.md#image-text-shards)."""

    def __init__(self, directory: str):
        self.directory = directory
        self.meta, self.shards = read_image_meta(directory)
        self._fingerprint = hashlib.sha256(
            json.dumps([[s.name, s.sha256] for s in self.shards]).encode()).hexdigest()[:16]
        self._shard, self._offset = 0, 0
        self._starts = [0]  # samples before each shard
        for info in self.shards:
            self._starts.append(self._starts[-1] + info.num_samples)
        self.skipped: list[str] = []

    @property
    def position(self) -> int:
        """Samples of the pass before the next one (the last sample handed out is number position - 1, counted
        over meta.json's shards in order, unreadable ones included): a sample's ordinal whatever its key."""
        return self._starts[self._shard] + self._offset

    def __iter__(self) -> Iterator[tuple[str, list[Segment]]]:
        while (index := self._shard) < len(self.shards):
            info = self.shards[index]
            path = os.path.join(self.directory, info.name)
            try:
                samples = read_image_shard(path, info)
            except ShardError as exc:
                warnings.warn(f"data: skipping image-text shard {path}: {exc}", RuntimeWarning, stacklevel=2)
                self.skipped.append(info.name)
                samples = []
            for j in range(self._offset, len(samples)):
                # The position moves before the sample is handed out: a state_dict() taken while the caller holds
                # it already counts it as consumed.
                self._shard, self._offset = (index + 1, 0) if j + 1 == len(samples) else (index, j + 1)
                yield samples[j]
            if self._shard == index:  # nothing left in it to hand out: unreadable, or the offset was at its end
                self._shard, self._offset = index + 1, 0

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "shards": self._fingerprint, "shard": self._shard, "offset": self._offset}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"image-text reader state version {state.get('version')!r}, expected {STATE_VERSION}")
        if state["shards"] != self._fingerprint:
            raise ValueError(f"image-text reader state was saved over other shards (fingerprint {state['shards']}, "
                             f"{self.directory!r} has {self._fingerprint}); the position cannot be applied")
        self._shard, self._offset = int(state["shard"]), int(state["offset"])


def main(argv: list[str] | None = None) -> None:
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "index":
        print("usage: python -m data.vision.shards index DIR   (meta.json for the webdataset tars in DIR)",
              file=sys.stderr)
        sys.exit(2)
    try:
        meta = index_webdataset(args[1])
    except (DataConfigError, DataNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    print(f"{args[1]}: {meta['num_samples']} samples in {meta['num_shards']} shards indexed")


if __name__ == "__main__":
    main()
