"""Parallelism applied from outside the model: the device mesh, and the plans that shard a built model, all here
(the model sees no process group): `apply.py` (the one entry, in a fixed order), tensor and sequence (`tensor.py`),
expert (`expert.py`), context (`context.py`), pipeline (`pipeline.py`, `pipeline_wire.py`, `zero_bubble.py`), Engram
row sharding (`engram.py`), activation checkpointing, compile, data parallel (FSDP2, in `apply.py`); gradient
reduction and clipping for every layout in `gradients.py`.

Mesh axes, outermost first: pp, dp_replicate, dp_shard, ep, cp, tp (Megatron's pipeline, data, expert, context and
tensor parallel sizes). Every axis exists (size 1 when unused), so code can always ask `mesh["tp"]`.
Ranks that read different data: dp_replicate x dp_shard x ep; cp ranks split one sequence; tp ranks share it.
"""
