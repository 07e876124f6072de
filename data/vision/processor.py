"""The image processor of DeepSeek-V4.1 (REFERENCE A12): an image in, its patches and placeholder layout out.

Shape legend: P patches of one image (grid_h x grid_w), N images in a batch, S = sum of P over the batch, L
placeholder tokens of one image, 588 = C x p x p values per patch (C = 3 channels, p = 14 pixels).

Contract: `plan_resize` (a pure function of the image size and `ProcessorConfig`) gives the canvas as the public
processor computes it, to its truncations (ValueError for a plan that cannot fit `max_image_tokens`); `process` fits
the RGB image into it (aspect kept, bicubic, centred on gray) and returns its [P, 588] float32 patches in [-1, 1]
and its grid; `num_image_tokens` / `placeholder_layout` give the n_h (n_w + 1) + 2 placeholder tokens (START, per
merged row n_w IMAGE and one NEWLINE, END), rebuilt from the grid alone; `pack_images` packs variable grids back to
back.

Design and reasoning: docs/data.md#the-image-processor
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from config_checks import at_least, positive

START, IMAGE, NEWLINE, END = range(4)
"""placeholder kinds, in the public processor's numbering (its IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END)"""
PAD_GRAY = 127
"""canvas colour around a fitted image, on every channel"""


@dataclass(frozen=True)
class ProcessorConfig:
    """The processor's settings; the defaults are the public `config.json` `vision_config` values."""

    patch_size: int = 14
    """pixels per side of a ViT patch"""
    downsample_ratio: int = 3
    """patches per side of one merged (pixel-unshuffled) cell, which becomes one LLM token"""
    max_image_tokens: int = 1024
    """most placeholder tokens an image may take, START / NEWLINE / END included"""
    min_pixels: int = 544 * 544
    """smaller images are scaled up to about this area (295936)"""
    max_wh_ratio: int | None = None
    """cap on width / height: a wider image is planned as if capped and squeezed onto its canvas; None: no cap"""

    def __post_init__(self):
        positive("vision.patch_size", self.patch_size)
        positive("vision.downsample_ratio", self.downsample_ratio)
        # The smallest image, one merged cell, takes START + IMAGE + NEWLINE + END = 4 tokens; below that even the
        # degenerate plans of step 5 have no room.
        at_least("vision.max_image_tokens", self.max_image_tokens, 4)
        at_least("vision.min_pixels", self.min_pixels, 0)
        if self.max_wh_ratio is not None:
            at_least("vision.max_wh_ratio", self.max_wh_ratio, 1)

    @property
    def cell(self) -> int:
        """pixels per side of a merged cell (42)"""
        return self.patch_size * self.downsample_ratio


DEFAULT_CONFIG = ProcessorConfig()


@dataclass(frozen=True)
class ResizePlan:
    """Where an image of a given size goes (`plan_resize`)."""

    height: int
    width: int
    """the canvas in pixels, multiples of patch_size"""
    grid: tuple[int, int]
    """patches (grid_h, grid_w) = (height, width) / patch_size"""
    merged: tuple[int, int]
    """merged cells (n_h, n_w) = ceil(grid / downsample_ratio): rows and columns of IMAGE placeholders"""
    num_tokens: int
    """placeholder tokens n_h (n_w + 1) + 2"""
    content: tuple[int, int, int, int]
    """(left, top, width, height) of the resized image on the canvas; the rest is gray. The whole canvas when
    squeezed; a zero side when the fitted image rounds to nothing (a sliver in a degenerate plan)."""
    squeeze: bool
    """the image is at least max_wh_ratio times wider than tall: stretched onto the canvas, aspect not kept"""


@dataclass(frozen=True)
class ProcessedImage:
    """What the vision tower takes for one image, and what it costs in the text."""

    pixel_values: torch.Tensor
    """[P, 588] float32, patches row-major over the grid, each patch's (C, p, p) values flattened in that order"""
    grid: tuple[int, int]
    """(grid_h, grid_w) patches: the public `image_grid_thw` without its leading 1"""
    num_tokens: int
    """placeholder tokens the image takes in the text"""


