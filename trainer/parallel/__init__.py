"""Parallelism applied from outside the model: the device mesh, and the plans that shard a built model.

Mesh axes, outermost first: pp, dp_replicate, dp_shard, ep, cp, tp (Megatron's pipeline, data, expert, context and
tensor parallel sizes). Every axis exists (size 1 when unused), so code can always ask `mesh["tp"]`.
Ranks that read different data: dp_replicate x dp_shard x ep; cp ranks split one sequence; tp ranks share it.
"""
