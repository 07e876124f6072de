"""Checkpoints in and out, in one package:

- `checkpointer.py`: the run's DCP checkpoints (atomic, verified, keep-last-k, asynchronous saves, resharded on
  load); its public names are re-exported here (`from trainer.checkpoint import Checkpointer`);
- `loading.py`: a checkpoint of any layout, or its model config and tokenizer, read into one process;
- `init_from.py`: another run's weights, or a Hugging Face directory's, as a run's starting point
  (checkpoint.init_from);
- the Hugging Face format: `hf.py` (the official names and config keys), `hf_quant.py` (its quantised formats),
  `hf_io.py` (export and import, streaming).
"""

from trainer.checkpoint.checkpointer import (
    CHECKPOINT_FORMAT,
    COMPLETE_MARKER,
    PIECE_BYTES,
    RESUMABLE_MODEL_KEYS,
    CheckpointSaveError,
    Checkpointer,
    CorruptCheckpoint,
    PieceSavePlanner,
    RankLocalState,
    TrainState,
    complete_checkpoints,
    file_checksums,
    is_complete,
    model_config_differences,
    rank_and_world,
    row_ranges,
    step_dir_name,
    verify,
)

__all__ = ["CHECKPOINT_FORMAT", "COMPLETE_MARKER", "PIECE_BYTES", "RESUMABLE_MODEL_KEYS", "Checkpointer",
           "CheckpointSaveError", "CorruptCheckpoint", "PieceSavePlanner", "RankLocalState", "TrainState",
           "complete_checkpoints", "file_checksums", "is_complete", "model_config_differences", "rank_and_world",
           "row_ranges", "step_dir_name", "verify"]
