"""Does the model read the images? Caption loss of a multimodal run's checkpoints on held-out captioned images, with
the true image, a blank one and another sample's image in its place (data=multimodal, issue 20).

Usage:
  .venv/bin/python bench/multimodal_caption.py RUN_DIR [--samples 200] [--seed 1000] [--device cpu] [--json OUT]

For every complete checkpoint of RUN_DIR (a `python -m trainer.cli.main model=v41_tiny_mm data=multimodal` run), in
step order: the model as saved (its config from the checkpoint's marker, its tokenizer the run's), in eval mode, on
`--samples` captioned images of the generated source (data/vision/synthetic.py) drawn with image seed `--seed`,
which the run never saw (it trains on data.multimodal.image_seed, 0 by default), at the run's size range and
processor settings. Each sample is one row as the loader builds it (the image's placeholders, then the caption,
then <eos>; 25 rows a forward, padded at their end, which a causal model does not see); the loss is the
cross-entropy of the caption's tokens and <eos>, summed over every sample and divided by their number (a token
mean), for three images in the placeholders' place:
- true: the sample's own image;
- blank: a uniform gray image of the same size (the same grid, so the same placeholders and positions);
- swapped: the next sample's image resized to this one's size (a real image that the caption does not describe).
true < blank says the tower's features help predict the caption; true < swapped that they carry what is drawn,
not only "an image is here". Captions name colours, shapes, counts, words and numbers, none of which the text
before them gives away.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from data.multimodal import IGNORE, encode_sample  # noqa: E402
from data.vision.processor import ProcessorConfig, process  # noqa: E402
from data.vision.synthetic import synthetic_sample  # noqa: E402

VARIANTS = ("true", "blank", "swapped")


def _run_settings(run_dir: Path):
    from omegaconf import OmegaConf

    data = OmegaConf.load(run_dir / ".hydra" / "config.yaml").data
    if "multimodal" not in data:
        raise SystemExit(f"{run_dir} is not a data=multimodal run")
    mm = data.multimodal
    return int(data.seq_len), int(mm.image_token_id), tuple(mm.size_range), ProcessorConfig(
        min_pixels=int(mm.min_pixels), max_image_tokens=int(mm.max_image_tokens))


def _rows(n: int, seed: int, encode, eos_id: int, seq_len: int, image_token_id: int, size_range, processor):
    """(input_ids [1, L], labels [1, L], {variant: (pixel_values, grids)}) per held-out captioned sample."""
    from PIL import Image

    samples = [synthetic_sample(seed, i, size_range=size_range) for i in range(n + 1)]
    out = []
    for i in range(n):
        segments = samples[i]
        row = encode_sample(segments, encode, seq_len=seq_len, image_token_id=image_token_id, eos_id=eos_id,
                            processor=processor)
        if row is None:
            continue
        (image,) = row.images
        other = next(s for s in samples[i + 1:] + samples[:i] if not isinstance(s[0], str))[0]
        pictures = {"true": image, "blank": Image.new("RGB", image.size, (127, 127, 127)),
                    "swapped": other.convert("RGB").resize(image.size, Image.Resampling.BICUBIC)}
        images = {}
        for name, picture in pictures.items():
            p = process(picture, processor)
            assert p.num_tokens == row.num_tokens[0]
            images[name] = (p.pixel_values, [p.grid])
        out.append((torch.from_numpy(row.input_ids)[None], torch.from_numpy(row.labels)[None], images))
    return out


def _batch(rows, variant: str, pad_id: int, device):
    """Rows padded at their end to the longest (the model is causal: padding after a row's <eos> changes nothing
    before it), their images packed in row order."""
    T = max(ids.shape[1] for ids, _, _ in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.int64)
    labels = torch.full((len(rows), T), IGNORE, dtype=torch.int64)
    for b, (x, y, _) in enumerate(rows):
        ids[b, :x.shape[1]], labels[b, :y.shape[1]] = x[0], y[0]
    pixels = torch.cat([images[variant][0] for _, _, images in rows]).to(device)
    grids = [g for _, _, images in rows for g in images[variant][1]]
    return ids.to(device), labels.to(device), (pixels, grids)


@torch.no_grad()
def caption_loss(model, rows, pad_id: int, device, batch_size: int = 25) -> dict[str, float]:
    sums, tokens = dict.fromkeys(VARIANTS, 0.0), 0
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        for name in VARIANTS:
            ids, labels, images = _batch(chunk, name, pad_id, device)
            logits = model(ids, images=images)
            sums[name] += float(F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE,
                                                reduction="sum"))
        tokens += int((labels != IGNORE).sum())
    return {name: s / tokens for name, s in sums.items()} | {"tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from data.tokenizer import load_tokenizer
    from trainer.checkpoint import complete_checkpoints
    from trainer.checkpoint.loading import load_model, model_config, read_marker, run_tokenizer

    device = torch.device(args.device)
    ckpts = complete_checkpoints(args.run_dir / "checkpoints")
    if not ckpts:
        raise SystemExit(f"{args.run_dir}/checkpoints holds no complete checkpoint")
    seq_len, image_token_id, size_range, processor = _run_settings(args.run_dir)
    tok_path = run_tokenizer(ckpts[0])
    tok = load_tokenizer(tok_path)
    eos_id, pad_id = tok.token_to_id("<eos>"), tok.token_to_id("<pad>")
    rows = _rows(args.samples, args.seed, lambda s: tok.encode(s, add_special_tokens=False).ids, eos_id, seq_len,
                 image_token_id, size_range, processor)
    print(f"{len(rows)} held-out captioned images (image seed {args.seed}), {args.run_dir}")
    print(f"{'step':>6} {'true':>8} {'blank':>8} {'swapped':>8}   caption tokens")
    results = []
    for ckpt in ckpts:
        marker = read_marker(ckpt)
        cfg = model_config(marker.get("model"), None, [], ckpt)
        model = load_model(ckpt, cfg, device, tok_path)
        r = {"step": int(marker["step"]), **caption_loss(model, rows, pad_id, device)}
        results.append(r)
        print(f"{r['step']:>6} {r['true']:>8.4f} {r['blank']:>8.4f} {r['swapped']:>8.4f}   {r['tokens']}")
    if args.json:
        with open(args.json, "a") as f:
            for r in results:
                f.write(json.dumps({"run_dir": str(args.run_dir), "seed": args.seed, **r}) + "\n")


if __name__ == "__main__":
    main()
