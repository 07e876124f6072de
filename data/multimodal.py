"""Mixing text rows and image-text rows into one resumable batch stream (issue 20, the data side).

Contract: `MultimodalLoader` (built by `build_multimodal_loader`) yields batches of input_ids, labels, image_mask
[B, T], row_kind [B] (0 text, 1 multimodal), pixel_values [S, 588] and grids [N, 2], the images packed back to back
in the order of their placeholder runs. Text rows are the text loader's (data/loader.py), none lost or repeated;
a multimodal row is one image-text sample, image positions never predicted (label -100), an image in a row whole
or not at all. Exactly one row of every block of text_to_multimodal + 1 rows is multimodal, at the same places on
every data rank (`multimodal_rows`). Without shards at `image_path` a generated source is written there first
(`ensure_images`). `state_dict()` / `load_state_dict()` resume exactly under the same layout only (no elastic
resume).

Design and reasoning: docs/data.md#multimodal-mixture
"""

from __future__ import annotations

import os
import shutil
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image

from config_checks import at_least, positive
from data.config import build_dataloader, ensure_prepared
from data.schema import DataConfig
from data.shards import DataConfigError, DataNotFoundError
from data.tokenizer import load_tokenizer
from data.vision.processor import ProcessorConfig, plan_resize, process
from data.vision.shards import ImageTextReader, Segment, read_image_meta, write_image_text_shards
from data.vision.synthetic import MIN_SIDE, synthetic_sample

STATE_VERSION = 1
IGNORE = -100
"""label of positions that are not trained on (cross-entropy's ignore_index)"""
TEXT, MULTIMODAL = 0, 1
"""row_kind values"""
ROW_KINDS = ("text", "multimodal")
"""row_kind's names, by value (the trainer's metrics loss_text and loss_multimodal)"""
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment


@dataclass
class MultimodalConfig:
    """Settings of the image-text side of the data (`data.multimodal`)."""

    text_to_multimodal: int = 7
    """text rows per multimodal row: 7 = 1 row in 8 (12.5 %) is an image-text sample; 0 = text only"""
    image_token_id: int = 4095
    """the placeholder id, model.image_token_id; the tokenizer must never emit it (a trained BPE of data.vocab_size
    <= image_token_id ids leaves it free)"""
    image_path: str = ".data/synthetic-images"
    """directory of image-text shards (data/vision/shards.py); generated there on first use when it has none"""
    num_samples: int = 2048
    """samples generated into image_path (only when generating; a pass over them is an image epoch)"""
    interleaved_every: int = 4
    """every k-th generated sample is an interleaved document of 2-3 images, the others captioned images; 0 = none"""
    image_seed: int = 0
    """seed of the generated images"""
    size_range: list[int] = field(default_factory=lambda: [60, 400])
    """[low, high] pixels of each side of a generated image"""
    min_pixels: int = 168 * 168
    """the processor scales smaller images up to about this area; the public processor's 544 * 544 makes every
    image >= 184 tokens, more than a tiny job's rows hold"""
    max_image_tokens: int = 1024
    """most placeholder tokens one image may take (the processor shrinks larger ones); the model's
    vision.max_tokens"""

    def __post_init__(self) -> None:
        for name in ("text_to_multimodal", "interleaved_every", "image_seed", "min_pixels"):
            at_least(f"data.multimodal.{name}", getattr(self, name), 0)
        for name in ("num_samples", "image_token_id"):
            positive(f"data.multimodal.{name}", getattr(self, name))
        at_least("data.multimodal.max_image_tokens", self.max_image_tokens, 4)
        if len(self.size_range) != 2 or not MIN_SIDE <= self.size_range[0] < self.size_range[1]:
            raise ValueError(f"data.multimodal.size_range must be [low, high] with {MIN_SIDE} <= low < high, got "
                             f"{list(self.size_range)}")
        if not self.image_path:
            raise ValueError("data.multimodal.image_path must be a directory, got ''")

    @property
    def processor(self) -> ProcessorConfig:
        return ProcessorConfig(min_pixels=self.min_pixels, max_image_tokens=self.max_image_tokens)


@dataclass
class MultimodalDataConfig(DataConfig):
    """The `data` group with an image-text side (conf/data/multimodal.yaml): DataConfig plus `multimodal`."""

    multimodal: MultimodalConfig = field(default_factory=MultimodalConfig)
    """the image-text source and the text : multimodal mixture"""


