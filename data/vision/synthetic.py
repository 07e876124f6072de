"""A generated image-text source that needs no download: rendered text, shapes and bar charts, each captioned with
exactly what is drawn, written as image-text shards (data/vision/shards.py).

Contract: `synthetic_sample(seed, i, ...)` draws sample i from generators seeded by (seed, i) alone (independent of
the shard size and of the other samples): [image, caption], or with `interleaved=True` a document of two or three
pictures each followed by a sentence naming it. Kinds: text, shapes, count, chart (`render`); every caption is true
of the pixels (shapes and bars drawn without anti-aliasing). `write_synthetic_shards` writes them; the same seed,
settings, numpy and Pillow give byte-identical shards.

Design and reasoning: docs/data.md#synthetic-image-text-source
"""

from __future__ import annotations

import functools
import math

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from data.vision.shards import ImageShardInfo, Segment, write_image_text_shards

COLOURS = {
    "red": (220, 30, 30),
    "green": (20, 150, 60),
    "blue": (30, 70, 220),
    "yellow": (235, 190, 0),
    "orange": (245, 120, 0),
    "purple": (130, 40, 170),
}
"""the named fill colours of shapes and bars (black is kept for the chart's axis and labels)"""
WHITE, BLACK = (255, 255, 255), (0, 0, 0)
LIGHT = ((255, 255, 255), (245, 240, 225), (225, 235, 245), (235, 245, 225))
"""backgrounds of the text kind"""
SHAPES = ("circle", "square", "rectangle", "triangle")
KINDS = ("text", "shapes", "count", "chart")
NUMBER_WORDS = {2: "two", 3: "three", 4: "four", 5: "five"}
FRUITS = ("apples", "pears", "plums", "figs", "limes", "kiwis", "dates", "grapes")
WORDS = ("HELLO", "CEDAR", "PIXEL", "SHARD", "TOKEN", "RIVER", "ORBIT", "LEMON", "DELTA", "NORTH")
DEFAULT_SIZE_RANGE = (60, 400)
MIN_SIDE = 60
"""the smallest side that holds every kind: the longest text (9 glyphs of 6 px), five counted shapes of
MIN_SHAPE_PX in slots of 12 px, a chart's labels and nine units of bar"""
CHART_BAR_PX = 48
"""chart width per bar: a six-letter label (36 px) and a gap"""
MIN_SHAPE_PX = 8
"""smallest shape side: a 6 px circle fills 67 % of its box and a 6 px triangle 58 %, too close to tell apart"""
RECTANGLE_ASPECT = 0.55
"""height / width of a rectangle; squares, circles and triangles have equal sides"""


@functools.cache
def _font() -> ImageFont.ImageFont:
    return ImageFont.load_default_imagefont()


def _pick(rng: np.random.Generator, options, n: int | None = None, replace: bool = True):
    if n is None:
        return options[int(rng.integers(len(options)))]
    return [options[int(i)] for i in rng.choice(len(options), n, replace=replace)]


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], fill) -> None:
    x0, y0, w, h = box
    x1, y1 = x0 + w - 1, y0 + h - 1
    if shape == "circle":
        draw.ellipse((x0, y0, x1, y1), fill=fill)
    elif shape == "triangle":
        draw.polygon([(x0, y1), (x1, y1), ((x0 + x1) / 2, y0)], fill=fill)
    else:
        draw.rectangle((x0, y0, x1, y1), fill=fill)


def _place(rng: np.random.Generator, draw: ImageDraw.ImageDraw, shapes: list[str], colours: list[str], width: int,
           height: int, horizontal: bool) -> None:
    """Draw the shapes in equal slots along the width (horizontal) or the height, in order, each inside its slot with
    a pixel to spare at both ends, so that neighbours never touch."""
    along, across = (width, height) if horizontal else (height, width)
    n = len(shapes)
    edges = [math.floor(along * i / n) for i in range(n + 1)]
    room = min(b - a for a, b in zip(edges, edges[1:])) - 2
    side = min(room, max(MIN_SHAPE_PX, math.floor(min(along / n, across) * rng.uniform(0.5, 0.8))))
    for shape, colour, start, end in zip(shapes, colours, edges, edges[1:]):
        w, h = (side, round(side * RECTANGLE_ASPECT)) if shape == "rectangle" else (side, side)
        size_along, size_across = (w, h) if horizontal else (h, w)
        a = start + int(rng.integers(1, end - start - size_along))
        c = int(rng.integers(0, across - size_across + 1))
        _draw_shape(draw, shape, (a, c, w, h) if horizontal else (c, a, w, h), COLOURS[colour])


