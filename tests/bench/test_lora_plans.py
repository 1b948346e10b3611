"""bench/lora_plans.py: the shipped GPU examples planned with LoRA beside full fine-tuning. The committed result is
what the plan gives now, the performance doc's table is the result, and what LoRA changes holds (the frozen base's
gradients and optimizer state gone, a shorter update, the served adapter's sync bytes the PEFT adapter's)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import lora_plans  # noqa: E402


def test_the_result_file_is_the_plans_and_the_doc_its_table():
    fresh = lora_plans.run()
    assert json.loads(lora_plans.RESULT.read_text()) == json.loads(json.dumps(fresh))
    assert lora_plans.table(fresh) in (ROOT / "docs/performance.md").read_text()


def test_lora_trains_the_adapters_alone_on_every_example():
    for job in lora_plans.run()["jobs"]:
        full, merged, served = (job["variants"][v] for v in lora_plans.LORA)
        assert not merged["packed"] and full["packed"]  # the local spec takes no packed sequences on cuda
        # the frozen base: no fp32 gradients or Adam state of its own; the adapters' are a few % at most
        assert merged["actor_grads_gib"] < full["actor_grads_gib"] / 25
        assert merged["actor_optimizer_gib"] < full["actor_optimizer_gib"] / 100
        # the update's time: no weight gradients of the frozen base, but the local spec's unfused attention (see
        # tests/config/test_step_time.py for the terms by hand): predicted on every example
        assert merged["update_actor_s"] > 0 and merged["step_s"] > merged["update_actor_s"]
        # the weights vLLM serves are the same size: a merged sync writes the same shard
        assert merged["sync_bytes_per_vllm_rank"] == full["sync_bytes_per_vllm_rank"]
        if "refused" in served:  # vLLM serving adapters on experts is not built (the MoE job)
            assert "experts" in served["refused"][0]
            continue
        assert served["sync_bytes_per_vllm_rank"] < full["sync_bytes_per_vllm_rank"] / 10
