"""The post-training stages (SPEC 2): SFT, RL on verifiable environments, on-policy distillation, on the
trainer/stages/base.py seam. `config.py` holds their schemas."""
