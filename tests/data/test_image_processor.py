"""The V4.1 image processor (data/vision/processor.py) against REFERENCE A12 and the public processor.

Where the expected numbers come from:
- `HAND`: derived by hand from the A12 steps (the arithmetic of five is written out next to them), and checked with
  exact rational arithmetic (no float), which gives the same canvases for every size of the table.
- `PUBLIC`: the merged grid (n_h, n_w) and token count that the public processor, deepseek-ai/DeepSeek-V4.1-Flash
  `inference/image_processor.py` at revision dba1be0a40aa45a94ad051997016db3960a90277 (sha256 4827...2f9272, with its
  config.json: patch 14, downsample 3, max_image_tokens 1024, min_pixels 295936, max_wh_ratio null), returned when
  run under torch 2.8.0 / Pillow 11.3.0 on 162 sizes: the boundary sizes and 120 seeded random sizes of the sweep
  recorded in github.com/xbzb404/dsh-context-compression-selector, packages/runtime/tests/fixtures/
  vision-official-sweep.json. The public file itself is not on PyPI (transformers 5.25 has no DeepSeek-V4 image
  processor) and could not be downloaded here, so these recorded outputs are the comparison.

The rest of what it proves: docs/testing.md#the-image-processor
"""

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from data.vision import processor
from data.vision.processor import (
    END,
    IMAGE,
    NEWLINE,
    START,
    ProcessorConfig,
    pack_images,
    placeholder_layout,
    plan_resize,
    process,
)

# (width, height) -> (canvas height, canvas width, placeholder tokens)
HAND = {
    # tiny: 100 px < 544^2, scale sqrt(295936/100) = 54.4 -> 544 x 544 (543 if the float falls short: the same
    # canvas); ceil(544/14) = 39 -> 546; merged ceil(39/3) = 13; tokens 13 * 14 + 2 = 184.
    (10, 10): (546, 546, 184),
    (1, 1): (546, 546, 184),
    (544, 544): (546, 546, 184),  # 544^2 is not < min_pixels: no scaling; 39 patches, 13 cells
    # very wide: 100000 px < 544^2, scale sqrt(2.95936) = 1.72028 -> 3440 x 86 (int(3440.56), int(86.01));
    # ceil(3440/14) = 246 -> 3444, ceil(86/14) = 7 -> 98; merged (ceil(7/3), ceil(246/3)) = (3, 82);
    # tokens 3 * 83 + 2 = 251.
    (2000, 50): (98, 3444, 251),
    (50, 2000): (3444, 98, 330),  # the transpose: merged (82, 3), 82 * 4 + 2
    (30, 3000): (5446, 56, 392),  # scale 1.8133 -> 54 x 5440; 389 x 4 patches; merged (130, 2)
    # odd: 307039 px >= 544^2, no scaling; ceil(641/14) = 46 -> 644, ceil(479/14) = 35 -> 490;
    # merged (ceil(35/3), ceil(46/3)) = (12, 16); tokens 12 * 17 + 2 = 206.
    (641, 479): (490, 644, 206),
    (479, 641): (644, 490, 210),
    # odd and scaled up: 258741 px, scale sqrt(295936 / 258741) = 1.06946 -> int(356.13) x int(830.97) = 356 x 830;
    # ceil(356/14) = 26 -> 364, ceil(830/14) = 60 -> 840; merged (ceil(60/3), ceil(26/3)) = (20, 9); 20 * 10 + 2.
    (333, 777): (840, 364, 202),
    (300, 200): (448, 672, 189),  # scale 2.2209 -> 666 x 444; grid (32, 48); merged (11, 16)
    (997, 13): (70, 4774, 232),  # scale 4.7784 -> 4764 x 62; grid (5, 341); merged (2, 114)
    (1024, 1024): (1036, 1036, 652),  # 74 patches, 25 cells: 25 * 26 + 2, under the budget
    # square over the budget: 96 x 96 patches, 32 cells, 32 * 33 + 2 = 1058 > 1024. Shrink, rho = 1:
    # w* = sqrt(1022 + 1/4) - 1/2 = 31.47, h* = 31.47; beta = 31 * 42 / 1344 = 0.96875;
    # side = floor(1344 * 0.96875 / 14) * 14 = 93 * 14 = 1302; 31 cells; tokens 31 * 32 + 2 = 994.
    (1344, 1344): (1302, 1302, 994),
    # 4:3 over the budget: 286 x 215 patches, merged (72, 96), 72 * 97 + 2 = 6986 > 1024. Shrink, rho = 0.75:
    # w* = sqrt(1022 / 0.75 + 1/4) - 1/2 = 36.42, h* = 27.31; beta = min(36 * 42 / 4000, 27 * 42 / 3000) = 0.378;
    # W = floor(4000 * 0.378 / 14) * 14 = 108 * 14 = 1512, H = 81 * 14 = 1134; merged (27, 36); 27 * 37 + 2 = 1001.
    (4000, 3000): (1134, 1512, 1001),
    (1600, 1200): (1134, 1512, 1001),
    # degenerate, one row: scaled to 172026 x 1, h* = 13259 / 172026 < 1 -> (42, 1021 * 42); 1 * 1022 + 2 = 1024.
    (100000, 1): (42, 42882, 1024),
    # degenerate, one column: w* = sqrt(1022 / 172026 + 1/4) - 1/2 = 0.006 < 1 -> (511 * 42, 42); 511 * 2 + 2.
    (1, 100000): (21462, 42, 1024),
}

