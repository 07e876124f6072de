"""DeepSeek-ViT and its aligner (SPEC 1.6, REFERENCE A12): images of any size, packed without padding, to the
backbone-width embeddings that replace an image's placeholder tokens.

Shape legend: I images, (h_i, w_i) image i's grid in patches, P_i = h_i w_i, N = sum P_i patches, u the unshuffle
factor, M image tokens, T placeholder tokens, C the ViT width, H heads, Dh = C / H, D the backbone width, K = 588.

Contract: `VisionEncoder(pixel_values [N, K], grids [(h_i, w_i)])` -> [T, D]: the patch embedding, `num_layers`
pre-norm blocks attending within each image only (`varlen_attention`, 2-D RoPE on q and k: `rope_2d_tables`), a
final norm, `pixel_unshuffle` by u, the `Aligner` MLP, and the `layout` with the learned START / NEWLINE / END
vectors. `check_grids` / `VisionEncoder.check` refuse grids that do not match the pixels; `image_token_count` gives
an image's placeholder count.

Design and reasoning: docs/model.md#the-vision-tower
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.common import RMSNorm, init_linear, init_normal, linear, local
from model.config import VisionConfig
from model.moe import SharedExpert
from model.rope import apply_rope

__all__ = ["VisionEncoder", "ViT", "Aligner", "image_token_count", "patch_positions", "rope_2d_tables",
           "varlen_attention", "pixel_unshuffle", "layout"]

CHANNELS = 3
"""RGB: the processor's patches are (3, patch, patch) blocks"""

Grid = tuple[int, int]


def merged_grid(grid: Grid, unshuffle: int) -> Grid:
    """(ceil(h / u), ceil(w / u)): the image tokens' rows and columns of an image of `grid` = (h, w) patches (a
    partial u x u block at the bottom or right edge is one token, its missing patches zero: `pixel_unshuffle`)."""
    return -(-grid[0] // unshuffle), -(-grid[1] // unshuffle)


def image_token_count(grid: Grid, unshuffle: int) -> int:
    """Placeholder tokens of an image of `grid` = (h, w) patches: START + ceil(h/u) rows of (ceil(w/u) IMAGE +
    NEWLINE) + END (REFERENCE A12 step 4)."""
    h, w = merged_grid(grid, unshuffle)
    return h * (w + 1) + 2


def check_grids(cfg: VisionConfig, grids, num_patches: int) -> list[Grid]:
    """`grids` as (h, w) ints; ValueError unless every grid is positive and within model.vision.max_tokens and the
    grids cover exactly the `num_patches` rows of pixel_values."""
    grids = [(int(h), int(w)) for h, w in grids]
    u = cfg.unshuffle
    for h, w in grids:
        if h <= 0 or w <= 0:
            raise ValueError(f"image grid {h} x {w} patches: each side must be at least one patch "
                             f"(model.vision.unshuffle={u} patches per side make one image token)")
        if image_token_count((h, w), u) > cfg.max_tokens:
            raise ValueError(f"image grid {h} x {w} patches takes {image_token_count((h, w), u)} tokens, more than "
                             f"model.vision.max_tokens={cfg.max_tokens} (the processor shrinks such an image)")
    if sum(h * w for h, w in grids) != num_patches:
        raise ValueError(f"pixel_values has {num_patches} patches, the grids {list(grids)} make "
                         f"{sum(h * w for h, w in grids)}")
    return grids


def patch_positions(grids: list[Grid], device=None) -> torch.Tensor:
    """[N, 2] int64 (row, column) of every patch in its own image, row-major per image, images in order."""
    pos = [torch.stack(torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device),
                                      indexing="ij"), dim=-1).reshape(h * w, 2) for h, w in grids]
    return torch.cat(pos)


