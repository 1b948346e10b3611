#!/usr/bin/env python
"""The plan's GPU memory and predicted step of the shipped GPU examples with LoRA, beside full fine-tuning.

For each example (Qwen2.5-7B GRPO on 8 GPUs, Qwen2.5-32B GRPO on 4 x 8, Llama-3-70B PPO on 16 x 8, Qwen3-30B-A3B
GRPO on 4 x 8), three jobs planned by `hybridrl plan` with `trainer.hardware=h100-sxm`: as written (full
fine-tuning), with LoRA adapters merged into vLLM's weights at each sync (`lora.merge: true`, hybridrl's default),
and with vLLM serving them (`lora.merge: false`). LoRA is rank 32, alpha 64 on every target, the rank of verl's
Qwen3-30B-A3B LoRA script; on GPUs the adapters' actor runs megatron's local layer spec (with PyTorch's fused
attention), so its micro-batches are padded (it takes no packed sequences). Per job: the
actor's memory per GPU (parameters, gradients, optimizer state, activations in flight), the per-GPU peak over the
step's phases and whether it fits, the predicted step time with its update and sync, and the bytes a sync writes
into one vLLM rank (its shard of the merged weights, or the PEFT adapter). Plans only: seconds on a CPU.

    python bench/lora_plans.py            # prints the table; writes bench/results/lora_plans.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "bench" / "results" / "lora_plans.json"
EXAMPLES = "configs/examples"
HARDWARE = "h100-sxm"
RANK, ALPHA = 32, 64
JOBS = (
    ("Qwen2.5-7B GRPO, 8 GPUs", f"{EXAMPLES}/qwen2.5_7b_grpo_8gpu.yaml"),
    ("Qwen2.5-32B GRPO, 4 x 8", f"{EXAMPLES}/qwen2.5_32b_grpo_4x8.yaml"),
    ("Llama-3-70B PPO, 16 x 8", f"{EXAMPLES}/llama3_70b_ppo_16x8.yaml"),
    ("Qwen3-30B-A3B GRPO, 4 x 8", f"{EXAMPLES}/qwen3_30b_a3b_grpo_4x8.yaml"),
)
LORA = ("full", "lora merged", "lora served")


def overrides(variant: str) -> list[str]:
    """The command-line overrides of one variant (the example as written for "full")."""
    if variant == "full":
        return []
    return [f"actor_rollout_ref.model.lora.rank={RANK}", f"actor_rollout_ref.model.lora.alpha={ALPHA}",
            f"actor_rollout_ref.model.lora.merge={'true' if variant == 'lora merged' else 'false'}"]


def figures(config: str, variant: str) -> dict[str, object]:
    from hybridrl.config.errors import ConfigError
    from hybridrl.config.hardware import SHIPPED
    from hybridrl.config.plan import plan_from_sources, served_adapter_bytes
    from hybridrl.config.step_time import predict_step_time
    from hybridrl.names import Phase

    try:
        plan = plan_from_sources(str(ROOT / config), [*overrides(variant), f"trainer.hardware={HARDWARE}"])
    except ConfigError as refused:  # what is not built, as the plan words it
        return {"overrides": overrides(variant), "refused": [str(issue) for issue in refused.issues]}
    actor = next(m for m in plan.training_memory if m.role == "actor")
    gpu = plan.gpu_memory
    assert gpu is not None and plan.reshard.traffic is not None
    step = predict_step_time(plan, SHIPPED[HARDWARE])
    assert step is not None
    adapter = served_adapter_bytes(plan)
    return {
        "overrides": overrides(variant),
        "packed": plan.resolved.packed("actor"),
        "actor_params_gib": actor.params_gib, "actor_grads_gib": actor.grads_gib,
        "actor_optimizer_gib": actor.optimizer_gib, "actor_activations_in_flight_gib": actor.activations_gib_in_flight,
        "peak_phase": str(gpu.peak.name), "peak_gib": round(gpu.peak_gib, 2), "gpu_gib": gpu.gpu_gib,
        "fits": gpu.fits,
        "step_s": round(step.seconds, 2), "update_actor_s": round(step.phase(Phase.UPDATE_ACTOR), 2),
        "sync_s": round(step.phase(Phase.SYNC), 3),
        "sync_bytes_per_vllm_rank": adapter or max(plan.reshard.traffic.generation_shard_bytes),
    }


def table(result: dict[str, object]) -> str:
    """The Markdown table of docs/performance.md."""
    lines = ["| job | training | actor params / grads / optim / act GiB | peak GiB per GPU (phase) | step s "
             "(update, sync) | sync writes per vLLM rank |", "|---|---|---|---|---|---|"]
    for job in result["jobs"]:  # type: ignore[union-attr]
        for variant, r in job["variants"].items():
            if "refused" in r:
                lines.append(f"| {job['job']} | {variant} | refused at plan: {r['refused'][0].split(': ', 1)[-1]} "
                             "| | | |")
                continue
            lines.append(
                f"| {job['job']} | {variant} | {r['actor_params_gib']:.2f} / {r['actor_grads_gib']:.2f} / "
                f"{r['actor_optimizer_gib']:.2f} / {r['actor_activations_in_flight_gib']:.2f} | {r['peak_gib']:.1f} "
                f"({r['peak_phase']}){'' if r['fits'] else ' does not fit'} | {r['step_s']:.1f} "
                f"({r['update_actor_s']:.1f}, {r['sync_s']:.2f}) | {r['sync_bytes_per_vllm_rank'] / 1e9:.3g} GB |")
    return "\n".join(lines)


def run() -> dict[str, object]:
    jobs = [{"job": name, "config": config, "variants": {v: figures(config, v) for v in LORA}}
            for name, config in JOBS]
    return {"hardware": HARDWARE, "rank": RANK, "alpha": ALPHA, "jobs": jobs}


def main() -> int:
    sys.path.insert(0, str(ROOT))
    result = run()
    print(table(result))
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {RESULT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