# The public processor's (width height n_h n_w tokens) on 162 sizes (module docstring).
PUBLIC = """
1 1 13 13 184; 2 3 16 11 194; 13 13 13 13 184; 13 14 14 13 198; 14 14 13 13 184; 15 15 13 13 184
27 28 14 13 198; 28 14 10 19 202; 8 8 13 13 184; 543 544 13 13 184; 544 544 13 13 184; 545 545 13 13 184
100 100 13 13 184; 147 147 13 13 184; 224 224 13 13 184; 240 180 12 15 194; 180 240 15 12 197
320 240 12 15 194; 384 384 13 13 184; 512 384 12 15 194; 512 512 13 13 184; 640 480 12 16 206
800 600 15 20 317; 1024 768 19 25 496; 768 1024 25 19 502; 1024 1024 25 25 652; 1280 960 23 31 738
1600 1200 27 36 1001; 2000 2000 31 31 994; 2048 1536 27 36 1001; 4000 3000 27 36 1001
4096 4096 31 31 994; 1414 1414 31 31 994; 4 400 130 2 392; 400 4 2 130 264; 64 512 37 5 224
1152 128 5 39 202; 1024 119 5 38 197; 4200 100 3 100 305; 100 4200 100 3 402; 10000 10 1 410 413
10 10000 410 1 822; 2653 1236 21 45 968; 3235 396 10 78 792; 594 4390 81 11 974; 772 2996 58 15 930
4775 476 10 100 1012; 4157 1759 20 47 962; 308 705 20 9 202; 3553 3426 30 31 962; 573 1972 47 14 707
744 4515 73 12 951; 3478 485 12 83 1010; 4633 1015 14 64 912; 1829 4776 50 19 1002; 507 4728 84 9 842
4797 3250 25 37 952; 407 1812 44 10 486; 382 4561 96 8 866; 1091 2373 46 21 1014; 3434 1182 18 52 956
4430 965 14 64 912; 4677 2528 23 42 991; 4590 1481 17 53 920; 845 4765 68 12 886; 4680 1540 18 55 1010
3051 799 16 61 994; 4488 515 10 87 882; 4624 489 10 95 962; 1688 4067 48 20 1010; 4356 3503 28 35 1010
2574 3815 37 25 964; 4797 3713 27 35 974; 2963 2456 28 34 982; 2036 1473 26 36 964; 2000 671 16 48 786
4706 2460 22 42 948; 4303 4056 30 32 992; 2814 3677 35 27 982; 2359 4989 45 21 992; 600 968 24 15 386
4194 3426 28 34 982; 1352 2803 44 21 970; 1246 4006 55 17 992; 3455 322 8 83 674; 636 4572 79 11 950
4695 2571 23 42 991; 2787 2869 31 30 963; 4870 4069 28 34 982; 4751 3738 27 34 947; 564 767 19 14 287
2212 3884 41 23 986; 533 498 13 14 197; 2537 4735 41 22 945; 3651 2332 25 39 1002; 3161 2843 29 32 959
185 3783 91 5 548; 2912 1377 21 45 968; 960 4045 63 15 1010; 483 1788 43 12 561; 2355 1060 21 47 1010
2029 3260 39 24 977; 3203 4068 34 27 954; 661 1363 33 16 563; 3680 3291 29 33 988; 4502 2277 22 44 992
1122 3527 54 17 974; 4508 2281 22 44 992; 3403 2940 29 33 988; 3117 1891 24 40 986; 1237 680 17 30 529
1444 1240 29 34 1017; 1901 1912 31 31 994; 99 3973 95 3 382; 4827 1494 17 55 954; 2153 2310 32 30 994
34 1194 77 3 310; 3433 4380 35 27 982; 3025 4996 40 24 1002; 4640 2611 23 41 968; 1029 4223 62 15 994
443 3741 85 10 937; 4582 3215 26 37 990; 3261 3269 31 31 994; 3229 849 16 61 994; 3945 3281 28 34 982
510 1562 38 13 534; 552 1711 41 14 617; 3610 1330 19 52 1009; 901 2786 53 17 956; 4922 431 9 103 938
839 2 1 266 269; 4644 1240 16 60 978; 4396 832 13 69 912; 2979 209 5 71 362; 577 1704 41 14 617
3083 1217 19 48 933; 2067 2846 36 26 974; 4934 2984 24 40 986; 3885 1007 16 62 1010; 945 3999 63 15 1010
3818 3936 31 30 963; 3964 2555 25 39 1002; 704 1181 29 17 524; 838 2807 54 16 920; 2169 3921 42 23 1010
1323 4230 55 17 992; 190 1682 41 5 248; 4328 2964 26 38 1016; 1201 4450 59 16 1005; 222 4327 104 6 730
2442 746 17 56 971; 2140 4247 44 22 1014; 3005 1369 21 46 989; 2914 1826 24 38 938; 4363 4437 31 31 994
4119 2701 25 38 977; 1828 1599 29 33 988; 1962 3283 40 24 1002; 1858 1638 29 33 988; 4241 4037 30 32 992
2913 238 6 70 428
"""

