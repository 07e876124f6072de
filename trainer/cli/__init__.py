"""The entry points, one module per command (`python -m trainer.cli.<name>`): each parses its command line, composes
its config, calls the library and reports (one line and an exit status for what it refuses). Nothing outside this
package imports it (tests/test_imports.py checks).

`main`: training, every stage (console script `cedar-train`); `generate`: completions from a checkpoint; `evaluate`:
the loss and perplexity of a checkpoint; `report`: a table and an HTML page of plots of runs' metrics.jsonl;
`export_hf`, `import_hf`: Cedar checkpoints to and from the Hugging Face format; `plan`: the memory and
communication plan of a layout; `preflight`: the trainer's start-up checks against a world size; `stage_chain`:
pretrain -> SFT -> RL -> distill -> DSpark (`make pipeline`); `torchrun`: torchrun as the launchers run it; `app`:
what they share. The old paths (`python -m trainer.main`, `trainer.plan`, `trainer.pipeline`, ...) forward here.

Each command in full: docs/data_flow.md#the-commands
"""
