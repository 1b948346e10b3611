"""HF ⇄ megatron-core model bridge: config mapping, weight layout, checkpoint IO, `hybridrl convert`.

Modules (import the one you need; this package imports nothing on its own):
- `arch`: torch-free `ModelShape.from_hf_config(dict)` (sizes, param count, parallel fit, megatron
  config values) and the supported-architecture registry.
- `layout`: torch-free layout math: `ParallelLayout` (TP/PP/VPP, layer ownership) and per-tensor
  `TensorPlan`s mapping megatron shards to HF tensor ranges.
- `checkpoint`: readers/writers for HF folders and hybridrl's sharded megatron checkpoints.
- `bridge`: build this rank's `GPTModel`s, load weights, save checkpoints, export HF (collective).
- `convert_cli`: the `hybridrl convert` subcommand.
"""
