"""The multimodal loader (data/multimodal.py) proves: the text : multimodal share of rows is 1 / (ratio + 1) within
1 % (the schedule over 100k rows, and exactly in a real stream); each image's placeholder run has the processor's
num_tokens and image_mask marks exactly the runs; no label is a placeholder; pixel_values / grids are the images'
process() outputs back to back; text rows are the text loader's rows in order; a resumed loader yields exactly the
uninterrupted batches (across an image epoch, pixel_values included); the same seed gives the same batches; data
ranks read disjoint samples (rank r: samples r, r + world, ...); conf/data/multimodal.yaml validates."""

import json
import os

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from data.config import ensure_prepared
from data.loader import PackedLoader
from data.multimodal import (IGNORE, MULTIMODAL, MultimodalConfig, MultimodalDataConfig, build_multimodal_loader,
                             encode_sample, ensure_images, multimodal_rows)
from data.shards import DataConfigError
from data.vision.processor import ProcessorConfig, process
from data.vision.shards import ImageTextReader
from data.vision.synthetic import synthetic_sample
from tests.data.synthetic import write_text_corpus

PH = 4095
RATIO = 3


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    root = tmp_path_factory.mktemp("mm")
    write_text_corpus(root / "corpus")
    mm = MultimodalConfig(text_to_multimodal=RATIO, image_path=str(root / "images"), num_samples=12,
                          interleaved_every=3, size_range=[60, 120])
    c = MultimodalDataConfig(path=str(root / "text"), corpus=str(root / "corpus"), vocab_size=400, shard_size=512,
                             seq_len=96, batch_size=4, multimodal=mm)
    ensure_prepared(c, progress=False)
    ensure_images(mm, samples_per_shard=5)  # 3 shards: the reader crosses shard ends
    return c


