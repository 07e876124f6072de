"""The backbone takes images (issue 20, model side): Transformer.forward(input_ids, images=(pixel_values, grids)) puts
the vision tower's packed placeholder embeddings where input_ids hold model.image_token_id, and nowhere else.

Proves, on v41_tiny_mm (a 2-layer tower) built as the trainer builds it (meta, to_empty, init_weights): a batch of
two rows with three images of different grids runs to finite logits; the image positions' first-layer input is the
tower's output and the text positions' the token embedding; the LM loss on text after the images reaches every
tower parameter; image positions route with the MoE's image bias and count in `load_image`, text ones in
`load_text`; Engram's n-grams break at an image run as at any dead token; wrong placeholder counts, images for a
text-only model and images on the cache path are refused by name; without images the model computes what v41_tiny
computes with the same backbone weights; `materialize` initialises the tower as its own piece without moving any
text-only piece's seed; trained briefly, the model reads a colour off the pixels (the whole image path carries what
is drawn).

Shape legend: B batch, T tokens, P placeholder tokens, N patches, K = 588 values per patch.
"""

import pytest
import torch
import torch.nn.functional as F

import model as model_pkg
from model.vision import image_token_count
from tests.helpers import load_config

# (h, w) patches: 1 x 2, 2 x 1 and 1 x 1 image tokens after the 3 x 3 unshuffle, so 5, 6 and 4 placeholders.
GRIDS = [(3, 6), (6, 3), (3, 3)]
T = 24


def build(name: str = "v41_tiny_mm", seed: int = 0):
    torch.manual_seed(seed)
    with torch.device("meta"):
        m = model_pkg.build(load_config(name))
    m.to_empty(device="cpu")
    m.init_weights()
    return m


@pytest.fixture(scope="module")
def mm():
    return build()


