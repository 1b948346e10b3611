"""Settings the workers would not honour, as one table: each rule names a field, the values that are honoured, why
any other is refused, and when the rule applies.

Checked at plan time by `check_refusals` (called from `config.validate`), so that no setting is silently dropped:
each refused value is one `ConfigIssue` naming the field, the value, the reason and what would be valid. The rules
here are the ones a single field decides ("this key has no effect here", "only this value is built"); a rule that
needs arithmetic or several fields at once (layouts, batch sizes, lengths) stays a function of `config.validate`.
Torch-free.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from hybridrl.config.errors import ConfigIssue
from hybridrl.config.schema import JobConfig
from hybridrl.models.arch import DEFAULT_VOCAB_DIVISOR
from hybridrl.parallel.device_policy import DEVICE_POLICIES, DevicePolicy

LORA = "actor_rollout_ref.model.lora"
FROZEN = {"actor_rollout_ref.ref.megatron": "reference policy", "reward_model.megatron": "reward model",
          "teacher.megatron": "teacher"}


def _always(config: JobConfig) -> bool:
    return True


@dataclass(frozen=True)
class Refusal:
    """`field` (a dotted path into the job) must hold one of `honoured` wherever `applies(config)`; any other value
    is refused for `reason`, naming `valid` (default: `honoured`) as what would do."""

    field: str
    honoured: tuple[object, ...]
    reason: str
    applies: Callable[[JobConfig], bool] = _always
    valid: tuple[object, ...] | None = None


def field_value(config: JobConfig, path: str) -> object:
    """The value at a dotted path of the job (`actor_rollout_ref.rollout.calculate_log_probs`)."""
    return functools.reduce(getattr, path.split("."), config)


def check_refusals(config: JobConfig, issues: list[ConfigIssue]) -> None:
    """Append a `ConfigIssue` for every rule of `REFUSALS` the job breaks."""
    for rule in REFUSALS:
        if not rule.applies(config):
            continue
        value = field_value(config, rule.field)
        if value not in rule.honoured:  # the loader has checked the field's type
            valid = rule.honoured if rule.valid is None else rule.valid
            issues.append(ConfigIssue(rule.field, value, rule.reason, valid))


# --------------------------------------------------------------------------------------------- conditions
def _policy(config: JobConfig) -> DevicePolicy | None:
    """The device's policy; None for an unknown trainer.device (reported by the trainer checks: the device rules
    are skipped)."""
    return DEVICE_POLICIES.get(config.trainer.device)


def _device_lacks(feature: str) -> Callable[[JobConfig], bool]:
    """On a known device whose policy says `feature` is False."""
    def applies(config: JobConfig) -> bool:
        policy = _policy(config)
        return policy is not None and not getattr(policy, feature)
    return applies


def _multi_turn_off(config: JobConfig) -> bool:
    return config.actor_rollout_ref.rollout.multi_turn.enable is False


def _lora_on(config: JobConfig) -> bool:
    rank = config.actor_rollout_ref.model.lora.rank
    return isinstance(rank, int) and not isinstance(rank, bool) and rank > 0


def _ref_layout_set(config: JobConfig) -> bool:
    return config.actor_rollout_ref.ref.megatron is not None


def _section_present(section: str) -> Callable[[JobConfig], bool]:
    return _ref_layout_set if section == "actor_rollout_ref.ref.megatron" else _always


def _role(section: str) -> str:
    return section.split(".")[0].replace("_", " ")


# -------------------------------------------------------------------------------------------------- rules
def _rules() -> Iterator[Refusal]:
    megatron = ("actor_rollout_ref.actor.megatron", "actor_rollout_ref.ref.megatron", "critic.megatron",
                "reward_model.megatron", "teacher.megatron")
    for section in megatron:
        yield Refusal(f"{section}.make_vocab_size_divisible_by", (DEFAULT_VOCAB_DIVISOR,),
                      f"is fixed: the model bridge and checkpoints pad the vocabulary to a multiple of "
                      f"{DEFAULT_VOCAB_DIVISOR} × TP; only {DEFAULT_VOCAB_DIVISOR} is supported",
                      _section_present(section))
    for section, role in FROZEN.items():
        for name, what in (("optimizer_offload", "optimizer"), ("grad_offload", "gradients")):
            yield Refusal(f"{section}.{name}", (False, None), f"has no effect: the {role} is frozen (no {what})",
                          _section_present(section), valid=(False,))
        # verl's frozen sections carry it too, true (engine/megatron.yaml): only that value means nothing here
        yield Refusal(f"{section}.use_distributed_optimizer", (True, None),
                      f"has no effect: the {role} is frozen (no optimizer state to shard over data parallelism)",
                      _section_present(section), valid=(True,))
    for name, default in (("tool_error_penalty", 0.0), ("path", None)):
        # per-turn rewards exist only in multi-turn rollouts
        yield Refusal(f"actor_rollout_ref.rollout.multi_turn.turn_reward.{name}", (default,),
                      "has no effect while actor_rollout_ref.rollout.multi_turn.enable=false (per-turn rewards are "
                      "given to the turns of multi-turn rollouts); enable multi_turn or leave it unset",
                      _multi_turn_off)
    yield Refusal("actor_rollout_ref.rollout.calculate_log_probs", (True,),
                  "cannot be turned off: the rollout always returns its log-probs (the trainer measures the "
                  "rollout-vs-trainer gap with them); only true is supported")
    for section in ("critic", "reward_model", "teacher"):
        yield Refusal(f"{section}.model.tokenizer_path", (None,),
                      f"is not supported: the {_role(section)} reads the policy's token ids, so it uses the policy's "
                      "tokenizer; leave it null")
        yield Refusal(f"{section}.model.trust_remote_code", (False, None),
                      f"has no effect: the {_role(section)} is built from config.json and safetensors by the model "
                      "bridge, which runs no code from the model folder", valid=(False,))
    for section in ("reward_model", "teacher"):
        yield Refusal(f"{section}.model.enable_gradient_checkpointing", (False, None),
                      f"has no effect: the {_role(section)} is frozen (forward only, nothing to recompute)",
                      valid=(False,))
    yield Refusal("actor_rollout_ref.rollout.cpu_kv_cache_gib", (None,),
                  "applies on trainer.device=cpu only: on cuda vLLM sizes its KV cache from gpu_memory_utilization; "
                  "leave it null", _device_lacks("vllm_kv_cache_from_plan"))
    yield Refusal("actor_rollout_ref.rollout.enforce_eager", (None, True),
                  "has no effect on trainer.device=cpu (CUDA graphs are a GPU feature): vLLM runs eagerly on CPU; "
                  "leave it null (or true)", _device_lacks("vllm_honours_enforce_eager"))
    for section in ("critic", "reward_model", "teacher"):
        yield Refusal(f"{section}.model.lora.rank", (0,),
                      "LoRA adapts the actor only (actor_rollout_ref.model.lora); the critic trains its whole model, "
                      "the reward model and the teacher score with theirs")
    for name, honoured, reason in (
            ("dropout_position", ("pre",), "dropout after the adapter (post) is not built"),
            ("dtype", ("fp32", None), "adapters train in fp32 (null or fp32); lower precision is not built"),
            ("a2a_experimental", (False,), "Megatron-Bridge's all-to-all adapters are not built"),
            ("freeze_vision_model", (True,), "hybridrl trains text models (no vision tower)"),
            ("freeze_vision_projection", (True,), "hybridrl trains text models")):
        yield Refusal(f"{LORA}.{name}", honoured, reason, _lora_on, valid=honoured[:1])


REFUSALS: tuple[Refusal, ...] = tuple(_rules())
