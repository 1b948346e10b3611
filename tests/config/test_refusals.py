"""The table of single-field refusals (`config/refusals.py`), rule by rule: each rule's field, set to a value it
does not honour where the rule applies, is refused at plan time naming the field, that value, the rule's reason
and what would be valid; the job as shipped (every rule's honoured default) plans. Independent of the table's
code: the bad value of each rule is written here, and the job goes through `plan_from_sources` as a user's does."""
from __future__ import annotations

from pathlib import Path

import pytest

from hybridrl.config import ConfigError, plan_from_sources
from hybridrl.config.refusals import REFUSALS, Refusal

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs/examples/cpu_tiny_grpo.yaml")
MODEL = f"actor_rollout_ref.model.path={ROOT / 'configs/models/tiny-demo'}"
# what makes a rule apply on the CPU demo (enforce_eager's holds on cpu as it is; cpu_kv_cache_gib's on cuda, which
# plans here without a GPU)
CONTEXT = {"actor_rollout_ref.model.lora.": ["actor_rollout_ref.model.lora.rank=8"],
           "actor_rollout_ref.ref.megatron.": ["actor_rollout_ref.ref.megatron.tensor_model_parallel_size=1"],
           "actor_rollout_ref.rollout.cpu_kv_cache_gib": ["trainer.device=cuda"]}
# a value each rule does not honour, by field name
BAD = {"make_vocab_size_divisible_by": 64, "optimizer_offload": True, "grad_offload": True,
       "use_distributed_optimizer": False,
       "tool_error_penalty": -0.5, "path": "turns.py", "calculate_log_probs": False, "tokenizer_path": "/tmp",
       "trust_remote_code": True, "enable_gradient_checkpointing": True, "cpu_kv_cache_gib": 4, "enforce_eager": False,
       "rank": 8, "dropout_position": "post", "dtype": "bf16", "a2a_experimental": True, "freeze_vision_model": False,
       "freeze_vision_projection": False}


def _context(rule: Refusal) -> list[str]:
    return [override for prefix, overrides in CONTEXT.items() if rule.field.startswith(prefix)
            for override in overrides]


def test_every_rule_has_a_bad_value_here():
    assert {rule.field.rsplit(".", 1)[1] for rule in REFUSALS} == set(BAD)
    assert len(REFUSALS) == len({rule.field for rule in REFUSALS})  # one rule a field


@pytest.mark.parametrize("rule", REFUSALS, ids=[rule.field for rule in REFUSALS])
def test_each_rule_refuses_a_value_it_does_not_honour_naming_the_field(rule):
    bad = BAD[rule.field.rsplit(".", 1)[1]]
    overrides = [MODEL, *_context(rule), f"{rule.field}={str(bad).lower() if isinstance(bad, bool) else bad}"]
    with pytest.raises(ConfigError) as info:
        plan_from_sources(CONFIG, overrides)
    found = [issue for issue in info.value.issues if issue.field == rule.field]
    assert len(found) == 1, [str(issue) for issue in info.value.issues]
    assert found[0].value == bad and found[0].rule == rule.reason
    assert tuple(found[0].valid) == (rule.valid or rule.honoured)
    plan_from_sources(CONFIG, [MODEL, *_context(rule)])  # the honoured default plans


def test_a_rule_holds_only_where_it_applies():
    """LoRA's unbuilt options mean nothing without adapters; enforce_eager=false is honoured on cuda, and
    cpu_kv_cache_gib on cpu."""
    plan_from_sources(CONFIG, [MODEL, "actor_rollout_ref.model.lora.dropout_position=post"])
    with pytest.raises(ConfigError) as info:
        plan_from_sources(CONFIG, [MODEL, "actor_rollout_ref.rollout.enforce_eager=false"])
    assert [i.field for i in info.value.issues] == ["actor_rollout_ref.rollout.enforce_eager"]
    cuda = plan_from_sources(CONFIG, [MODEL, "trainer.device=cuda", "actor_rollout_ref.rollout.enforce_eager=false"])
    assert cuda.config.actor_rollout_ref.rollout.enforce_eager is False
    cpu = plan_from_sources(CONFIG, [MODEL, "actor_rollout_ref.rollout.cpu_kv_cache_gib=4"])
    assert cpu.config.actor_rollout_ref.rollout.cpu_kv_cache_gib == 4