@dataclass(frozen=True)
class PlaceholderLayout:
    """What each of an image's placeholder positions stands for; the model places the image's features by it."""

    kind: torch.Tensor
    """[L] int64: START, IMAGE, NEWLINE or END per placeholder position"""
    group: torch.Tensor
    """[L] int64: for IMAGE positions the merged cell whose features go there, numbered row-major (r * n_w + c)
    over the (n_h, n_w) cells, so the k-th IMAGE position takes cell k; -1 elsewhere"""


@dataclass(frozen=True)
class PackedImages:
    """Variable-size images back to back, as variable-length attention takes them: image i is
    pixel_values[cu_seqlens[i] : cu_seqlens[i + 1]]."""

    pixel_values: torch.Tensor
    """[S, 588] float32"""
    grids: torch.Tensor
    """[N, 2] int64 (grid_h, grid_w) per image"""
    cu_seqlens: torch.Tensor
    """[N + 1] int32 patch offsets, 0 first and S last (the cu_seqlens of flash-attention's varlen functions)"""
    max_seqlen: int
    """patches of the largest image"""
    num_tokens: torch.Tensor
    """[N] int64 placeholder tokens per image"""


def num_image_tokens(merged_h: int, merged_w: int) -> int:
    """START + merged_h rows of (merged_w IMAGE + NEWLINE) + END."""
    return merged_h * (merged_w + 1) + 2


