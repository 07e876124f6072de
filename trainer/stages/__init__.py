"""The stages behind the one loop: the seam and pretraining (`base.py`: `Stage`, `Pretrain`, the `STAGES`
registry), the post-training stages (SPEC 2: SFT, RL on verifiable environments, on-policy distillation, the DSpark
drafter) and their schemas (`config.py`)."""
