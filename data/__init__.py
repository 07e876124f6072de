"""The data pipeline: `prepare` (corpus -> tokenizer + webdataset shards of token ids), `shards` (the on-disk
format), `loader` (rank/worker split, shuffle, packing, resumable position) and `config` (the `data` config
group, `ensure_prepared` and `build_dataloader`, which is what the trainer calls)."""