def rope_2d_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [N, 2] (row, column) -> cos, sin [N, Dh/2] fp32: pair columns [0, Dh/4) turn by the row, [Dh/4,
    Dh/2) by the column, each axis a 1-D RoPE of dimension Dh/2 (the convention of docs/model.md#the-vision-tower)."""
    axis_dim = head_dim // 2
    inv_freq = theta ** (-torch.arange(0, axis_dim, 2, dtype=torch.float64, device=positions.device) / axis_dim)
    angles = positions.to(torch.float32)[..., None] * inv_freq.float()  # [N, 2, Dh/4]
    angles = angles.flatten(-2)  # [N, Dh/2]: the row's angles, then the column's
    return angles.cos(), angles.sin()


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens: list[int]) -> torch.Tensor:
    """q, k, v [N, H, Dh], the images' rows one after the other (`seqlens` rows each) -> [N, H, Dh]: every row
    attends to all rows of its own image and to no other (block-diagonal, bidirectional; scale 1 / sqrt(Dh)).

    The reference: one scaled_dot_product_attention per image, neither an [N, N] mask nor padding to the largest
    image. A fused variable-length kernel computes the same function in one launch (FlashAttention's varlen
    interface: cu_seqlens = [0, cumsum(seqlens)], max_seqlen = max(seqlens), causal off) and can replace this
    function under the same signature."""
    out = []
    for qi, ki, vi in zip(q.split(seqlens), k.split(seqlens), v.split(seqlens)):
        out.append(F.scaled_dot_product_attention(qi.transpose(0, 1), ki.transpose(0, 1),
                                                  vi.transpose(0, 1)).transpose(0, 1))  # [P_i, H, Dh]
    return torch.cat(out)


def pixel_unshuffle(x: torch.Tensor, grids: list[Grid], factor: int) -> torch.Tensor:
    """x [N, C] (each image's patches row-major over its grid) -> [M, u^2 C] (each image's tokens row-major over its
    [ceil(h/u), ceil(w/u)] grid of u x u blocks). Token (i, j) of an image concatenates the patches (u i + a, u j + b)
    in the order a = 0 .. u-1, b = 0 .. u-1 (row-major over the block): channels [(a u + b) C, (a u + b + 1) C) hold
    patch (u i + a, u j + b), zeros where that patch lies past the grid's bottom or right edge (a side that is not a
    multiple of u: the processor's canvases are multiples of the patch, not of u patches; DeepSeek-VL2's projector
    pads the same way). Otherwise a permutation of x's values, no arithmetic."""
    u, C = factor, x.shape[-1]
    out = []
    for (h, w), xi in zip(grids, x.split([h * w for h, w in grids])):
        rows, cols = merged_grid((h, w), u)
        xi = xi.reshape(h, w, C)
        if (rows * u, cols * u) != (h, w):
            xi = F.pad(xi, (0, 0, 0, cols * u - w, 0, rows * u - h))  # zeros below and to the right
        blocks = xi.reshape(rows, u, cols, u, C).permute(0, 2, 1, 3, 4)  # [r, c, a, b, C]
        out.append(blocks.reshape(rows * cols, u * u * C))
    return torch.cat(out)


def layout(tokens: torch.Tensor, grids: list[Grid], unshuffle: int, start: torch.Tensor, newline: torch.Tensor,
           end: torch.Tensor) -> torch.Tensor:
    """tokens [M, D] (each image's row-major) and the START / NEWLINE / END vectors [D] -> [T, D], each image's
    T_i = image_token_count(grid, u) rows in the processor's placeholder layout (REFERENCE A12): START, then per row
    of image tokens the row's tokens and NEWLINE, then END; the images one after the other, so
    out.split([image_token_count(g, u) for g in grids]) gives each image's sequence."""
    out = []
    merged = [merged_grid(g, unshuffle) for g in grids]
    for (rows, cols), t in zip(merged, tokens.split([r * c for r, c in merged])):
        body = torch.cat((t.reshape(rows, cols, -1), newline.expand(rows, 1, -1)), dim=1)  # [rows, cols + 1, D]
        out += [start[None], body.reshape(rows * (cols + 1), -1), end[None]]
    return torch.cat(out)