def _merged(height: int, width: int, cfg: ProcessorConfig) -> tuple[int, int]:
    r = cfg.downsample_ratio
    return -(-(height // cfg.patch_size) // r), -(-(width // cfg.patch_size) // r)


def _shrink(height: float, width: float, cfg: ProcessorConfig) -> tuple[int, int]:
    """Step 5: the largest canvas of the image's aspect whose tokens fit max_image_tokens, as (height, width)."""
    budget, cell, p = cfg.max_image_tokens, cfg.cell, cfg.patch_size
    rho = height / width
    w_star = math.sqrt((budget - 2) / rho + 0.25) - 0.5
    h_star = w_star * rho
    if w_star < 1.0:  # thinner than one cell across: a single column
        return (budget - 2) // 2 * cell, cell
    if h_star < 1.0:  # a single row
        return cell, (budget - 3) * cell
    beta = min(math.floor(w_star) * cell / width, math.floor(h_star) * cell / height)
    return math.floor(height * beta / p) * p, math.floor(width * beta / p) * p


def _fit(width: int, height: int, box_w: int, box_h: int) -> tuple[int, int]:
    """The size `ImageOps.contain` gives an image of (width, height) in a (box_w, box_h) box."""
    image_ratio, box_ratio = width / height, box_w / box_h
    if image_ratio > box_ratio:
        return box_w, round(height / width * box_w)
    if image_ratio < box_ratio:
        return round(width / height * box_h), box_h
    return box_w, box_h


def plan_resize(width: int, height: int, cfg: ProcessorConfig = DEFAULT_CONFIG) -> ResizePlan:
    """The canvas, grids and placeholder count of an image of width x height pixels (docs/data.md#the-image-processor,
    steps 1-5).

    ValueError for a non-positive size, or (a float-rounding guard the public code also has) a plan that needs more
    than max_image_tokens."""
    if not (isinstance(width, int) and isinstance(height, int) and width > 0 and height > 0):
        raise ValueError(f"image size must be positive integers, got width={width!r}, height={height!r}")
    p = cfg.patch_size
    w, h = width, height
    squeeze = cfg.max_wh_ratio is not None and width >= cfg.max_wh_ratio * height
    if cfg.max_wh_ratio is not None and w > h * cfg.max_wh_ratio:
        w = h * cfg.max_wh_ratio
    if w * h < cfg.min_pixels:
        scale = (cfg.min_pixels / (w * h)) ** 0.5
        w, h = int(w * scale), int(h * scale)
    canvas_h, canvas_w = -(-h // p) * p, -(-w // p) * p
    merged = _merged(canvas_h, canvas_w, cfg)
    if num_image_tokens(*merged) > cfg.max_image_tokens:
        canvas_h, canvas_w = _shrink(h, w, cfg)
        merged = _merged(canvas_h, canvas_w, cfg)
        if num_image_tokens(*merged) > cfg.max_image_tokens:
            raise ValueError(
                f"image {width}x{height}: the shrunk canvas {canvas_w}x{canvas_h} still takes "
                f"{num_image_tokens(*merged)} placeholder tokens, more than vision.max_image_tokens="
                f"{cfg.max_image_tokens}"
            )
    if squeeze:
        content = (0, 0, canvas_w, canvas_h)
    else:
        fit_w, fit_h = _fit(width, height, canvas_w, canvas_h)
        content = (round((canvas_w - fit_w) / 2), round((canvas_h - fit_h) / 2), fit_w, fit_h)
    return ResizePlan(height=canvas_h, width=canvas_w, grid=(canvas_h // p, canvas_w // p), merged=merged,
                      num_tokens=num_image_tokens(*merged), content=content, squeeze=squeeze)


def process(image: Image.Image, cfg: ProcessorConfig = DEFAULT_CONFIG) -> ProcessedImage:
    """An image's normalised patches [P, 588], its patch grid and its placeholder count
    (docs/data.md#the-image-processor)."""
    image = image.convert("RGB")  # as the public processor: alpha is dropped, not composited
    plan = plan_resize(image.width, image.height, cfg)
    left, top, fit_w, fit_h = plan.content
    canvas = Image.new("RGB", (plan.width, plan.height), (PAD_GRAY,) * 3)
    if fit_w > 0 and fit_h > 0:
        canvas.paste(image.resize((fit_w, fit_h), Image.Resampling.BICUBIC), (left, top))
    p, (grid_h, grid_w) = cfg.patch_size, plan.grid
    x = torch.from_numpy(np.asarray(canvas).copy())  # [H, W, C] uint8
    x = x.float().div_(255).sub_(0.5).div_(0.5)  # the public order: scale, then (x - mean) / std
    x = x.reshape(grid_h, p, grid_w, p, 3).permute(0, 2, 4, 1, 3)  # [grid_h, grid_w, C, p, p]
    return ProcessedImage(pixel_values=x.reshape(grid_h * grid_w, 3 * p * p).contiguous(), grid=plan.grid,
                          num_tokens=plan.num_tokens)


def placeholder_layout(grid: tuple[int, int], downsample_ratio: int = DEFAULT_CONFIG.downsample_ratio
                       ) -> PlaceholderLayout:
    """Kind and merged cell of each placeholder position of an image with a (grid_h, grid_w) patch grid.

    Merged cell (r, c) covers patches [r*k, r*k + k) x [c*k, c*k + k) of the grid (k = downsample_ratio; the last
    row or column of cells is partial where k does not divide the grid)."""
    grid_h, grid_w = grid
    if grid_h <= 0 or grid_w <= 0:
        raise ValueError(f"image grid must be positive, got {grid!r}")
    n_h, n_w = -(-grid_h // downsample_ratio), -(-grid_w // downsample_ratio)
    row_kind = torch.tensor([IMAGE] * n_w + [NEWLINE])
    kind = torch.cat([torch.tensor([START]), row_kind.repeat(n_h), torch.tensor([END])])  # [L]
    group = torch.full_like(kind, -1)
    group[kind == IMAGE] = torch.arange(n_h * n_w)
    return PlaceholderLayout(kind=kind, group=group)


def pack_images(images: Sequence[ProcessedImage]) -> PackedImages:
    """Concatenate the images' patches, with the offsets and grids that separate them again; no padding."""
    if not images:
        raise ValueError("pack_images needs at least one image (a batch without images has nothing to pack)")
    sizes = [im.grid[0] * im.grid[1] for im in images]
    cu = torch.zeros(len(images) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(sizes).cumsum(0)
    return PackedImages(
        pixel_values=torch.cat([im.pixel_values for im in images]),
        grids=torch.tensor([im.grid for im in images], dtype=torch.int64),
        cu_seqlens=cu,
        max_seqlen=max(sizes),
        num_tokens=torch.tensor([im.num_tokens for im in images], dtype=torch.int64),
    )