def batch(cfg, grids=GRIDS, seed: int = 0):
    """input_ids [2, T]: row 0 text, image 0, text, image 1, text; row 1 text, image 2, text (each image's run of
    image_token_count placeholders); pixel_values [N, K]; the placeholder mask [2, T]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, cfg.vocab_size - 1, (2, T), generator=g)
    n = [image_token_count(x, cfg.vision.unshuffle) for x in grids]
    ids[0, 2:2 + n[0]] = cfg.image_token_id
    ids[0, 10:10 + n[1]] = cfg.image_token_id
    ids[1, 4:4 + n[2]] = cfg.image_token_id
    pixels = torch.randn(sum(h * w for h, w in grids), 3 * cfg.vision.patch ** 2, generator=g)
    return ids, pixels, ids == cfg.image_token_id


def test_forward_with_images_runs(mm):
    ids, pixels, mask = batch(mm.cfg)
    assert int(mask.sum()) == 15
    logits = mm(ids, images=(pixels, GRIDS))
    assert logits.shape == (2, T, mm.cfg.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_image_positions_hold_the_tower_output(mm):
    ids, pixels, mask = batch(mm.cfg)
    seen = {}
    hook = mm.layers[0].register_forward_pre_hook(lambda mod, args: seen.update(S=args[0]))
    try:
        with torch.no_grad():
            mm(ids, images=(pixels, GRIDS))
            tower = mm.vision(pixels, GRIDS)  # [P, dim]
    finally:
        hook.remove()
    S = seen["S"]  # [B, T, n, dim], every stream the embedding
    for s in range(S.shape[2]):
        torch.testing.assert_close(S[:, :, s][mask], tower, rtol=0, atol=0)
        torch.testing.assert_close(S[:, :, s][~mask], mm.embed(ids[~mask]), rtol=0, atol=0)


def test_lm_loss_reaches_every_tower_parameter():
    m = build()
    ids, pixels, _ = batch(m.cfg)
    logits = m(ids, images=(pixels, GRIDS))
    # text positions after every image of their row: row 0 from 16, row 1 from 8
    loss = F.cross_entropy(logits[0, 16:-1], ids[0, 17:]) + F.cross_entropy(logits[1, 8:-1], ids[1, 9:])
    loss.backward()
    missing = [n for n, p in m.vision.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []


def test_image_tokens_route_with_the_image_bias():
    m = build()
    ids, pixels, mask = batch(m.cfg)
    k = m.cfg.moe.experts_per_token
    favoured = 3  # an image bias this large makes every image token of layer 0 pick this expert
    m.layers[0].ffn.gate.bias_image[favoured] = 1e4
    m.train()
    with torch.no_grad():
        m(ids, images=(pixels, GRIDS))
    images, text = int(mask.sum()), int((~mask).sum())
    for layer in m.layers:
        assert int(layer.ffn.load_image.sum()) == images * k
        assert int(layer.ffn.load_text.sum()) == text * k
    assert int(m.layers[0].ffn.load_image[favoured]) == images
    assert int(m.layers[0].ffn.load_text[favoured]) < text


def test_engram_ngrams_break_at_an_image_run(mm):
    cfg, hasher = mm.cfg, mm.hasher
    g = torch.Generator().manual_seed(1)
    before, after = torch.randint(3, 4000, (1, 6), generator=g), torch.randint(3, 4000, (1, 8), generator=g)
    run = torch.full((1, 5), cfg.image_token_id)
    ids = torch.cat((before, run, after), dim=1)
    rows = hasher.for_tokens(ids)
    # No run: the text after it continues the n-grams of the text before it.
    joined = hasher.for_tokens(torch.cat((before, after), dim=1))
    # As in tests/model/test_engram.py: a dead token blocks every shift reaching it, which then reads pad, the same
    # ids as a sequence whose tokens up to the run's end are the pad token.
    padded = hasher.for_tokens(torch.cat((torch.full((1, 11), cfg.engram.pad_id), after), dim=1))
    clean_before = hasher.for_tokens(before)
    for layer, (row_ids, dead) in rows.items():
        assert dead[0].nonzero().flatten().tolist() == list(range(6, 11))
        assert torch.equal(row_ids[:, :6], clean_before[layer][0])
        assert torch.equal(row_ids[:, 11:], padded[layer][0][:, 11:])
        assert not torch.equal(row_ids[:, 11], joined[layer][0][:, 6])  # the run cut n-grams that would reach back


def test_refusals(mm):
    cfg = mm.cfg
    ids, pixels, _ = batch(cfg)
    short = ids.clone()
    short[0, 2] = 5  # one placeholder of image 0 made text: 14 placeholders, the grids make 15
    with pytest.raises(ValueError, match=r"hold 14 image placeholder tokens.*make 15"):
        mm(short, images=(pixels, GRIDS))
    with pytest.raises(ValueError, match="cache"):
        mm(ids, images=(pixels, GRIDS), cache=object())
    with torch.device("meta"):
        text_only = model_pkg.build(load_config("v41_tiny"))
    with pytest.raises(ValueError, match=r"text-only model \(model.vision.num_layers=0"):
        text_only(ids, images=(pixels, GRIDS))
    with torch.device("meta"), pytest.raises(ValueError, match="model.image_token_id=-1"):
        model_pkg.build(load_config("v41_tiny_mm", image_token_id=-1))


def test_without_images_the_tower_changes_nothing(mm):
    text = build("v41_tiny")
    backbone = {k: v for k, v in mm.state_dict().items() if not k.startswith("vision.")}
    text.load_state_dict(backbone)
    mm.eval(), text.eval()
    ids = torch.randint(3, mm.cfg.image_token_id, (2, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(mm(ids), text(ids))


def test_materialize_initialises_the_tower_as_its_own_piece():
    from trainer.parallel.apply import ParallelModel, materialize

    def materialized(name):
        with torch.device("meta"):
            m = model_pkg.build(load_config(name))
        materialize(ParallelModel.local(m), torch.device("cpu"), 7, microbatch_size=1, seq_len=T, grad_accum=1)
        return m

    mm, text = materialized("v41_tiny_mm"), materialized("v41_tiny")
    assert all(p.abs().sum() > 0 for n, p in mm.vision.named_parameters() if "norm" not in n)
    text_state = text.state_dict()
    assert all(torch.equal(v, text_state[k]) for k, v in mm.state_dict().items() if not k.startswith("vision."))


def test_the_model_learns_to_read_the_image():
    """The whole image path carries what is drawn: four solid-colour images (the processor's patches, one 3 x 3 grid
    each), each followed by its own colour word. A model that did not see the pixels could do no better than ln 4 =
    1.39 nats on the word; after 50 AdamW steps on the every-role backbone with the tiny tower the word's loss is
    far below that with the right images and far above it with the images rotated among the rows."""
    import dataclasses
    import math

    from PIL import Image

    from data.vision.processor import ProcessorConfig, process
    from model.config import VisionConfig
    from tests.helpers import every_role_config

    ph = 4095
    cfg = dataclasses.replace(every_role_config(), image_token_id=ph, vision=VisionConfig(
        num_layers=2, dim=64, num_heads=4, mlp_dim=128, patch=14, unshuffle=3, max_tokens=64))
    torch.manual_seed(0)
    with torch.device("meta"):
        m = model_pkg.build(cfg)
    m.to_empty(device="cpu")
    m.init_weights()
    colours = [(220, 30, 30), (20, 150, 60), (30, 70, 220), (235, 190, 0)]
    images = [process(Image.new("RGB", (42, 42), c), ProcessorConfig(min_pixels=0)) for c in colours]
    n = images[0].num_tokens  # 4: START, one image token, NEWLINE, END
    ids, labels = torch.full((4, 8), 5), torch.full((4, 8), -100)
    for b in range(4):
        ids[b, 1:1 + n], ids[b, 1 + n], labels[b, n] = ph, 10 + b, 10 + b  # the word follows the image

    def loss(order) -> torch.Tensor:
        pixels = torch.cat([images[i].pixel_values for i in order])
        logits = m(ids, images=(pixels, [images[0].grid] * 4))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)

    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m.train()
    for _ in range(50):
        loss([0, 1, 2, 3]).backward()
        opt.step()
        opt.zero_grad()
    m.eval()
    with torch.no_grad():
        right, rotated = float(loss([0, 1, 2, 3])), float(loss([1, 2, 3, 0]))
    assert right < 0.25 * math.log(4) < math.log(4) < rotated, (right, rotated)  # seen: 0.14 and 4.2
