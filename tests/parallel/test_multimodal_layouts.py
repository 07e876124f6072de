"""Proves the trainer's image path under the layouts it runs in: batches of text rows and image-text rows train
exactly like the single process.

test_layouts.py's comparison (its `_check`: the logged loss, the auxiliary losses and the clipped norm within 1e-5
relative at both steps, every gradient and every parameter after the two steps within 1e-5 of its scale, initial
weights and balancing biases exact), on the every-role model with test_layouts.py's settings plus the tiny vision
tower of conf/model/v41_tiny_mm.yaml, fed micro-batches that carry images the way data/multimodal.py's batches do
(input_ids with placeholder runs, pixel_values, grids, row_kind): 4 micro-batches of one row, two of them image-text
rows with grids whose sides are not multiples of the 3 x 3 unshuffle and one with two images. Data rank 0 gets its
image-text row second and rank 1 first, so the tower's parameters get a gradient on one rank while the other's
micro-batch has no image (FSDP2's reduce-scatter of unused parameters, the replicated path's vote). The metrics
loss_text and loss_multimodal (each a global token mean over its kind of row) equal the single process's too.

The rest of what it proves: docs/testing.md#multimodal-layouts
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from model.config import VisionConfig
from model.vision import image_token_count
from tests.distributed import run_distributed
from tests.helpers import EVERY_ROLE_SEQ_LEN
from tests.parallel.test_layouts import ROWS, STEPS, _check, _single, _small_config, train_each
from tests.parallel.test_layouts import _train as train_layout

PH = 4095  # model.image_token_id
LAYOUTS = {"dp_replicate2": dict(dp_replicate=2), "dp_shard2": dict(dp_shard=2), "tp2": dict(tp=2),
           "tp2_sp": dict(tp=2, sequence_parallel=True), "ep2": dict(ep=2)}
# per micro-batch: the images' grids (none: a text row); rank 0 of two data ranks gets 0 and 1, rank 1 gets 2 and 3
IMAGES = [[], [(4, 5)], [(3, 3), (2, 7)], []]


def _config():
    vision = VisionConfig(num_layers=2, dim=64, num_heads=4, mlp_dim=128, patch=14, unshuffle=3, max_tokens=64)
    return dataclasses.replace(_small_config(), vision=vision, image_token_id=PH)


def _global_batch(step: int) -> list[dict]:
    gen = torch.Generator().manual_seed(200 + step)
    out = []
    for grids in IMAGES:
        ids = torch.randint(0, PH, (ROWS, EVERY_ROLE_SEQ_LEN + 1), generator=gen)
        at = 2
        for g in grids:  # each image's placeholder run after two text tokens
            n = image_token_count(g, 3)
            ids[0, at:at + n] = PH
            at += n + 2
        labels = ids[:, 1:].clone()
        labels[labels == PH] = -100  # never predict a placeholder
        inputs = ids[:, :-1]
        pixels = torch.randn(sum(h * w for h, w in grids), 588, generator=gen)
        out.append({"input_ids": inputs, "labels": labels, "image_mask": inputs == PH,
                    "row_kind": torch.tensor([1 if grids else 0]), "pixel_values": pixels,
                    "grids": torch.tensor(grids, dtype=torch.int64).reshape(-1, 2)})
    return out


def _train(fields: dict) -> dict:
    def inspect(pm):  # this rank's rows of the tower's first wq ([64, 64] whole)
        wq = pm.module.vision.vit.layers[0].attn.wq.weight
        return {"wq_local_rows": (wq.to_local() if hasattr(wq, "to_local") else wq).shape[0]}

    return train_layout(fields, _config(), EVERY_ROLE_SEQ_LEN, batches=_global_batch, inspect=inspect)


def _worker(rank: int, world: int, names: list[str]) -> dict:
    return train_each(names, lambda name: _train(LAYOUTS[name]))


@pytest.fixture(scope="module")
def single():
    return _single(_train)


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_worker, 2, list(LAYOUTS))


def test_reference_is_not_vacuous(single):
    """The tower is trained by the loss: its gradients are non-zero at both steps, and both kinds of row count."""
    for step in range(STEPS):
        vision = {n: g for n, g in single["grads"][step].items() if n.startswith("vision.")}
        assert len(vision) == len([n for n in single["init"] if n.startswith("vision.")]) > 10
        assert all(g.abs().sum() > 0 for g in vision.values())
        kinds = single["extra"][step]
        assert kinds["loss_text"] != kinds["loss_multimodal"]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts_with_images_match_single_process(name, runs, single):
    ranks = [r[name] if name in r else "not run: an earlier layout of the spawn failed" for r in runs]
    _check(name, ranks, single)
    for step in range(STEPS):
        assert single["extra"][step].keys() == {"loss_text", "loss_multimodal"}
        for key, value in single["extra"][step].items():
            assert ranks[0]["extra"][step][key] == pytest.approx(value, rel=1e-5), (name, step, key)


def test_tp_splits_the_tower(runs):
    """tp 2 holds half of each split tensor of the tower (the plan is applied, not a replicated tower), and the
    planner's `tp_shard_dims` lists the tower's split tensors."""
    import model as model_pkg
    from trainer.parallel.tensor import tp_shard_dims

    assert runs[0]["tp2"]["wq_local_rows"] == 32
    assert runs[0]["dp_shard2"]["wq_local_rows"] == 32  # FSDP's dim-0 shards
    assert runs[0]["dp_replicate2"]["wq_local_rows"] == 64
    with torch.device("meta"):
        dims = tp_shard_dims(model_pkg.build(_config()))
    vision = {n: d for n, d in dims.items() if n.startswith("vision.")}
    assert {n.rsplit(".", 2)[-2] for n in vision} == {"wq", "wk", "wv", "wo", "w1", "w2", "w3"}
    assert "vision.aligner.w1.weight" in vision and "vision.vit.patch_embed.weight" not in vision