def take(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def runs(mask_row: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each run of True."""
    m = torch.cat([torch.tensor([False]), mask_row, torch.tensor([False])]).int()
    edges = torch.nonzero(m[1:] - m[:-1]).flatten().tolist()
    return list(zip(edges[::2], edges[1::2]))


def test_schedule_share_over_100k_rows():
    for ratio in (7, 3, 1, 10):
        for seed in (0, 1):
            mm = multimodal_rows(seed, ratio, 0, 100_000)
            assert abs(mm.mean() - 1 / (ratio + 1)) < 0.01 / (ratio + 1)  # within 1 % of the share
            blocks = mm[: 100_000 // (ratio + 1) * (ratio + 1)].reshape(-1, ratio + 1)
            assert (blocks.sum(1) == 1).all()  # stratified: one per block
            assert len(set(np.argmax(blocks, 1).tolist())) == ratio + 1  # the position moves
    assert (multimodal_rows(0, 7, 123, 77) == multimodal_rows(0, 7, 0, 200)[123:200]).all()
    assert (multimodal_rows(0, 7, 0, 800) != multimodal_rows(1, 7, 0, 800)).any()
    assert not multimodal_rows(0, 0, 0, 1000).any()


def test_encode_sample_cuts_before_an_image_and_skips_when_the_first_does_not_fit():
    proc = ProcessorConfig(min_pixels=168 * 168)
    segs = synthetic_sample(0, 0, interleaved=True, size_range=(60, 120))  # text, image, text, image, text[, ...]
    encode = lambda s: list(range(10, 10 + len(s)))  # noqa: E731 (one id per character)
    kw = dict(encode=encode, image_token_id=PH, eos_id=1, processor=proc)
    full = encode_sample(segs, seq_len=10_000, **kw)
    n_img = sum(not isinstance(s, str) for s in segs)
    assert len(full.images) == n_img and full.input_ids[-1] == 1 and full.labels[-1] == IGNORE
    first_end = len(segs[0]) + full.num_tokens[0]
    cut = encode_sample(segs, seq_len=first_end + len(segs[2]) + 3, **kw)  # T inside the second image's run
    assert len(cut.input_ids) == first_end + len(segs[2]) and len(cut.images) == 1
    assert cut.labels[-1] == IGNORE  # the next token is a placeholder of the image cut away
    assert encode_sample(segs, seq_len=first_end - 1, **kw) is None


def test_batches(cfg):
    """Placeholders, masks, labels, pixels and text rows against independent recomputation."""
    loader, _ = build_multimodal_loader(cfg)
    batches = take(loader, 12)
    text = PackedLoader(cfg.path, seq_len=cfg.seq_len, batch_size=1, eos_id=loader.eos_id, seed=cfg.seed,
                        shuffle=cfg.shuffle, shuffle_buffer=cfg.shuffle_buffer)
    text_rows = iter(text)
    reader = iter(ImageTextReader(cfg.multimodal.image_path))
    proc = cfg.multimodal.processor
    kinds = torch.cat([b["row_kind"] for b in batches])
    assert kinds.tolist() == multimodal_rows(cfg.seed, RATIO, 0, len(kinds)).astype(int).tolist()
    assert kinds.sum() == len(kinds) // (RATIO + 1)  # exact in every block of RATIO + 1 rows
    for b in batches:
        assert (b["labels"] != PH).all()
        assert b["image_mask"].equal(b["input_ids"] == PH)
        images = []
        for row in range(cfg.batch_size):
            ids, labels = b["input_ids"][row], b["labels"][row]
            if b["row_kind"][row] != MULTIMODAL:
                expect = next(text_rows)
                assert ids.equal(expect["input_ids"][0]) and labels.equal(expect["labels"][0])
                assert not b["image_mask"][row].any()
                continue
            _, segs = next(reader)  # every sample fits these rows: none is skipped
            sample = encode_sample(segs, loader.encode, seq_len=cfg.seq_len, image_token_id=PH,
                                   eos_id=loader.eos_id, processor=proc)
            n = len(sample.input_ids)
            assert ids[:n].tolist() == sample.input_ids.tolist() and (ids[n:] == loader.pad_id).all()
            assert (labels[n:] == IGNORE).all()
            processed = [process(im, proc) for im in sample.images]
            assert [e - s for s, e in runs(b["image_mask"][row])] == [p.num_tokens for p in processed]
            for s, _ in runs(b["image_mask"][row]):  # the token before a run never predicts a placeholder
                assert s == 0 or labels[s - 1] == IGNORE
            images += processed
        assert b["grids"].tolist() == [list(p.grid) for p in images]
        want = torch.cat([p.pixel_values for p in images]) if images else torch.zeros(0, 588)
        assert b["pixel_values"].dtype == torch.float32 and b["pixel_values"].equal(want)
        assert b["pixel_values"].shape[0] == int(b["grids"].prod(1).sum())


def test_share_in_a_long_real_stream(cfg):
    """8,000 rows at the default 7 : 1, images decoded and processed (several image epochs)."""
    long = MultimodalDataConfig(**{**vars(cfg), "batch_size": 8, "multimodal": MultimodalConfig(
        **{**vars(cfg.multimodal), "text_to_multimodal": 7})})
    loader, _ = build_multimodal_loader(long)
    kinds = torch.cat([b["row_kind"] for b in take(loader, 1000)])
    assert abs(kinds.float().mean().item() - 1 / 8) < 0.01 / 8
    assert kinds.tolist() == multimodal_rows(cfg.seed, 7, 0, 8000).astype(int).tolist()
    assert loader.image_epoch > 1


def test_resume_is_exact_across_an_image_epoch(cfg):
    k, m = 5, 10  # 15 batches of 4 rows take 15 samples of 12: the reader starts its second pass
    reference = take(build_multimodal_loader(cfg)[0], k + m)
    first, _ = build_multimodal_loader(cfg)
    take(first, k)
    state = json.loads(json.dumps(first.state_dict()))  # plain types, as a checkpoint keeps them
    assert state["dp_rank_0"]["carry"]  # text rows carried over a batch boundary are part of the state
    resumed, _ = build_multimodal_loader(cfg)
    resumed.load_state_dict(state)
    after = take(resumed, m)
    assert resumed.image_epoch == 1
    for want, got in zip(reference[k:], after):
        assert want.keys() == got.keys()
        for key in want:
            assert want[key].equal(got[key]), key


def test_same_seed_same_batches_other_seed_other_rows(cfg):
    a, b = take(build_multimodal_loader(cfg)[0], 4), take(build_multimodal_loader(cfg)[0], 4)
    for x, y in zip(a, b):
        assert all(x[key].equal(y[key]) for key in x)
    other = MultimodalDataConfig(**{**vars(cfg), "seed": 1})
    c = take(build_multimodal_loader(other)[0], 4)
    assert any(not x["row_kind"].equal(z["row_kind"]) for x, z in zip(a, c))


def test_data_ranks_read_disjoint_samples(cfg):
    proc = cfg.multimodal.processor
    samples = list(ImageTextReader(cfg.multimodal.image_path))
    for rank in (0, 1):
        loader, _ = build_multimodal_loader(cfg, rank=rank, world_size=2)
        mine = iter([segs for key, segs in samples if int(key) % 2 == rank])  # rank r: samples r, r + 2, ...
        for b in take(loader, 4):
            for row in torch.nonzero(b["row_kind"]).flatten().tolist():
                sample = encode_sample(next(mine), loader.encode, seq_len=cfg.seq_len, image_token_id=PH,
                                       eos_id=loader.eos_id, processor=proc)
                assert b["input_ids"][row, : len(sample.input_ids)].tolist() == sample.input_ids.tolist()


def test_placeholder_id_the_tokenizer_emits_is_refused(cfg):
    clash = MultimodalDataConfig(**{**vars(cfg), "multimodal": MultimodalConfig(
        **{**vars(cfg.multimodal), "image_token_id": 300})})
    with pytest.raises(DataConfigError, match="data.multimodal.image_token_id=300"):
        build_multimodal_loader(clash)


def test_generated_images_of_other_settings_are_refused(cfg):
    other = MultimodalConfig(**{**vars(cfg.multimodal), "image_seed": 5})
    with pytest.raises(DataConfigError, match="data.multimodal.image_seed=5"):
        ensure_images(other)


def test_yaml_validates():
    path = os.path.join(os.path.dirname(__file__), "..", "..", "conf", "data", "multimodal.yaml")
    yaml = OmegaConf.load(path)
    assert list(yaml.pop("defaults")) == ["multimodal_schema", "_self_"]
    schema = OmegaConf.structured(MultimodalDataConfig)
    got = OmegaConf.to_object(OmegaConf.merge(schema, yaml))
    assert got.vocab_size == 4095 == got.multimodal.image_token_id and got.multimodal.text_to_multimodal == 7
    with pytest.raises(Exception, match="text_to_multimodl"):
        OmegaConf.merge(schema, {"multimodal": {"text_to_multimodl": 3}})
    with pytest.raises(ValueError, match="data.multimodal.text_to_multimodal"):
        MultimodalConfig(text_to_multimodal=-1)


def test_data_multimodal_composes_with_its_keys_checked():
    """`data=multimodal` composes into MultimodalDataConfig, its keys checked by name (the trainer's use of it:
    tests/trainer/test_multimodal_train.py)."""
    from trainer.config import to_config
    from trainer.compose import compose

    cfg = to_config(compose(["model=v41_tiny_mm", "data=multimodal", "data.multimodal.text_to_multimodal=3"]))
    assert type(cfg.data).__name__ == "MultimodalDataConfig" and cfg.data.multimodal.text_to_multimodal == 3
    with pytest.raises(ValueError, match="text_to_multimodl"):
        to_config(compose(["data=multimodal", "data.multimodal.text_to_multimodl=3"]))
