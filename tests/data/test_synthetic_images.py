"""The generated image-text source (data/vision/synthetic.py) and its shard format and reader (data/vision/shards.py).

Proven: the same seed writes byte-identical shards (captioned and interleaved); captions say what the pixels show
(shapes: colour, kind and order; counts; bar heights proportional to the captioned values; the text's ink); sizes
vary and are never square; the reader gives back exactly the samples written, pixel for pixel; a reader restored
from a position saved after n samples yields exactly the samples after n, at any n (mid-shard, at a shard boundary,
at the end); a position from other shards is refused; a damaged shard is skipped with a warning; the webdataset
library reads the shards; the processor turns the images into grids of many sizes.
"""

import json
import os
import re

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFont

from data.shards import DataNotFoundError
from data.vision.processor import pack_images, process
from data.vision.shards import ImageTextReader
from data.vision.synthetic import COLOURS, DEFAULT_SIZE_RANGE, synthetic_sample, write_synthetic_shards

SHAPE = r"(circle|square|rectangle|triangle)"
NUMBERS = {"two": 2, "three": 3, "four": 4, "five": 5}
WHITE, BLACK = (255, 255, 255), (0, 0, 0)


def _files(directory):
    return {name: (directory / name).read_bytes() for name in sorted(os.listdir(directory))}


def _pixels(image):
    return np.asarray(image.convert("RGB"))