def _text(rng: np.random.Generator, width: int, height: int) -> tuple[Image.Image, str]:
    text = f"{_pick(rng, WORDS)} {int(rng.integers(1000))}"
    _, _, tw, th = _font().getbbox(text)
    glyphs = Image.new("L", (tw, th), 0)
    ImageDraw.Draw(glyphs).text((0, 0), text, fill=255, font=_font())
    k = max(1, min(width * 9 // 10 // tw, height * 9 // 10 // th, 6))
    glyphs = glyphs.resize((tw * k, th * k), Image.Resampling.NEAREST)
    image = Image.new("RGB", (width, height), _pick(rng, LIGHT))
    x, y = int(rng.integers(width - tw * k + 1)), int(rng.integers(height - th * k + 1))
    image.paste(BLACK, (x, y, x + tw * k, y + th * k), glyphs)
    return image, f"the text '{text}'"


def _shapes(rng: np.random.Generator, width: int, height: int) -> tuple[Image.Image, str]:
    n = int(rng.integers(1, 4))
    colours, shapes = _pick(rng, list(COLOURS), n, replace=False), _pick(rng, SHAPES, n)
    horizontal = bool(rng.integers(2))
    image = Image.new("RGB", (width, height), WHITE)
    _place(rng, ImageDraw.Draw(image), shapes, colours, width, height, horizontal)
    items = [f"{_article(c)} {c} {s}" for c, s in zip(colours, shapes)]
    if n == 1:
        return image, items[0]
    if n == 2:
        return image, f"{items[0]} {'left of' if horizontal else 'above'} {items[1]}"
    order = "from left to right" if horizontal else "from top to bottom"
    return image, f"{items[0]}, {items[1]} and {items[2]}, {order}"


def _count(rng: np.random.Generator, width: int, height: int) -> tuple[Image.Image, str]:
    k, colour, shape = int(rng.integers(2, 6)), _pick(rng, list(COLOURS)), _pick(rng, SHAPES)
    image = Image.new("RGB", (width, height), WHITE)
    _place(rng, ImageDraw.Draw(image), [shape] * k, [colour] * k, width, height, horizontal=width >= height)
    return image, f"{NUMBER_WORDS[k]} {colour} {shape}s"


def _chart(rng: np.random.Generator, width: int, height: int) -> tuple[Image.Image, str]:
    n = int(rng.integers(3, 5))
    labels, values = _pick(rng, FRUITS, n, replace=False), [int(v) for v in rng.integers(1, 10, n)]
    colour = _pick(rng, list(COLOURS))
    width = max(width, CHART_BAR_PX * n)
    image = Image.new("RGB", (width, height), WHITE)
    draw = ImageDraw.Draw(image)
    label_h = _font().getbbox("Ag")[3]
    base = height - label_h - 5  # the axis row; bars stand on it, labels hang below it
    unit = (base - 4) // 9  # the tallest bar (9) leaves 4 px above it
    draw.line((0, base, width - 1, base), fill=BLACK)
    slot = width / n
    bar_w = round(slot * 0.6)
    for i, (label, value) in enumerate(zip(labels, values)):
        x0 = math.floor(slot * i + (slot - bar_w) / 2)
        draw.rectangle((x0, base - value * unit, x0 + bar_w - 1, base - 1), fill=COLOURS[colour])
        label_w = _font().getbbox(label)[2]
        draw.text((math.floor(slot * (i + 0.5) - label_w / 2), base + 3), label, fill=BLACK, font=_font())
    return image, "a bar chart: " + ", ".join(f"{label} {value}" for label, value in zip(labels, values))


_RENDER = {"text": _text, "shapes": _shapes, "count": _count, "chart": _chart}
_CAPTION, _DOCUMENT = 1, 2


def _check_size_range(size_range: tuple[int, int]) -> None:
    low, high = size_range
    if not MIN_SIDE <= low < high:
        raise ValueError(f"size_range must be (low, high) with {MIN_SIDE} <= low < high, got {tuple(size_range)!r}")


def render(rng: np.random.Generator, size_range: tuple[int, int] = DEFAULT_SIZE_RANGE) -> tuple[Image.Image, str]:
    """One captioned image of a random kind; width and height drawn from size_range (inclusive), never equal."""
    _check_size_range(size_range)
    low, high = size_range
    kind = _pick(rng, KINDS)
    width, height = (int(v) for v in rng.integers(low, high + 1, 2))
    if width == height:
        height += -1 if height > low else 1
    return _RENDER[kind](rng, width, height)


def synthetic_sample(seed: int, index: int, *, interleaved: bool = False,
                     size_range: tuple[int, int] = DEFAULT_SIZE_RANGE) -> list[Segment]:
    """Sample `index` of `seed`: [image, caption], or an interleaved document
    (docs/data.md#synthetic-image-text-source)."""
    # Seeds end in a non-zero tag: numpy's SeedSequence gives [s, i] and [s, i, 0] the same stream.
    if not interleaved:
        return list(render(np.random.default_rng([seed, index, _CAPTION]), size_range))
    n = int(np.random.default_rng([seed, index, _DOCUMENT]).integers(2, 4))
    segments: list[Segment] = [f"Here are {n} pictures."]
    for j in range(n):
        image, caption = render(np.random.default_rng([seed, index, _DOCUMENT, j + 1]), size_range)
        segments += [image, f"Picture {j + 1} shows {caption}."]
    return segments


def write_synthetic_shards(directory: str, num_samples: int, *, seed: int = 0, interleaved: bool = False,
                           samples_per_shard: int = 256, size_range: tuple[int, int] = DEFAULT_SIZE_RANGE
                           ) -> list[ImageShardInfo]:
    """Samples 0 .. num_samples - 1 of `seed` as image-text shards in `directory`; meta.json records the settings."""
    _check_size_range(size_range)
    samples = (synthetic_sample(seed, i, interleaved=interleaved, size_range=size_range) for i in range(num_samples))
    meta = {"source": "synthetic", "seed": seed, "interleaved": interleaved, "size_range": list(size_range)}
    return write_image_text_shards(directory, samples, samples_per_shard=samples_per_shard, meta=meta)
