"""DeepSeek-ViT (model/vision/): the image side's shapes at odd resolutions (grids of 3x3, 6x9, 9x3, 48x48 patches
and sides that are not multiples of the 3 x 3 unshuffle, 4x5 and 7x22, alone and packed together); a packed batch equals each image run alone (no attention across images), and the
per-image attention equals one attention with a block-diagonal mask (the function a fused varlen kernel replaces);
the pixel-unshuffle moves values exactly where the hand-written loop puts them (zeros for the patches past a partial
block's edge) and is a permutation on whole blocks (its inverse restores the input); the processor's placeholder
count equals the tower's for every size the processor plans (the canvases are multiples of a patch, not of 3); 2-D RoPE makes q.k depend on positions only through the (row, column) offsets, the first half
of each head turning with the row and the second with the column; the placeholder layout has (h/3)(w/3 + 1) + 2
rows per image, START / NEWLINE / END where the processor puts them and the aligned image tokens in the IMAGE slots;
the flagship's tower builds on the meta device with the parameters model.accounting.vision_parameters counts and the
closed-form count gives (and a tp rank's part of them, by the tower's tensor-parallel plan); a gradient reaches every parameter; conf/model/v41_tiny_mm.yaml is v41_tiny plus the
tower; bad grids and settings are refused naming the setting."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from model.accounting import vision_parameters
from model.config import ModelConfig, VisionConfig
from model.rope import apply_rope
from model.vision import (VisionEncoder, image_token_count, layout, patch_positions, pixel_unshuffle,
                          rope_2d_tables, varlen_attention)
from tests.helpers import load_config
from trainer.parallel.tensor import vision_shard_dims

MIX = [(3, 3), (6, 9), (9, 3), (12, 6)]


def _encoder(cfg: ModelConfig, seed: int = 0) -> VisionEncoder:
    """Built on meta, materialised on CPU, initialised: the trainer's order."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        v = VisionEncoder(cfg.vision, cfg.dim, cfg.init_std)
    v.to_empty(device="cpu")
    v.init_weights()
    return v


@pytest.fixture(scope="module")
def tiny_mm():
    cfg = load_config("v41_tiny_mm")
    return cfg, _encoder(cfg)


def _pixels(grids, seed=1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(h * w for h, w in grids), 3 * 14 * 14, generator=g)


def _cells(n: int) -> int:
    return -(-n // 3)


@pytest.mark.parametrize("grids", [[(3, 3)], [(6, 9)], [(9, 3)], [(48, 48)], [(4, 5)], [(7, 22)],
                                   [(3, 3), (48, 48), (7, 22), (6, 9), (1, 1), (9, 3)]],
                         ids=["3x3", "6x9", "9x3", "48x48", "4x5", "7x22", "mix"])
def test_shapes_at_odd_resolutions(tiny_mm, grids):
    cfg, v = tiny_mm
    pixels = _pixels(grids)
    tokens = v.image_features(pixels, grids)
    assert tokens.shape == (sum(_cells(h) * _cells(w) for h, w in grids), cfg.dim)
    out = v(pixels, grids)
    assert out.shape == (sum(_cells(h) * (_cells(w) + 1) + 2 for h, w in grids), cfg.dim)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_packed_batch_equals_each_image_alone(tiny_mm):
    _, v = tiny_mm
    pixels = _pixels(MIX)
    with torch.no_grad():
        packed = v(pixels, MIX).split([image_token_count(g, 3) for g in MIX])
        alone = [v(p, [g]) for p, g in zip(pixels.split([h * w for h, w in MIX]), MIX)]
    for a, b in zip(packed, alone):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_varlen_attention_is_block_diagonal_attention():
    """The per-image loop equals one attention over the packed rows with a block-diagonal mask."""
    seqlens = [h * w for h, w in MIX]
    q, k, v = torch.randn(3, sum(seqlens), 4, 16).unbind(0)
    image = torch.repeat_interleave(torch.arange(len(seqlens)), torch.tensor(seqlens))
    mask = image[:, None] == image[None, :]  # [N, N] True inside an image
    want = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          attn_mask=mask).transpose(0, 1)
    torch.testing.assert_close(varlen_attention(q, k, v, seqlens), want, rtol=1e-5, atol=1e-6)