def _runs(flags):
    """(start, end) of the runs of True in a 1-D bool array."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], flags.astype(np.int8), [0]])))
    return list(zip(edges[::2], edges[1::2]))


def _shape_of(mask):
    """The shape a one-shape bool mask shows, from its bounding box and how much of the box it fills."""
    ys, xs = np.nonzero(mask)
    w, h = xs.max() - xs.min() + 1, ys.max() - ys.min() + 1
    fill = mask.sum() / (w * h)
    if fill == 1:
        return "square" if w == h else "rectangle" if w > 1.3 * h else f"box {w}x{h}"
    if 0.7 <= fill <= 0.9 and w == h:
        return "circle"
    if 0.4 <= fill <= 0.65:
        return "triangle"
    return f"unknown (fill {fill:.2f}, {w}x{h})"


def _check_caption(image, caption):
    """Assert that `caption` describes `image`; returns the kind."""
    a = _pixels(image)
    if m := re.fullmatch(r"the text '(.+)'", caption):
        font = ImageFont.load_default_imagefont()
        _, _, w, h = font.getbbox(m[1])
        glyphs = Image.new("L", (w, h), 0)
        ImageDraw.Draw(glyphs).text((0, 0), m[1], fill=255, font=font)
        ratio = (a == BLACK).all(-1).sum() / (np.asarray(glyphs) > 0).sum()
        assert ratio == round(ratio ** 0.5) ** 2, ratio  # the glyphs scaled by an integer k: k^2 times the ink
        return "text"
    if m := re.fullmatch(r"a bar chart: (.+)", caption):
        values = [int(v) for v in re.findall(r"\w+ (\d)", m[1])]
        bars = ~((a == WHITE).all(-1) | (a == BLACK).all(-1))  # neither background nor axis / labels
        runs = _runs(bars.any(0))
        assert len(runs) == len(values)
        heights = [int(bars[:, (x0 + x1) // 2].sum()) for x0, x1 in runs]  # left to right
        unit = heights[0] // values[0]
        assert unit >= 1 and heights == [v * unit for v in values], (heights, values)
        return "chart"
    if m := re.fullmatch(rf"(two|three|four|five) (\w+) {SHAPE}s", caption):
        mask = (a == COLOURS[m[2]]).all(-1)
        runs = _runs(mask.any(0) if image.width >= image.height else mask.any(1))
        assert len(runs) == NUMBERS[m[1]]
        for lo, hi in runs:
            part = mask[:, lo:hi] if image.width >= image.height else mask[lo:hi]
            assert _shape_of(part) == m[3], caption
        return "count"
    items = re.findall(rf"an? (\w+) {SHAPE}", caption)
    assert 1 <= len(items) <= 3 and caption.startswith(("a ", "an ")), caption
    centres = []
    for colour, shape in items:
        mask = (a == COLOURS[colour]).all(-1)
        assert _shape_of(mask) == shape, (caption, colour)
        centres.append(np.argwhere(mask).mean(0))  # (y, x)
    if len(items) > 1:
        axis = 1 if ("left of" in caption or "from left to right" in caption) else 0
        assert "above" in caption or "from top to bottom" in caption or axis == 1
        along = [c[axis] for c in centres]
        assert along == sorted(along) and len(set(along)) == len(along), caption
    return "shapes"


def test_same_seed_same_bytes(tmp_path):
    for interleaved in (False, True):
        a, b, c = (tmp_path / f"{interleaved}-{x}" for x in "abc")
        write_synthetic_shards(str(a), 20, seed=3, interleaved=interleaved, samples_per_shard=8)
        write_synthetic_shards(str(b), 20, seed=3, interleaved=interleaved, samples_per_shard=8)
        write_synthetic_shards(str(c), 20, seed=4, interleaved=interleaved, samples_per_shard=8)
        files = _files(a)
        assert list(files) == ["meta.json", "shard-000000.tar", "shard-000001.tar", "shard-000002.tar"]
        assert files == _files(b)
        assert files["shard-000000.tar"] != _files(c)["shard-000000.tar"]


def test_captions_say_what_is_drawn():
    kinds = [_check_caption(*synthetic_sample(0, i)) for i in range(120)]
    assert {k: kinds.count(k) >= 15 for k in ("text", "shapes", "count", "chart")} == dict.fromkeys(
        ("text", "shapes", "count", "chart"), True)


def test_interleaved_documents_caption_their_pictures():
    for i in range(10):
        doc = synthetic_sample(5, i, interleaved=True)
        n = int(re.fullmatch(r"Here are (\d) pictures\.", doc[0])[1])
        assert len(doc) == 1 + 2 * n
        for j in range(n):
            image, text = doc[1 + 2 * j], doc[2 + 2 * j]
            caption = re.fullmatch(rf"Picture {j + 1} shows (.+)\.", text)[1]
            _check_caption(image, caption)


def test_sizes_vary_and_are_never_square():
    sizes = [synthetic_sample(1, i)[0].size for i in range(60)]
    low, high = DEFAULT_SIZE_RANGE
    assert all(low <= w <= high and low <= h <= high and w != h for w, h in sizes)
    assert len({w for w, _ in sizes}) > 30 and len({h for _, h in sizes}) > 30
    with pytest.raises(ValueError, match="size_range"):
        synthetic_sample(1, 0, size_range=(20, 100))


def _same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if isinstance(w, str):
            assert g == w
        else:
            assert g.size == w.size and np.array_equal(_pixels(g), _pixels(w))


@pytest.mark.parametrize("interleaved", [False, True])
def test_reader_gives_back_what_was_written(tmp_path, interleaved):
    write_synthetic_shards(str(tmp_path), 11, seed=2, interleaved=interleaved, samples_per_shard=4)
    samples = list(ImageTextReader(str(tmp_path)))
    assert [key for key, _ in samples] == [f"{i:09d}" for i in range(11)]
    for i, (_, segments) in enumerate(samples):
        _same(segments, synthetic_sample(2, i, interleaved=interleaved))
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert (meta["num_samples"], meta["num_shards"], meta["seed"], meta["interleaved"]) == (11, 3, 2, interleaved)


def test_resume_yields_exactly_the_rest(tmp_path):
    write_synthetic_shards(str(tmp_path), 20, seed=7, samples_per_shard=8)
    keys = [key for key, _ in ImageTextReader(str(tmp_path))]
    for n in (0, 3, 8, 9, 19, 20):
        reader = ImageTextReader(str(tmp_path))
        it = iter(reader)
        taken = [next(it)[0] for _ in range(n)]
        state = json.loads(json.dumps(reader.state_dict()))  # plain types, as a checkpoint stores them
        fresh = ImageTextReader(str(tmp_path))
        fresh.load_state_dict(state)
        assert taken + [key for key, _ in fresh] == keys, n
    other = tmp_path / "other"
    write_synthetic_shards(str(other), 20, seed=8, samples_per_shard=8)
    with pytest.raises(ValueError, match="saved over other shards"):
        ImageTextReader(str(other)).load_state_dict(state)


def test_damaged_shard_is_skipped_with_a_warning(tmp_path):
    write_synthetic_shards(str(tmp_path), 12, seed=0, samples_per_shard=4)
    path = tmp_path / "shard-000001.tar"
    path.write_bytes(path.read_bytes()[:1000])
    reader = ImageTextReader(str(tmp_path))
    with pytest.warns(RuntimeWarning, match="shard-000001.tar: checksum mismatch"):
        keys = [key for key, _ in reader]
    assert keys == [f"{i:09d}" for i in (0, 1, 2, 3, 8, 9, 10, 11)]
    assert reader.skipped == ["shard-000001.tar"]
    with pytest.raises(DataNotFoundError, match="has no meta.json"):
        ImageTextReader(str(tmp_path / "missing"))


def test_webdataset_reads_the_shards(tmp_path):
    import webdataset as wds

    write_synthetic_shards(str(tmp_path / "c"), 3, seed=0)
    write_synthetic_shards(str(tmp_path / "d"), 3, seed=0, interleaved=True)
    captioned = list(wds.WebDataset(str(tmp_path / "c" / "shard-000000.tar"), shardshuffle=False))
    assert [sorted(k for k in s if not k.startswith("__")) for s in captioned] == [["png", "txt"]] * 3
    assert captioned[1]["txt"].decode() == synthetic_sample(0, 1)[1]
    docs = list(wds.WebDataset(str(tmp_path / "d" / "shard-000000.tar"), shardshuffle=False))
    for i, sample in enumerate(docs):
        segments = json.loads(sample["json"])
        fields = [s["image"] for s in segments if "image" in s]
        assert fields == [f"{j}.png" for j in range(len(fields))] and all(f in sample for f in fields)
        assert [s["text"] for s in segments if "text" in s] == [s for s in synthetic_sample(0, i, interleaved=True)
                                                                  if isinstance(s, str)]


def test_the_processor_takes_the_images_at_many_grids():
    images = [process(synthetic_sample(9, i)[0]) for i in range(8)]
    assert len({im.grid for im in images}) >= 6
    packed = pack_images(images)
    assert packed.cu_seqlens[-1] == packed.pixel_values.shape[0] == sum(im.grid[0] * im.grid[1] for im in images)
