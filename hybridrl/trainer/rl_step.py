"""The controller's own math in a step, on whole batches: rewards -> KL -> advantages.

Everything here is a pure function of a `Batch` (plus a KL controller), so the trainer loop stays a
schedule of calls and each piece is tested against hand-computed numbers. Tensor math lives in
`hybridrl.algorithms`; this module only decides which columns feed which function.

Column names (the step's shared vocabulary):
  responses, response_mask [B, R]   sampled tokens and which of them count
  token_level_scores [B, R]         reward function / model output, on the last response token
                                    (+ multi-turn per-turn rewards on each model turn's last token)
  turn_scores [B, R]                the rollout's per-turn rewards (multi_turn.turn_reward), when set
  token_level_rewards [B, R]        scores minus the in-reward KL penalty (if any)
  old_log_probs, ref_log_probs [B, R], values [B, R]
  teacher_log_probs [B, R]          on-policy distillation: the teacher's log-prob of each sampled token
  advantages, returns [B, R]
  uid (non-tensor)                  the prompt a sample came from: GRPO's group
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from hybridrl.algorithms import compute_advantages, kl_penalty, masked_mean
from hybridrl.algorithms.distillation import distillation_advantages, reverse_kl_metrics, reverse_kl_per_token
from hybridrl.algorithms.kl_control import FixedKLController
from hybridrl.data.batch import Batch


def add_turn_scores(token_scores: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
    """`token_scores` (the trajectory's reward on its last model token) plus the rollout's per-turn rewards
    (`turn_scores`, on each model turn's last token; `hybridrl.rollout.turn_rewards`), when the batch has
    them; and the `reward/turn_score_mean` metric (per sample, the sum of its turns' rewards)."""
    if "turn_scores" not in batch:
        return token_scores, {}
    turn_scores = batch.tensor("turn_scores").to(token_scores.dtype) * (batch.tensor("response_mask") != 0)
    if turn_scores.shape != token_scores.shape:
        raise ValueError(f"turn_scores {tuple(turn_scores.shape)} and token scores {tuple(token_scores.shape)} "
                         "differ in shape")
    return token_scores + turn_scores, {"reward/turn_score_mean": float(turn_scores.sum(-1).mean())}


@dataclass(frozen=True)
class AdvantageSettings:
    estimator: str
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True


def apply_kl_in_reward(batch: Batch, controller: FixedKLController, kind: str) -> dict[str, float]:
    """token_level_rewards = token_level_scores - beta * KL(old || ref), per token; updates the controller.

    Returns metrics: the batch KL (mean over sequences of the masked token mean) and beta used.
    """
    mask = batch.tensor("response_mask").float()
    kl = kl_penalty(batch["old_log_probs"], batch["ref_log_probs"], kind) * mask
    beta = controller.value
    batch["token_level_rewards"] = batch["token_level_scores"] - beta * kl
    per_sequence = (kl.sum(-1) / mask.sum(-1).clamp(min=1))
    current_kl = float(per_sequence.mean())
    controller.update(current_kl, n_steps=len(batch))
    return {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": float(beta)}


def compute_batch_advantages(batch: Batch, settings: AdvantageSettings) -> None:
    """Fill `advantages` and `returns` from `token_level_rewards` with the configured estimator."""
    extra = {}
    if settings.estimator == "gae":
        extra["values"] = batch["values"]
    if "uid" in batch:
        extra["group_index"] = batch["uid"]
    if "baseline_scores" in batch:
        extra["baseline_scores"] = batch["baseline_scores"]
    advantages, returns = compute_advantages(
        settings.estimator, batch["token_level_rewards"], batch["response_mask"],
        gamma=settings.gamma, lam=settings.lam, norm_by_std=settings.norm_adv_by_std_in_grpo, **extra,
    )
    batch["advantages"] = advantages
    batch["returns"] = returns


def add_distillation_advantages(batch: Batch, kl_coef: float, *, with_task_reward: bool,
                                in_advantage: bool = True) -> dict[str, float]:
    """On-policy distillation's per-token reverse KL (student - teacher log-prob of the sampled token, the student's
    being the old log-probs) and its metrics. `in_advantage` (sampled_reverse_kl): each model token's advantage
    gains -kl_coef x it, added to the task reward's advantages (`with_task_reward`) or alone (pure distillation:
    `advantages` and `returns` are it). Not `in_advantage` (top_k_forward_kl: the signal is the update's loss term):
    the task reward's advantages stay as they are, and without a task reward they are zero."""
    mask = batch["response_mask"]
    reverse_kl = reverse_kl_per_token(batch["old_log_probs"], batch["teacher_log_probs"], mask)
    distilled = distillation_advantages(reverse_kl, kl_coef) if in_advantage else torch.zeros_like(reverse_kl)
    if with_task_reward:
        batch["advantages"] = batch["advantages"] + distilled
    else:
        batch["advantages"] = distilled
        batch["returns"] = distilled
    return reverse_kl_metrics(reverse_kl, mask)


def baseline_per_row(row_uids: Iterable[object], prompt_uids: Iterable[object],
                     prompt_scores: torch.Tensor) -> torch.Tensor:
    """Each row's baseline: the score of its prompt (matched by uid), e.g. ReMax's greedy response."""
    by_uid = {uid: i for i, uid in enumerate(prompt_uids)}
    rows = list(row_uids)
    missing = sorted({str(u) for u in rows if u not in by_uid})
    if missing:
        raise ValueError(f"no baseline response for prompt uid(s) {missing[:5]}")
    return prompt_scores.float()[torch.tensor([by_uid[u] for u in rows], dtype=torch.long)]


def overlong_penalty(response_lengths: torch.Tensor, max_length: int, buffer: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment per sequence.

    0 up to `max_length - buffer` tokens, then falling linearly to `-factor` at `max_length`
    (and staying there beyond it). `buffer=0` is a hard cliff at `max_length`.
    """
    lengths = response_lengths.float()
    start = max_length - buffer
    if buffer <= 0:
        return torch.where(lengths > max_length, torch.full_like(lengths, -factor), torch.zeros_like(lengths))
    over = ((lengths - start) / buffer).clamp(min=0.0, max=1.0)
    return -factor * over


def groups_with_reward_spread(scores: torch.Tensor, uids: np.ndarray) -> np.ndarray:
    """Row mask keeping only groups (same uid) whose scores are not all equal (DAPO dynamic sampling).

    A group with one sample, or whose samples all scored the same, has zero advantage under GRPO
    and only dilutes the batch.
    """
    scores = scores.float()
    keep: np.ndarray = np.zeros(len(uids), dtype=bool)
    by_uid: dict[object, list[int]] = {}
    for row, uid in enumerate(uids):
        by_uid.setdefault(uid, []).append(row)
    for rows in by_uid.values():
        group = scores[rows]
        if len(rows) > 1 and bool((group != group[0]).any()):
            keep[rows] = True
    return keep


def _sequence_scores(batch: Batch) -> torch.Tensor:
    return (batch["token_level_scores"] * batch["response_mask"]).sum(-1)


def count_groups_with_spread(batches: list[Batch]) -> int:
    return sum(len(set(b["uid"][groups_with_reward_spread(_sequence_scores(b), b["uid"])])) for b in batches)


def select_groups_with_spread(batches: list[Batch], groups_needed: int) -> tuple[Batch, int]:
    """Exactly `groups_needed` whole groups from scored batches: groups with reward spread first
    (in generation order), then zero-spread groups to fill. Returns the batch and how many
    zero-spread groups were used."""
    kept, spare = [], []
    for batch in batches:
        keep = groups_with_reward_spread(_sequence_scores(batch), np.asarray(batch["uid"], dtype=object))
        kept.append(batch.index(np.nonzero(keep)[0]))
        spare.append(batch.index(np.nonzero(~keep)[0]))
    pool = Batch.concat([b for b in kept + spare if len(b)])
    spread_groups = sum(len(set(b["uid"])) for b in kept)
    order: list[int] = []
    seen: list[object] = []
    for row, uid in enumerate(pool["uid"]):
        if uid not in seen:
            if len(seen) == groups_needed:
                continue
            seen.append(uid)
        order.append(row)
    if len(seen) < groups_needed:
        raise ValueError(f"only {len(seen)} groups were generated, {groups_needed} are needed")
    return pool.index(order), max(0, groups_needed - spread_groups)


def prompt_lengths(batch: Batch) -> torch.Tensor:
    """Tokens of each row's prompt `[B]` (the left-padded columns before the responses)."""
    width = batch["responses"].shape[1]
    return batch["attention_mask"][:, :-width].sum(-1)


def response_lengths(batch: Batch) -> torch.Tensor:
    """Tokens of each response `[B]`: every token after the prompt, a multi-turn conversation's
    observation tokens included (the budget counts them; `response_mask` marks only the model's)."""
    width = batch["responses"].shape[1]
    return batch["attention_mask"][:, -width:].sum(-1)


def rollout_log_prob_gap(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                         response_mask: torch.Tensor) -> dict[str, float]:
    """`rollout/log_prob_abs_diff_{max,mean}`: |trainer - rollout| log-prob over the response tokens
    (max and token mean): a numerics and sync health check, and with MoE what routing replay closes."""
    mask = response_mask.to(torch.float64)
    gap = (old_log_probs.to(torch.float64) - rollout_log_probs.to(torch.float64)).abs() * mask
    return {"rollout/log_prob_abs_diff_max": float(gap.max()),
            "rollout/log_prob_abs_diff_mean": float(gap.sum() / mask.sum().clamp(min=1))}


def response_metrics(batch: Batch) -> dict[str, float]:
    """Scores, rewards, advantages and lengths of a step's responses (what the console table shows)."""
    mask = batch.tensor("response_mask").float()
    lengths = response_lengths(batch).float()
    prompts = prompt_lengths(batch).float()
    metrics = {
        "prompt_length/mean": float(prompts.mean()),
        "prompt_length/max": float(prompts.max()),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/clip_ratio": float((lengths >= batch["responses"].shape[1]).float().mean()),
    }
    model_tokens = mask.sum(-1)
    if not torch.equal(model_tokens, lengths):  # multi-turn: the model wrote only part of each response
        metrics["response_length/model_tokens_mean"] = float(model_tokens.mean())
    for key, name in (("token_level_scores", "critic/score"), ("token_level_rewards", "critic/rewards")):
        if key in batch:
            per_seq = (batch[key] * mask).sum(-1)
            metrics[f"{name}/mean"] = float(per_seq.mean())
            metrics[f"{name}/max"] = float(per_seq.max())
            metrics[f"{name}/min"] = float(per_seq.min())
    if "advantages" in batch:
        metrics["critic/advantages/mean"] = float(masked_mean(batch["advantages"], mask))
    if "values" in batch:
        metrics["critic/values/mean"] = float(masked_mean(batch["values"], mask))
    return metrics
