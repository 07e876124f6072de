"""The entry points, one module per command (`python -m trainer.cli.<name>`): each parses its command line, composes
its config, calls the library and reports (one line and an exit status for what it refuses). Nothing outside this
package imports it (tests/test_imports.py checks).

- `main`: training, every stage (console script `cedar-train`);
- `generate`: completions from a checkpoint;
- `export_hf`, `import_hf`: Cedar checkpoints to and from the Hugging Face format;
- `plan`: the memory and communication plan of a layout (trainer/memory_plan.py);
- `preflight`: the trainer's start-up checks against a world size, before a launcher starts any process;
- `stage_chain`: pretrain -> SFT -> RL -> distill -> DSpark, one run each (`make pipeline`);
- `evaluate`: the loss and perplexity of a checkpoint on a corpus or the SFT stage's held-out set;
- `report`: a summary table and an HTML page of plots of runs' metrics.jsonl, runs overlaid;
- `torchrun`: torchrun as the launchers run it: the failed rank's exit status, stop signals passed on to the
  ranks and kept pending until their handler is installed;
- `app`: what they share (a small app's main, one-line I/O errors, the process group of a torchrun launch).

The old paths (`python -m trainer.main`, `trainer.plan`, `trainer.pipeline`, ...) forward here.
"""
