"""Image-text webdataset corpora that Cedar did not write (data/vision/shards.py `index_webdataset`): tars of
`<key>.jpg` / `.png` / `.webp` + `<key>.txt` (+ a metadata `<key>.json` dict, ignored) and documents (`<key>.json`
list + their images), with keys that are not numbers, are indexed without being rewritten (`python -m
data.vision.shards index DIR`), read back in order with their captions and pixels, and split across data ranks by
ordinal; a sample that is neither kind, a directory already indexed or one without tars is refused, naming it."""

import io
import json
import subprocess
import sys
import tarfile

import numpy as np
import pytest
from PIL import Image

from data.shards import DataConfigError, DataNotFoundError
from data.vision.shards import ImageTextReader, index_webdataset

REPO = __import__("pathlib").Path(__file__).resolve().parents[2]


def _image(w: int, h: int, colour) -> Image.Image:
    return Image.new("RGB", (w, h), colour)


def _encoded(image: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def _tar(path, samples: list[tuple[str, dict[str, bytes]]]) -> None:
    with tarfile.open(path, "w") as tar:
        folder = tarfile.TarInfo("subdir")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)  # a non-file member is skipped, as webdataset does
        for key, fields in samples:
            for field, payload in fields.items():
                info = tarfile.TarInfo(f"{key}.{field}")
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))


@pytest.fixture
def corpus(tmp_path):
    red, blue, green = _image(70, 50, (200, 0, 0)), _image(64, 96, (0, 0, 200)), _image(40, 40, (0, 150, 0))
    doc = [{"text": "Two pictures."}, {"image": "a.jpg"}, {"text": "and"}, {"image": "b.png"}]
    _tar(tmp_path / "part-b.tar", [
        ("laion_003", {"webp": _encoded(green, "WEBP"), "txt": b"a green square\n"}),
        ("doc_004", {"json": json.dumps(doc).encode(), "a.jpg": _encoded(red, "JPEG"), "b.png": _encoded(blue, "PNG")}),
    ])
    _tar(tmp_path / "part-a.tar", [
        ("laion_001", {"jpg": _encoded(red, "JPEG"), "txt": b"a red box", "json": b'{"url": "x", "width": 70}'}),
        ("laion_002", {"png": _encoded(blue, "PNG"), "txt": "un carr\u00e9 bleu".encode()}),
    ])
    return tmp_path


def test_indexed_corpus_reads_in_order_with_captions_and_pixels(corpus):
    r = subprocess.run([sys.executable, "-m", "data.vision.shards", "index", str(corpus)], cwd=REPO,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "4 samples in 2 shards indexed" in r.stdout
    meta = json.loads((corpus / "meta.json").read_text())
    assert [s["name"] for s in meta["shards"]] == ["part-a.tar", "part-b.tar"] and meta["source"] == "webdataset"
    samples = list(ImageTextReader(str(corpus)))
    assert [k for k, _ in samples] == ["laion_001", "laion_002", "laion_003", "doc_004"]
    (_, (img1, cap1)), (_, (img2, cap2)), (_, (img3, cap3)), (_, doc) = samples
    assert (cap1, cap2, cap3) == ("a red box", "un carr\u00e9 bleu", "a green square")
    assert img1.size == (70, 50) and np.abs(np.asarray(img1, dtype=int) - [200, 0, 0]).max() < 8  # JPEG, lossy
    assert np.array_equal(np.asarray(img2), np.asarray(_image(64, 96, (0, 0, 200))))  # PNG, exact
    assert img3.size == (40, 40)
    assert [type(s).__name__ for s in doc] == ["str", "Image", "str", "Image"] and doc[2] == "and"


def test_ranks_split_a_corpus_by_ordinal(corpus):
    """Keys that are not numbers: rank r of 2 takes the samples at ordinals r, r + 2 (the loader's rule)."""
    index_webdataset(str(corpus))
    reader = ImageTextReader(str(corpus))
    ordinals = []
    for key, _ in reader:
        ordinals.append((reader.position - 1, key))
    assert ordinals == [(0, "laion_001"), (1, "laion_002"), (2, "laion_003"), (3, "doc_004")]
    resumed = ImageTextReader(str(corpus))
    resumed.load_state_dict({**reader.state_dict(), "shard": 1, "offset": 1})
    assert resumed.position == 3 and [k for k, _ in resumed] == ["doc_004"]


def test_bad_corpora_are_refused_naming_them(tmp_path, corpus):
    index_webdataset(str(corpus))
    with pytest.raises(DataConfigError, match="already has a meta.json"):
        index_webdataset(str(corpus))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataNotFoundError, match="no \\*.tar file"):
        index_webdataset(str(empty))
    bad = tmp_path / "bad"
    bad.mkdir()
    _tar(bad / "x.tar", [("k1", {"jpg": _encoded(_image(8, 8, (0, 0, 0)), "JPEG")})])  # an image without a caption
    with pytest.raises(DataConfigError, match=r"x.tar: sample k1 is neither a captioned image"):
        index_webdataset(str(bad))


def test_the_multimodal_loader_reads_an_indexed_corpus(tmp_path, corpus):
    """data.multimodal.image_path at an indexed corpus: rank r of 2 gets its image-text samples at ordinals r, r + 2
    (the captions' tokens land in the rows), text rows around them."""
    from data.config import ensure_prepared
    from data.multimodal import MULTIMODAL, MultimodalConfig, MultimodalDataConfig, build_multimodal_loader
    from data.tokenizer import load_tokenizer
    from tests.data.synthetic import write_text_corpus

    index_webdataset(str(corpus))
    write_text_corpus(tmp_path / "text_corpus")
    mm = MultimodalConfig(text_to_multimodal=1, image_path=str(corpus))
    cfg = MultimodalDataConfig(path=str(tmp_path / "text"), corpus=str(tmp_path / "text_corpus"), vocab_size=400,
                               shard_size=512, seq_len=96, batch_size=2, multimodal=mm)
    ensure_prepared(cfg, progress=False)
    want = {0: ["a red box", "a green square"], 1: ["un carr\u00e9 bleu", "Two pictures."]}
    for rank in (0, 1):
        loader, info = build_multimodal_loader(cfg, rank, 2)
        tok = load_tokenizer(info.path)
        it, texts = iter(loader), []
        while len(texts) < 2:
            batch = next(it)
            for row in (batch["row_kind"] == MULTIMODAL).nonzero().flatten().tolist():
                ids = [i for i in batch["input_ids"][row].tolist() if i < tok.get_vocab_size()]
                texts.append(tok.decode(ids))
        for text, caption in zip(texts, want[rank]):
            assert caption in text, (rank, text)
