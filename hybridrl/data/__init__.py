"""Prompts in, batches out.

- `batch`: the `Batch` container shared by controller and workers.
- `dataset`: `PromptDataset` (parquet/JSONL via pyarrow, chat template, over-long filtering).
- `dataloader`: `collate_prompts` (left padding into a `Batch`) and the resumable `PromptDataLoader`.
- `tokenizer`: the demo's locally built character tokenizer and `load_tokenizer` for any kind.
- `demo_task`: the CPU demo's synthetic "repeat the letter" task and its scorer.
- `secret_task`: the tool-use demo's "secret letter" task (the answer only a tool knows) and its scorer.
- `arith_task`: `make demo-real`'s arithmetic word problems (seeded generator) and their scorer (the math
  answer scorer, last number when unboxed).
- `gsm8k`, `io`: GSM8K conversion and row writers used by `tools/`.

Nothing is imported here, so `import hybridrl.data.batch` does not pull in pyarrow or transformers.
"""
