"""The data pipeline: `prepare` (corpus -> tokenizer + webdataset shards of token ids), `shards` (the on-disk
format), `loader` (rank/worker split, shuffle, packing, resumable position) and `config` (the `data` config
group, `ensure_prepared` and `build_dataloader`, which is what the trainer calls). Post-training: `chat` (the chat
template and its special tokens, docs/chat_template.md), `sft` (chat samples from JSONL / webdataset shards,
length-bucketed batches) and `envs/` (verifiable RL environments and the sandbox, docs/environments.md)."""