def multimodal_rows(seed: int, text_to_multimodal: int, start: int, count: int) -> np.ndarray:
    """[count] bool: which of rows start .. start + count - 1 are multimodal (docs/data.md#multimodal-mixture)."""
    if text_to_multimodal == 0:
        return np.zeros(count, dtype=bool)
    period = text_to_multimodal + 1
    rows = np.arange(start, start + count, dtype=np.uint64)
    block = rows // np.uint64(period)
    # splitmix64 of (seed, block): a fixed, platform-independent hash; uint64 arithmetic wraps as intended.
    z = (block + np.uint64(seed) * np.uint64(0x100000001B3)) * np.uint64(_GOLDEN) + np.uint64(_GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return rows % np.uint64(period) == z % np.uint64(period)


@dataclass
class EncodedSample:
    """One image-text sample as a row (`encode_sample`)."""

    input_ids: np.ndarray
    """[L] int64, L <= T: the row before padding"""
    labels: np.ndarray
    """[L] int64: next tokens, IGNORE at placeholders and past the sample's end"""
    images: list[Image.Image]
    """the images whose placeholder runs the row holds, in order"""
    num_tokens: list[int]
    """placeholder tokens of each kept image"""


def encode_sample(segments: list[Segment], encode, *, seq_len: int, image_token_id: int, eos_id: int,
                  processor: ProcessorConfig) -> EncodedSample | None:
    """A sample as one row of at most `seq_len` tokens (docs/data.md, Rows), or None when its first image does
    not fit. `encode(text) -> list[int]` tokenizes a text segment. Images are planned here, not decoded to patches."""
    tokens: list[np.ndarray] = []
    runs: list[tuple[int, int]] = []  # [start, end) of each image's placeholders
    images: list[Image.Image] = []
    at = 0
    for seg in segments:
        if isinstance(seg, str):
            piece = np.asarray(encode(seg), dtype=np.int64)
        else:
            n = plan_resize(seg.width, seg.height, processor).num_tokens
            piece = np.full(n, image_token_id, dtype=np.int64)
            runs.append((at, at + n))
            images.append(seg)
        tokens.append(piece)
        at += len(piece)
    seq = np.concatenate([*tokens, np.array([eos_id], dtype=np.int64)])
    length = min(len(seq), seq_len)
    for a, b in runs:
        if a < length < b:  # never inside a run: the image goes whole or not at all
            length = a
    kept = [i for i, (_, b) in enumerate(runs) if b <= length]
    if not kept:
        return None
    labels = np.full(length, IGNORE, dtype=np.int64)
    following = seq[1 : length + 1]  # one short of `length` when the whole sample fits
    labels[: len(following)] = following
    labels[labels == image_token_id] = IGNORE
    return EncodedSample(input_ids=seq[:length], labels=labels, images=[images[i] for i in kept],
                         num_tokens=[runs[i][1] - runs[i][0] for i in kept])


def _generated_meta(cfg: MultimodalConfig) -> dict:
    return {"source": "synthetic", "seed": cfg.image_seed, "interleaved_every": cfg.interleaved_every,
            "size_range": list(cfg.size_range)}


def ensure_images(cfg: MultimodalConfig, samples_per_shard: int = 256) -> str:
    """Make sure `cfg.image_path` holds image-text shards, generating them when it has none; returns the path.

    Generated shards must match cfg's generation settings (DataConfigError naming the key otherwise); shards of
    another source are used as they are."""
    path = cfg.image_path
    try:
        meta, _ = read_image_meta(path)
    except DataNotFoundError:
        if os.path.exists(path) and os.listdir(path):
            raise DataConfigError(f"data.multimodal.image_path={path!r} exists but holds no image-text meta.json: "
                                  "delete it or point data.multimodal.image_path elsewhere") from None
        tmp = f"{path.rstrip(os.sep)}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        low, high = cfg.size_range
        k = cfg.interleaved_every
        samples = (synthetic_sample(cfg.image_seed, i, interleaved=k > 0 and i % k == k - 1, size_range=(low, high))
                   for i in range(cfg.num_samples))
        write_image_text_shards(tmp, samples, samples_per_shard=samples_per_shard,
                                meta={**_generated_meta(cfg), "num_samples": cfg.num_samples})
        if os.path.isdir(path) and not os.listdir(path):
            os.rmdir(path)
        try:
            os.rename(tmp, path)
        except OSError:  # another process published first: its shards are the same samples
            shutil.rmtree(tmp, ignore_errors=True)
        meta, _ = read_image_meta(path)
    if meta.get("source") == "synthetic":
        want = {**_generated_meta(cfg), "num_samples": cfg.num_samples}
        names = {"seed": "image_seed"}
        wrong = [f"data.multimodal.{names.get(k, k)}={v!r} (the shards have {meta.get(k)!r})"
                 for k, v in want.items() if meta.get(k) != v]
        if wrong:
            raise DataConfigError(f"data.multimodal.image_path={path!r} holds generated images made with other "
                                  f"settings: {', '.join(wrong)}; point data.multimodal.image_path to a new directory "
                                  "to generate them there")
    return path


class MultimodalLoader:
    """Infinite iterable of batches mixing text rows and image-text rows for one data rank (docs/data.md).

    A batch: input_ids, labels, image_mask [B, T] (int64, int64, bool), row_kind [B] int64 (TEXT / MULTIMODAL),
    pixel_values [S, 588] float32 and grids [N, 2] int64. Each `iter()` continues from the current position; call
    it again after `load_state_dict`.
    """

    def __init__(self, text, image_path: str, cfg: MultimodalConfig, *, encode, vocab_size: int, eos_id: int,
                 pad_id: int, seed: int, rank: int = 0, world_size: int = 1):
        """`text`: a PackedLoader of this rank (its seq_len and batch_size are this loader's); `encode(text) ->
        list[int]` and `vocab_size` are the tokenizer's."""
        if vocab_size > cfg.image_token_id:
            raise DataConfigError(
                f"data.multimodal.image_token_id={cfg.image_token_id} is an id the tokenizer can emit (it has "
                f"{vocab_size} ids): train the BPE with data.vocab_size <= {cfg.image_token_id}, or set "
                "data.multimodal.image_token_id (and model.image_token_id) past the tokenizer's ids")
        self.text, self.cfg, self.encode = text, cfg, encode
        self.seq_len, self.batch_size = text.seq_len, text.batch_size
        self.eos_id, self.pad_id, self.seed = eos_id, pad_id, seed
        self.rank, self.world_size = rank, world_size
        self.processor = cfg.processor
        self.reader = ImageTextReader(image_path) if cfg.text_to_multimodal > 0 else None
        self._layout = {"rank": rank, "world_size": world_size, "text_to_multimodal": cfg.text_to_multimodal,
                        "seed": seed, "seq_len": self.seq_len, "image_token_id": cfg.image_token_id,
                        "images": self.reader.state_dict()["shards"] if self.reader else None}
        self.rows = 0
        """rows handed out so far: the next row's number in the schedule"""
        self.image_epoch = 0
        """completed passes over this rank's image samples"""
        self.skipped_samples = 0
        """image-text samples skipped because their first image does not fit data.seq_len"""
        self._carry: list[tuple[torch.Tensor, torch.Tensor]] = []  # unused (input_ids [T], labels [T]) text rows
        self._text_iter: Iterator | None = None
        self._image_iter: Iterator | None = None
        self._fitted_this_epoch = False

    def _text_row(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._carry:
            if self._text_iter is None:
                self._text_iter = iter(self.text)
            batch = next(self._text_iter)
            self._carry = list(zip(batch["input_ids"], batch["labels"]))
        return self._carry.pop(0)

    def _next_sample(self) -> EncodedSample:
        """This rank's next image-text sample that fits a row, passing on to the next image epoch at the end."""
        while True:
            if self._image_iter is None:
                self._image_iter = iter(self.reader)
            for key, segments in self._image_iter:
                if (self.reader.position - 1) % self.world_size != self.rank:  # the sample's ordinal, not its key
                    continue
                sample = encode_sample(segments, self.encode, seq_len=self.seq_len,
                                       image_token_id=self.cfg.image_token_id, eos_id=self.eos_id,
                                       processor=self.processor)
                if sample is None:
                    self.skipped_samples += 1
                    continue
                self._fitted_this_epoch = True
                return sample
            if not self._fitted_this_epoch:
                raise DataConfigError(
                    f"no image-text sample of {self.reader.directory!r} for data rank {self.rank} fits a row of "
                    f"data.seq_len={self.seq_len} tokens: raise data.seq_len or lower data.multimodal.min_pixels")
            self.reader.load_state_dict({**self.reader.state_dict(), "shard": 0, "offset": 0})
            self._image_iter, self.image_epoch, self._fitted_this_epoch = None, self.image_epoch + 1, False

    def _next_batch(self) -> dict[str, torch.Tensor]:
        B, T = self.batch_size, self.seq_len
        kinds = multimodal_rows(self.seed, self.cfg.text_to_multimodal, self.rows, B)
        input_ids = torch.full((B, T), self.pad_id, dtype=torch.int64)  # [B, T]
        labels = torch.full((B, T), IGNORE, dtype=torch.int64)  # [B, T]
        images, grids = [], []
        for b, mm in enumerate(kinds):
            if not mm:
                input_ids[b], labels[b] = self._text_row()
                continue
            sample = self._next_sample()
            n = len(sample.input_ids)
            input_ids[b, :n] = torch.from_numpy(sample.input_ids)
            labels[b, :n] = torch.from_numpy(sample.labels)
            for image, num_tokens in zip(sample.images, sample.num_tokens):
                processed = process(image, self.processor)
                assert processed.num_tokens == num_tokens, "plan_resize and process disagree"
                images.append(processed.pixel_values)
                grids.append(processed.grid)
        self.rows += B
        return {
            "input_ids": input_ids,
            "labels": labels,
            "image_mask": input_ids == self.cfg.image_token_id,  # [B, T]
            "row_kind": torch.from_numpy(np.where(kinds, MULTIMODAL, TEXT)),  # [B] int64
            "pixel_values": torch.cat(images) if images else torch.zeros(0, 588),  # [S, 588]
            "grids": torch.tensor(grids, dtype=torch.int64).reshape(-1, 2),  # [N, 2]
        }

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            yield self._next_batch()

    @property
    def skipped_shards(self) -> int:
        """Corrupt text shards the text loader skipped (the metrics' skipped_shards)."""
        return getattr(self.text, "skipped_shards", 0)

    def state_dict(self) -> dict:
        """Position after the last batch handed out, in plain Python types, keyed by data rank (as PackedLoader)."""
        text = self.text.state_dict()[f"dp_rank_{self.rank}"]
        return {f"dp_rank_{self.rank}": {
            "version": STATE_VERSION, **self._layout, "text": text, "rows": self.rows,
            "carry": [[x.tolist(), y.tolist()] for x, y in self._carry],
            "images_pos": self.reader.state_dict() if self.reader else None, "image_epoch": self.image_epoch,
            "fitted_this_epoch": self._fitted_this_epoch, "skipped_samples": self.skipped_samples,
        }}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a position saved by a loader of the same layout (exactly: the same batches follow)."""
        key = f"dp_rank_{self.rank}"
        if key not in state_dict:
            raise ValueError(f"multimodal loader state has no entry {key!r} (has {sorted(state_dict)})")
        s = state_dict[key]
        if s.get("version") != STATE_VERSION:
            raise ValueError(f"multimodal loader state version {s.get('version')!r}, expected {STATE_VERSION}")
        for name, value in self._layout.items():
            if s[name] != value:
                raise ValueError(f"multimodal loader state was saved with {name}={s[name]!r}, this loader has "
                                 f"{value!r}; the saved position cannot be replayed exactly")
        self.text.load_state_dict({key: s["text"]})
        if self.reader is not None:
            self.reader.load_state_dict(s["images_pos"])
        self.rows, self.image_epoch = int(s["rows"]), int(s["image_epoch"])
        self._fitted_this_epoch, self.skipped_samples = bool(s["fitted_this_epoch"]), int(s["skipped_samples"])
        self._carry = [(torch.tensor(x, dtype=torch.int64), torch.tensor(y, dtype=torch.int64))
                       for x, y in s["carry"]]
        self._text_iter = self._image_iter = None


def build_multimodal_loader(cfg: MultimodalDataConfig, rank: int = 0, world_size: int = 1, *,
                            progress: bool = False):
    """(MultimodalLoader, TokenizerInfo) for data rank `rank` of `world_size`: the text shards at cfg.path (prepared
    first if needed, `progress` shown) mixed with the image-text shards at cfg.multimodal.image_path (generated first
    if needed)."""
    ensure_prepared(cfg, progress=progress)
    text, info = build_dataloader(cfg, rank, world_size)
    if info.pad_id is None:
        raise DataConfigError(f"data.tokenizer={cfg.tokenizer!r} has no <pad> token, which multimodal rows pad with")
    image_path = ensure_images(cfg.multimodal) if cfg.multimodal.text_to_multimodal > 0 else cfg.multimodal.image_path
    tok = load_tokenizer(info.path)
    loader = MultimodalLoader(text, image_path, cfg.multimodal,
                              encode=lambda s: tok.encode(s, add_special_tokens=False).ids,
                              vocab_size=tok.get_vocab_size(), eos_id=info.eos_id, pad_id=info.pad_id,
                              seed=cfg.seed, rank=rank, world_size=world_size)
    return loader, info
