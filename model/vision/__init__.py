"""The image side of the model (SPEC 1.6, REFERENCE A12): DeepSeek-ViT, the pixel-unshuffle, the aligner into the
backbone's width and the placeholder layout (model/vision/vit.py). Built only where model.vision.num_layers > 0."""

from model.vision.vit import (Aligner, VisionEncoder, ViT, image_token_count, layout, patch_positions,
                              pixel_unshuffle, rope_2d_tables, varlen_attention)

__all__ = ["VisionEncoder", "ViT", "Aligner", "image_token_count", "patch_positions", "rope_2d_tables",
           "varlen_attention", "pixel_unshuffle", "layout"]