class Attention(nn.Module):
    """Multi-head self-attention inside each image, 2-D RoPE on q and k, no bias."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.dim // cfg.num_heads
        self.wq, self.wk, self.wv, self.wo = (linear(cfg.dim, cfg.dim) for _ in range(4))

    def init_weights(self, std: float) -> None:
        for lin in (self.wq, self.wk, self.wv, self.wo):
            init_linear(lin, std)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seqlens: list[int]) -> torch.Tensor:
        """x [N, C], cos/sin [N, Dh/2] -> [N, C]."""
        heads = (-1, self.head_dim)  # H, or this rank's H / tp heads under tensor parallelism
        q, k, v = (w(x).unflatten(-1, heads) for w in (self.wq, self.wk, self.wv))  # [N, H, Dh]
        q, k = (apply_rope(t[None], cos, sin)[0] for t in (q, k))  # apply_rope takes [B, T, H, D]
        return self.wo(varlen_attention(q, k, v, seqlens).flatten(-2))


class ViTBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        # The bias-free SwiGLU MLP (w1 gate, w3 up, w2 down) the backbone's shared expert is; limit 0 turns off the
        # backbone's SwiGLU clamp (REFERENCE A7), which nothing prescribes for the ViT.
        self.mlp = SharedExpert(cfg.dim, cfg.mlp_dim, swiglu_limit=0.0)

    def init_weights(self, std: float) -> None:
        self.attn_norm.init_weights()
        self.attn.init_weights(std)
        self.mlp_norm.init_weights()
        self.mlp.init_weights(std)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seqlens: list[int]) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, seqlens)
        return x + self.mlp(self.mlp_norm(x))


class ViT(nn.Module):
    """Patch embedding, the blocks, the final norm: pixel_values [N, K] -> [N, C]."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = linear(CHANNELS * cfg.patch * cfg.patch, cfg.dim)
        self.layers = nn.ModuleList(ViTBlock(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def init_weights(self, std: float) -> None:
        init_linear(self.patch_embed, std)
        for layer in self.layers:
            layer.init_weights(std)
        self.norm.init_weights()

    def forward(self, pixel_values: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        cfg = self.cfg
        cos, sin = rope_2d_tables(patch_positions(grids, pixel_values.device), cfg.dim // cfg.num_heads,
                                  cfg.rope_theta)
        seqlens = [h * w for h, w in grids]
        x = self.patch_embed(pixel_values)
        for layer in self.layers:
            x = layer(x, cos, sin, seqlens)
        return self.norm(x)


class Aligner(nn.Module):
    """Image tokens [M, u^2 C] -> the backbone's width [M, D]: Linear, GELU, Linear (an assumption: see the module
    docstring)."""

    def __init__(self, in_dim: int, dim: int):
        super().__init__()
        self.w1 = linear(in_dim, dim)
        self.w2 = linear(dim, dim)

    def init_weights(self, std: float) -> None:
        init_linear(self.w1, std)
        init_linear(self.w2, std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class VisionEncoder(nn.Module):
    """The ViT, the aligner and the START / NEWLINE / END vectors of a model whose backbone is `dim` wide.

    `forward(pixel_values, grids)` -> [T, D]: every image's placeholder embeddings in the processor's layout, which
    the backbone puts in place of the image's placeholder tokens (in order); `image_features` -> [M, D]: the aligned
    image tokens alone. Build on meta, `to_empty`, then `init_weights()`, as the backbone."""

    def __init__(self, cfg: VisionConfig, dim: int, init_std: float):
        super().__init__()
        if cfg.num_layers == 0:
            raise ValueError("model.vision.num_layers is 0: this model has no vision tower")
        self.cfg, self.init_std = cfg, init_std
        self.vit = ViT(cfg)
        self.aligner = Aligner(cfg.unshuffle ** 2 * cfg.dim, dim)
        self.image_start = nn.Parameter(torch.empty(dim))
        self.image_newline = nn.Parameter(torch.empty(dim))
        self.image_end = nn.Parameter(torch.empty(dim))

    def init_weights(self) -> None:
        std = self.init_std
        self.vit.init_weights(std)
        self.aligner.init_weights(std)
        for p in (self.image_start, self.image_newline, self.image_end):
            init_normal(p, std)  # they stand where token embeddings stand: the embedding's init

    def check(self, pixel_values: torch.Tensor, grids) -> list[Grid]:
        """`grids` as (h, w) ints after checking them and pixel_values' shape (ValueError naming the setting)."""
        cfg = self.cfg
        if pixel_values.dim() != 2 or pixel_values.shape[1] != CHANNELS * cfg.patch ** 2:
            raise ValueError(f"pixel_values has shape {list(pixel_values.shape)}, expected [patches, "
                             f"{CHANNELS * cfg.patch ** 2}] ({CHANNELS} x model.vision.patch={cfg.patch} squared)")
        return check_grids(cfg, grids, pixel_values.shape[0])

    def image_features(self, pixel_values: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        """pixel_values [N, K], grids [(h_i, w_i)] -> [M, D], each image's tokens row-major over its [r, c] grid."""
        grids = self.check(pixel_values, grids)
        return self.aligner(pixel_unshuffle(self.vit(pixel_values, grids), grids, self.cfg.unshuffle))

    def forward(self, pixel_values: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        """pixel_values [N, K], grids [(h_i, w_i)] -> [T, D] (`layout`)."""
        grids = self.check(pixel_values, grids)  # as ints, for the layout (image_features checks again: host ints)
        tokens = self.image_features(pixel_values, grids)
        dtype = tokens.dtype  # the learned vectors join the aligner's output (bf16 under autocast)
        start, newline, end = (local(p).to(dtype) for p in (self.image_start, self.image_newline, self.image_end))
        return layout(tokens, grids, self.cfg.unshuffle, start, newline, end)
