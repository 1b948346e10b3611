"""The resharder's rank side, shared by the resharder's tests and the strict-device test: build this rank's
megatron chunks from an HF folder, reshard them into vLLM's layout (`reshard_rank`), or sync them into a live
vLLM engine in the same process (`deliver_rank`)."""
from __future__ import annotations

from typing import Any

import torch

from hybridrl.config.meshes import build_reshard_groups, build_training_mesh

CHANGED_LAYER = 1
DELTA = 1e-3


def add_to_layer(models: list[Any], layer: int, delta: float) -> None:
    """Add `delta` to every parameter of global decoder layer `layer` on this rank (a 'training step')."""
    with torch.no_grad():
        for model in models:
            chunk = model.hybridrl.chunk
            if layer in chunk.layers:
                prefix = f"decoder.layers.{layer - chunk.first_layer}."
                for name, param in model.named_parameters():
                    if name.startswith(prefix):
                        param.add_(delta)


def reshard_rank(rank: int, world_size: int, hf_dir: str, tp: int, pp: int, vpp: int | None, infer_tp: int,
                  bucket_bytes: int, swapped: bool = False, change: bool = False,
                  vllm_default_groups: bool = False, dtype: str | None = None,
                  split: tuple[int | None, int | None] = (None, None), keep_buffers: bool = False) -> dict[str, Any]:
    from hybridrl.models.bridge import build_gpt_models, load_weights
    from hybridrl.parallel.state import destroy_model_parallel, initialize_model_parallel
    from hybridrl.reshard.resharder import ReshardConfig, Resharder

    # split: layers on the (first, last) pipeline stage, None = even; the resharder's mesh takes it
    # from the parallel context
    initialize_model_parallel(tp=tp, pp=pp, vpp=vpp, device="cpu", first_stage_layers=split[0],
                              last_stage_layers=split[1])
    try:
        models = build_gpt_models(hf_dir, dtype=dtype)
        load_weights(models, hf_dir)
        groups = build_reshard_groups(build_training_mesh(world_size, tp, pp, vpp=vpp), infer_tp)
        config = ReshardConfig(bucket_bytes=bucket_bytes, keep_buffers=keep_buffers)
        # vLLM's own TP groups are consecutive ranks (TP rank = rank % infer_tp), whatever the Plan says
        override = [r % infer_tp for r in range(world_size)] if vllm_default_groups else None
        resharder = Resharder(models, groups, config=config, gen_tp_index=override)
        out: dict[str, Any] = {"shards": resharder.reshard(), "report": resharder.last_report}
        if swapped:  # a deliberately wrong grouping: every rank builds its replica peer's shard
            wrong = tuple(infer_tp - 1 - j for j in groups.gen_tp_index)
            bad = Resharder(models, groups, config=config, gen_tp_index=wrong)
            out["swapped_shards"], out["swapped_report"] = bad.reshard(), bad.last_report
        if change:
            add_to_layer(models, CHANGED_LAYER, DELTA)
            out["changed_shards"] = resharder.reshard()  # the same resharder: it reads the live parameters
        if resharder._scratch is not None:  # the kept buffers: held, and never what a shard is made of
            kept = {t.untyped_storage().data_ptr() for t in resharder._scratch._flat.values()}
            out["kept_bytes"] = resharder._scratch.held_bytes
            produced = [(n, t) for key in ("shards", "changed_shards") for n, t in out.get(key, {}).items()]
            out["shards_in_kept_buffers"] = [n for n, t in produced if t.untyped_storage().data_ptr() in kept]
        return out
    finally:
        destroy_model_parallel()



DELIVERY_PROMPTS = [[5, 6, 7], [9, 8, 7, 6, 5]]
DELIVERY_DELTA = 0.05  # large enough that greedy tokens and log-probs visibly move


def deliver_rank(rank: int, world_size: int, hf_dir: str, tp: int, pp: int, infer_tp: int) -> dict[str, Any]:
    """Colocated as in the actor: megatron first, then the engine; a 'training step' changes layer 0;
    the resharder's stream goes straight into the engine (vLLM shard format); digests are compared."""
    from hybridrl.models.bridge import build_gpt_models, load_weights
    from hybridrl.parallel.state import destroy_model_parallel, initialize_model_parallel
    from hybridrl.reshard.checksums import compare_checksums
    from hybridrl.reshard.resharder import Resharder, check_rollout_placement
    from hybridrl.rollout.sampling import validation_sampling
    from tests.support.rollout_scenarios import make_engine

    initialize_model_parallel(tp=tp, pp=pp, device="cpu")
    try:
        models = build_gpt_models(hf_dir)
        load_weights(models, hf_dir)
        engine = make_engine(hf_dir, infer_tp=infer_tp, capture_loaded_weights=True)
        groups = build_reshard_groups(build_training_mesh(world_size, tp, pp), infer_tp)
        resharder = Resharder(models, groups)
        check_rollout_placement(resharder, engine.tp_rank)
        add_to_layer(models, 0, DELIVERY_DELTA)
        engine.update_weights(resharder.shards(), weight_format="vllm_shard")
        report = resharder.last_report
        mismatches = compare_checksums(report.checksums, engine.parameter_digests(), rank)
        greedy = engine.generate_sequences(DELIVERY_PROMPTS, validation_sampling(max_tokens=6))
        return {"mismatches": mismatches, "greedy": greedy, "report": report, "tp_rank": engine.tp_rank}
    finally:
        destroy_model_parallel()