def _unshuffle_loop(x, grids, u):
    """The hand-written pixel-unshuffle: token (i, j) = patches (u i + a, u j + b), a then b, each C channels."""
    rows, offset, zero = [], 0, torch.zeros(x.shape[1], dtype=x.dtype)
    for h, w in grids:
        for i in range(-(-h // u)):
            for j in range(-(-w // u)):
                rows.append(torch.cat([x[offset + (u * i + a) * w + (u * j + b)] if u * i + a < h and u * j + b < w
                                       else zero for a in range(u) for b in range(u)]))
        offset += h * w
    return torch.stack(rows)


def _shuffle(y, grids, u):
    """The inverse: [M, u^2 C] -> [N, C], each image's patches row-major again."""
    C, out = y.shape[1] // (u * u), []
    for (h, w), yi in zip(grids, y.split([(h // u) * (w // u) for h, w in grids])):
        out.append(yi.reshape(h // u, w // u, u, u, C).permute(0, 2, 1, 3, 4).reshape(h * w, C))
    return torch.cat(out)


def test_pixel_unshuffle_exact_and_a_permutation():
    grids = MIX + [(15, 3)]
    n = sum(h * w for h, w in grids)
    x = torch.randn(n, 5)
    y = pixel_unshuffle(x, grids, 3)
    assert torch.equal(y, _unshuffle_loop(x, grids, 3))
    assert torch.equal(_shuffle(y, grids, 3), x)
    ids = torch.arange(n * 5, dtype=torch.float64).reshape(n, 5)  # every value once: a permutation moves, never mixes
    assert torch.equal(pixel_unshuffle(ids, grids, 3).flatten().sort().values, ids.flatten())
    odd = [(4, 5), (1, 1), (7, 22)]  # partial blocks: the hand-written loop's zeros past the edges, every patch once
    x = torch.arange(1, 1 + sum(h * w for h, w in odd) * 2, dtype=torch.float64).reshape(-1, 2)
    y = pixel_unshuffle(x, odd, 3)
    assert torch.equal(y, _unshuffle_loop(x, odd, 3))
    assert torch.equal(y.flatten()[y.flatten() != 0].sort().values, x.flatten())


def test_processor_and_tower_agree_on_placeholders():
    """Every size the processor plans: its num_tokens = the tower's image_token_count of its patch grid."""
    from data.vision.processor import ProcessorConfig, plan_resize

    for cfg in (ProcessorConfig(), ProcessorConfig(min_pixels=168 * 168)):
        for width in range(20, 2000, 37):
            for height in range(20, 2000, 53):
                plan = plan_resize(width, height, cfg)
                assert plan.num_tokens == image_token_count(plan.grid, 3), (width, height, plan)


def _score(q, k, pq, pk, head_dim=16, theta=1e4):
    cos, sin = rope_2d_tables(torch.tensor([pq, pk]), head_dim, theta)
    rq = apply_rope(q[None, None, None], cos[:1], sin[:1])[0, 0, 0]
    rk = apply_rope(k[None, None, None], cos[1:], sin[1:])[0, 0, 0]
    return (rq.double() @ rk.double()).item()


def test_rope_2d_depends_on_relative_offsets_only():
    torch.manual_seed(0)
    q, k = torch.randn(2, 16).unbind(0)
    for pq, pk in [((0, 0), (2, 5)), ((7, 1), (3, 3)), ((40, 2), (1, 30))]:
        base = _score(q, k, pq, pk)
        for dr, dc in [(1, 0), (0, 1), (5, 9), (30, 17)]:
            shifted = _score(q, k, (pq[0] + dr, pq[1] + dc), (pk[0] + dr, pk[1] + dc))
            assert shifted == pytest.approx(base, rel=1e-5, abs=1e-5)
        # both axes matter: moving only the row, or only the column, of the key changes the score
        assert _score(q, k, pq, (pk[0] + 1, pk[1])) != pytest.approx(base, rel=1e-3)
        assert _score(q, k, pq, (pk[0], pk[1] + 1)) != pytest.approx(base, rel=1e-3)


def test_rope_2d_split_rows_then_columns():
    """Channels [0, Dh/2) turn with the row only, [Dh/2, Dh) with the column only, each a 1-D RoPE of dim Dh/2."""
    x = torch.randn(1, 1, 1, 16)
    cos, sin = rope_2d_tables(torch.tensor([[3, 0], [3, 7], [0, 7]]), 16, 1e4)
    rot = [apply_rope(x, cos[i:i + 1], sin[i:i + 1])[0, 0, 0] for i in range(3)]
    assert torch.equal(rot[0][:8], rot[1][:8]) and torch.equal(rot[1][8:], rot[2][8:])
    assert torch.equal(rot[2][:8], x[0, 0, 0, :8]) and torch.equal(rot[0][8:], x[0, 0, 0, 8:])
    inv_freq = 1e4 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    torch.testing.assert_close(cos[1, :4], (3 * inv_freq).cos().float())
    torch.testing.assert_close(cos[1, 4:], (7 * inv_freq).cos().float())


def test_patch_positions_row_major():
    assert patch_positions([(2, 3), (3, 3)]).tolist()[:8] == [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2],
                                                             [0, 0], [0, 1]]


def test_layout_places_the_image_tokens(tiny_mm):
    _, v = tiny_mm
    grids = [(6, 9), (3, 3), (9, 3), (4, 5)]
    pixels = _pixels(grids)
    with torch.no_grad():
        tokens = v.image_features(pixels, grids).split([_cells(h) * _cells(w) for h, w in grids])
        seqs = v(pixels, grids).split([image_token_count(g, 3) for g in grids])
    start, newline, end = v.image_start.detach(), v.image_newline.detach(), v.image_end.detach()
    for (h, w), t, s in zip(grids, tokens, seqs):
        rows, cols = _cells(h), _cells(w)
        assert len(s) == rows * (cols + 1) + 2 == image_token_count((h, w), 3)
        assert torch.equal(s[0], start) and torch.equal(s[-1], end)
        for r in range(rows):
            first = 1 + r * (cols + 1)  # the row's first IMAGE slot
            assert torch.equal(s[first:first + cols], t[r * cols:(r + 1) * cols])
            assert torch.equal(s[first + cols], newline)
    # the function itself, on marked vectors
    marks = layout(torch.arange(1, 7.)[:, None], [(6, 9)], 3, torch.tensor([-1.]), torch.tensor([0.]),
                   torch.tensor([-2.]))
    assert marks.flatten().tolist() == [-1, 1, 2, 3, 0, 4, 5, 6, 0, -2]


def test_flagship_counted_on_meta():
    cfg = load_config("v41_flash")
    vc = cfg.vision
    assert (vc.num_layers, vc.dim, vc.num_heads, vc.patch, vc.unshuffle, vc.rope_theta) == (32, 1024, 16, 14, 3, 1e4)
    with torch.device("meta"):
        v = VisionEncoder(vc, cfg.dim, cfg.init_std)
    assert all(p.is_meta for p in v.parameters())
    C, F_, D = vc.dim, vc.mlp_dim, cfg.dim
    per_layer = 4 * C * C + 3 * C * F_ + 2 * C  # wq wk wv wo, w1 w3 w2, two norms
    vit = 588 * C + vc.num_layers * per_layer + C
    aligner = 9 * C * D + D * D
    counts = vision_parameters(cfg)
    assert counts == {"params_vision": vit + aligner + 3 * D, "params_vision_vit": vit,
                      "params_vision_aligner": aligner}
    assert sum(p.numel() for p in v.parameters()) == counts["params_vision"] == 610_955_264
    assert 0.3e9 < counts["params_vision"] < 0.7e9
    # one of 8 tensor-parallel ranks: everything split but the patch embedding, the norms and the three vectors
    replicated = 588 * C + (2 * vc.num_layers + 1) * C + 3 * D
    per_rank = vision_parameters(cfg, tp=8, shard_dims=vision_shard_dims)["params_vision_per_tp_rank"]
    assert per_rank == (counts["params_vision"] - replicated) // 8 + replicated == 76_967_936


def test_gradient_reaches_every_parameter():
    cfg = load_config("v41_tiny_mm")
    v = _encoder(cfg, seed=3)
    grids = [(6, 9), (3, 3)]
    out = v(_pixels(grids), grids)
    (out * torch.randn_like(out)).sum().backward()
    for name, p in v.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_bf16_autocast(tiny_mm):
    _, v = tiny_mm
    grids = [(6, 9), (3, 3)]
    pixels = _pixels(grids)
    with torch.no_grad():
        want = v(pixels, grids)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = v(pixels, grids)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.05)


def test_tiny_mm_is_tiny_plus_a_tower():
    tiny, mm = dataclasses.asdict(load_config("v41_tiny")), dataclasses.asdict(load_config("v41_tiny_mm"))
    assert mm["image_token_id"] == mm["vocab_size"] - 1  # the last id, reserved as the image placeholder
    assert tiny["vision"]["num_layers"] == 0 and mm["vision"]["num_layers"] > 0
    for key in ("name", "image_token_id", "vision"):
        tiny.pop(key), mm.pop(key)
    assert tiny == mm


def test_text_only_by_default():
    cfg = ModelConfig()
    assert cfg.vision.num_layers == 0 and vision_parameters(cfg) == {}
    with pytest.raises(ValueError, match="model.vision.num_layers is 0"):
        VisionEncoder(cfg.vision, cfg.dim, cfg.init_std)


@pytest.mark.parametrize("grids, n, key", [
    ([(0, 3)], 0, "each side must be at least one patch"),
    ([(3, 0)], 0, "each side must be at least one patch"),
    ([(96, 96)], 96 * 96, "model.vision.max_tokens=1024"),  # 32 x 33 + 2 = 1058 tokens
    ([(3, 3)], 10, "pixel_values has 10 patches"),
])
def test_bad_grids_are_refused(tiny_mm, grids, n, key):
    _, v = tiny_mm
    with pytest.raises(ValueError, match=key):
        v(torch.zeros(n, 588), grids)


def test_bad_settings_are_refused(tiny_mm):
    _, v = tiny_mm
    with pytest.raises(ValueError, match=r"model.vision.patch=14"):
        v(torch.zeros(9, 3 * 16 * 16), [(3, 3)])
    with pytest.raises(ValueError, match="model.vision.num_heads=3"):
        VisionConfig(num_layers=1, dim=64, num_heads=3)
    with pytest.raises(ValueError, match="model.vision.num_heads=8"):
        VisionConfig(num_layers=1, dim=48, num_heads=8)  # head dim 6: the row's and the column's halves are odd
    with pytest.raises(ValueError, match="model.vision.num_layers must be >= 0, got -1"):
        VisionConfig(num_layers=-1)