PAD = (torch.tensor(127.0) / 255 - 0.5) / 0.5
"""the gray pad after normalisation, in float32 arithmetic as the processor does it: -1/255 to within a rounding"""
ODD_SIZES = [(641, 479), (479, 641), (10, 10), (2000, 50), (61, 397), (997, 13), (3, 1000)]


def _noise(width, height, seed=0):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def _canvas(pixel_values, grid):
    """[P, 588] patches -> the [H, W, 3] canvas they were cut from."""
    gh, gw = grid
    return pixel_values.reshape(gh, gw, 3, 14, 14).permute(0, 3, 1, 4, 2).reshape(gh * 14, gw * 14, 3)


@pytest.mark.parametrize("size", list(HAND))
def test_resize_plan_by_hand(size):
    plan = plan_resize(*size)
    height, width, tokens = HAND[size]
    assert (plan.height, plan.width, plan.num_tokens) == (height, width, tokens)
    assert plan.grid == (height // 14, width // 14)
    assert plan.merged == (-(-plan.grid[0] // 3), -(-plan.grid[1] // 3))
    assert tokens <= 1024


def test_patch_counts_equal_the_public_processor():
    rows = [tuple(map(int, case.split())) for case in PUBLIC.replace("\n", ";").split(";") if case.strip()]
    assert len({r[:2] for r in rows}) == 162
    got = {(w, h): (*plan_resize(w, h).merged, plan_resize(w, h).num_tokens) for w, h, *_ in rows}
    assert got == {(w, h): (nh, nw, t) for w, h, nh, nw, t in rows}


@pytest.mark.parametrize("size", ODD_SIZES)
def test_pixel_values_equal_the_public_recipe(size):
    image = _noise(*size)
    out = process(image)
    plan = plan_resize(*size)
    assert out.grid == plan.grid and out.num_tokens == plan.num_tokens
    assert out.pixel_values.shape == (plan.grid[0] * plan.grid[1], 588)
    assert out.pixel_values.dtype == torch.float32
    assert out.pixel_values.min() >= -1 and out.pixel_values.max() <= 1
    # The public steps, with Pillow's own pad: bicubic contain, centred on gray 127; /255; (x - 0.5) / 0.5.
    ref = ImageOps.pad(image, (plan.width, plan.height), color=(127, 127, 127))
    ref = (torch.from_numpy(np.asarray(ref).copy()).float() / 255 - 0.5) / 0.5
    assert torch.equal(_canvas(out.pixel_values, out.grid), ref)


def test_patches_are_row_major_and_each_is_channel_major():
    image = _noise(641, 479)
    out = process(image)
    assert out.grid == (35, 46)
    ref = ImageOps.pad(image, (644, 490), color=(127, 127, 127))
    ref = (torch.from_numpy(np.asarray(ref).copy()).float() / 255 - 0.5) / 0.5  # [H, W, C]
    for i, j in [(0, 0), (0, 45), (7, 31), (34, 0), (34, 45)]:
        patch = ref[i * 14 : (i + 1) * 14, j * 14 : (j + 1) * 14].permute(2, 0, 1)  # [C, 14, 14]
        assert torch.equal(out.pixel_values[i * 46 + j], patch.reshape(588))


def test_pad_is_gray_127_and_the_content_box_holds_the_image():
    red = Image.new("RGB", (641, 479), (255, 0, 0))
    out = process(red)
    left, top, w, h = plan_resize(641, 479).content
    assert (left, top, w, h) == (0, 4, 644, 481)  # 644 / 641 * 479 = 481.2; (490 - 481) / 2 = 4.5 -> 4 (even)
    canvas = _canvas(out.pixel_values, out.grid)
    assert abs(PAD.item() - (127 / 255 - 0.5) / 0.5) < 1e-8
    assert torch.equal(canvas[:top], PAD.expand(top, 644, 3))
    assert torch.equal(canvas[top + h :], PAD.expand(490 - top - h, 644, 3))
    inside = canvas[top : top + h]  # resized alone, then pasted: no blending with the gray at its edge
    assert torch.equal(inside, torch.tensor([1.0, -1.0, -1.0]).expand_as(inside))


@pytest.mark.parametrize("size", [(641, 479), (479, 641), (2000, 50), (50, 2000), (997, 13), (333, 777),
                                  (10, 10), (4000, 3000), (1, 100000), (3, 1000), (1000, 999)])
def test_aspect_is_kept_within_a_pixel(size):
    width, height = size
    plan = plan_resize(width, height)
    left, top, w, h = plan.content
    assert not plan.squeeze
    assert (w == plan.width and abs(h - height / width * w) <= 0.5) or (
        h == plan.height and abs(w - width / height * h) <= 0.5)
    assert abs(2 * left - (plan.width - w)) <= 1 and abs(2 * top - (plan.height - h)) <= 1  # centred


def test_beyond_max_wh_ratio_the_image_is_squeezed():
    cfg = ProcessorConfig(max_wh_ratio=8)
    # 1000 x 100 >= 8:1. The plan caps the width at 800: 80000 px, scale sqrt(3.6992) = 1.9233 -> 1538 x 192;
    # canvas 1540 x 196, merged (ceil(14/3), ceil(110/3)) = (5, 37): 5 * 38 + 2 = 192 tokens.
    plan = plan_resize(1000, 100, cfg)
    assert (plan.height, plan.width, plan.num_tokens, plan.squeeze) == (196, 1540, 192, True)
    assert plan.content == (0, 0, 1540, 196)
    halves = Image.new("RGB", (1000, 100), (255, 0, 0))
    halves.paste((0, 0, 255), (500, 0, 1000, 100))
    canvas = _canvas(process(halves, cfg).pixel_values, plan.grid)
    assert not torch.isclose(canvas, PAD).all(-1).any()  # no gray anywhere: stretched, not padded
    assert torch.equal(canvas[:, 760], torch.tensor([1.0, -1.0, -1.0]).expand(196, 3))  # the halves meet at 770
    assert torch.equal(canvas[:, 780], torch.tensor([-1.0, -1.0, 1.0]).expand(196, 3))
    # Below the ratio the image is fitted and padded; a tall image is never capped or squeezed.
    assert not plan_resize(700, 100, cfg).squeeze
    assert plan_resize(100, 1000, cfg) == plan_resize(100, 1000)
    assert plan_resize(1000, 100) != plan  # without the cap: no squeeze, another canvas
    assert not plan_resize(1000, 100).squeeze


def test_plan_errors_name_the_setting(monkeypatch):
    with pytest.raises(ValueError, match="vision.max_image_tokens must be >= 4"):
        ProcessorConfig(max_image_tokens=3)
    with pytest.raises(ValueError, match="vision.max_wh_ratio"):
        ProcessorConfig(max_wh_ratio=0)
    with pytest.raises(ValueError, match="width=0"):
        plan_resize(0, 5)
    # The shrink fits by construction (A12); the check after it guards float rounding. Force a miss to see it.
    monkeypatch.setattr(processor, "_shrink", lambda h, w, cfg: (h, w))
    with pytest.raises(ValueError, match="more than vision.max_image_tokens=1024"):
        plan_resize(1344, 1344)


def test_a_smaller_budget_shrinks_into_it():
    for budget in (4, 5, 9, 50, 200):
        cfg = ProcessorConfig(max_image_tokens=budget)
        for size in [(1344, 1344), (100000, 1), (1, 100000), (641, 479), (7, 3000)]:
            assert plan_resize(*size, cfg).num_tokens <= budget
    assert plan_resize(1, 100000, ProcessorConfig(max_image_tokens=4)).height == 42  # one cell


def test_placeholder_layout():
    layout = placeholder_layout((4, 5))  # merged (2, 2): START, I I NL, I I NL, END
    assert layout.kind.tolist() == [START, IMAGE, IMAGE, NEWLINE, IMAGE, IMAGE, NEWLINE, END]
    assert layout.group.tolist() == [-1, 0, 1, -1, 2, 3, -1, -1]
    for size, (height, width, tokens) in HAND.items():
        layout = placeholder_layout((height // 14, width // 14))
        n_h, n_w = plan_resize(*size).merged
        assert len(layout.kind) == tokens
        assert (layout.kind == IMAGE).sum() == n_h * n_w and (layout.kind == NEWLINE).sum() == n_h
        assert torch.equal(layout.group[layout.kind == IMAGE], torch.arange(n_h * n_w))


def test_pack_images_without_padding():
    images = [process(_noise(w, h, seed=i)) for i, (w, h) in enumerate([(641, 479), (61, 397), (2000, 50)])]
    packed = pack_images(images)
    sizes = [im.grid[0] * im.grid[1] for im in images]
    assert sizes == [1610, 1600, 1722]
    assert packed.cu_seqlens.dtype == torch.int32
    assert packed.cu_seqlens.tolist() == [0, 1610, 3210, 4932]
    assert packed.pixel_values.shape == (4932, 588)  # sum, not 3 x the largest (5166)
    assert packed.max_seqlen == 1722
    assert packed.grids.tolist() == [list(im.grid) for im in images]
    assert packed.num_tokens.tolist() == [im.num_tokens for im in images]
    for i, im in enumerate(images):
        assert torch.equal(packed.pixel_values[packed.cu_seqlens[i] : packed.cu_seqlens[i + 1]], im.pixel_values)
    with pytest.raises(ValueError, match="at least one image"):
        pack_images([])
