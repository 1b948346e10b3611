"""The critic's and the reward model's sides of the value-model tests: one critic update and the reward model's
scores in forked ranks, and their independent references (transformers + plain torch: the critic's values and one
AdamW step; transformers' sequence-classification scores). Shared by tests/training/test_critic.py,
tests/training/test_packing.py, tests/training/test_context_parallel.py and tests/training/test_strict_device.py."""
from __future__ import annotations

from typing import Any

import torch

from tests.support.training_fixtures import RESPONSE, policy_model, rollout_batch, sequence_classifier


def critic_rank(rank: int, world: int, config: Any, batch: Any) -> Any:
    from hybridrl.config.plan import build_plan
    from hybridrl.training.backend import MegatronBackend, role_spec
    from hybridrl.training.critic import MegatronCritic

    plan = build_plan(config)
    critic = MegatronCritic(MegatronBackend(role_spec(plan, "critic")), plan)
    torch_adam = critic.backend.optimizer.optimizer  # megatron's fallback to torch's AdamW (no TE/apex)
    # CPU (`DevicePolicy.optimizer_state_at_setup`): Adam's moments exist before the first step
    state_at_setup = all(torch_adam.state[p] for group in torch_adam.param_groups for p in group["params"])
    ctx = critic.backend.ctx
    chunk = batch.split(ctx.dp)[ctx.dp_rank]
    before = critic.compute_values(chunk)
    metrics = critic.update_critic(chunk)
    after = critic.compute_values(chunk)
    shared = critic.backend.tokens_seen.ratios(ctx.dp_group)[1]  # every rank: a DP collective
    if before is None:
        return None
    return {"before": before["values"].clone(), "after": after["values"].clone(), "metrics": metrics,
            "fused": [group["fused"] for group in torch_adam.param_groups], "state_at_setup": state_at_setup,
            "shared_ratio": shared}


def reference_critic(path: Any, batch: Any) -> dict[str, Any]:
    import transformers
    from safetensors.torch import load_file

    from hybridrl.algorithms.losses import value_loss

    model = transformers.LlamaModel.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    score = torch.nn.Parameter(load_file(str(path / "model.safetensors"))["score.weight"].clone())
    params = [*model.parameters(), score]
    width = batch["input_ids"].shape[1]
    mask = batch["response_mask"].float()

    def values() -> torch.Tensor:
        hidden = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).last_hidden_state
        return (hidden[:, width - RESPONSE - 1: width - 1] @ score.t()).squeeze(-1) * mask

    before = values()
    loss, _ = value_loss(before, batch["values"], batch["returns"], mask, 0.2, "token-mean")
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
    torch.optim.AdamW(params, lr=1e-2, eps=1e-5, weight_decay=0.0).step()
    with torch.no_grad():
        after = values()
    return {"before": before.detach(), "after": after, "loss": float(loss), "grad_norm": float(norm)}


def reward_rank(rank: int, world: int, config: Any, batch: Any) -> Any:
    from hybridrl.config.plan import build_plan
    from hybridrl.training.backend import MegatronBackend, role_spec
    from hybridrl.training.reward_model import MegatronRewardModel

    plan = build_plan(config)
    rm = MegatronRewardModel(MegatronBackend(role_spec(plan, "reward_model")), plan)
    out = rm.compute_scores(batch)
    return None if out is None else out["rm_scores"].clone()


def reward_model_case(tmp_path: Any) -> tuple[Any, Any, Any, torch.Tensor]:
    """(reward model folder, policy folder, batch, transformers' scores of the batch): the reference."""
    import transformers

    rm = sequence_classifier(tmp_path / "rm")
    hf = policy_model(tmp_path / "policy")
    batch = rollout_batch(8, seed=3)
    model = transformers.LlamaForSequenceClassification.from_pretrained(rm, dtype=torch.float32,
                                                                        attn_implementation="eager")
    with torch.no_grad():
        expected = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         position_ids=batch["position_ids"]).logits.squeeze(-1)
    return rm, hf, batch, expected
