"""On-policy distillation's signal: the per-token reverse KL between the student and the teacher.

The student (the policy) samples y; a frozen teacher scores the same tokens. On a sampled token the reverse KL
KL(pi_student || pi_teacher) is estimated without bias by

    k_t = log pi_student(y_t | y_<t) - log pi_teacher(y_t | y_<t)        (Schulman's k1, samples from the student)

and `-kl_coef * k_t` is that token's advantage: with the policy-gradient loss its expected gradient is the
gradient of the reverse KL (the "on-policy distillation" recipe of Agarwal et al. 2024 / Thinking Machines 2025,
per token and without discount). Mixed with a task reward it is added to the reward's own advantages.
Tokens outside `response_mask` (padding, a multi-turn conversation's tool observations) get 0: never distilled.
"""
from __future__ import annotations

import torch
from torch import Tensor

from hybridrl.algorithms.masking import masked_mean

# top_k_forward_kl: the teacher's distribution at each response position (`[B, R, k]`), written by its pass
# (`MegatronActor.compute_log_prob(top_k=k)`) and read by the student's update: the log-probs, most likely first,
# and their token ids.
TEACHER_TOP_K_KEYS = ("teacher_top_log_probs", "teacher_top_ids")
# full_reverse_kl: the teacher's log-probs of every token id of the student's vocabulary at each response position
# (`[B, R, V]`), written by its pass (`compute_log_prob(full_vocab=V)`) and read by the student's update.
TEACHER_FULL_KEY = "teacher_full_log_probs"


def reverse_kl_per_token(student_log_probs: Tensor, teacher_log_probs: Tensor, response_mask: Tensor) -> Tensor:
    """k_t = log pi_student(y_t) - log pi_teacher(y_t) on the response's model tokens, 0 elsewhere `[B, T]`."""
    if student_log_probs.shape != teacher_log_probs.shape or student_log_probs.shape != response_mask.shape:
        raise ValueError(f"student {tuple(student_log_probs.shape)}, teacher {tuple(teacher_log_probs.shape)} and "
                         f"mask {tuple(response_mask.shape)} log-probs must have one shape")
    mask = response_mask.to(student_log_probs.dtype)
    return (student_log_probs - teacher_log_probs.to(student_log_probs.dtype)) * mask


def distillation_advantages(reverse_kl: Tensor, kl_coef: float) -> Tensor:
    """Each token's distillation advantage: -kl_coef x its reverse KL (masked tokens stay 0)."""
    return -kl_coef * reverse_kl


def reverse_kl_metrics(reverse_kl: Tensor, response_mask: Tensor) -> dict[str, float]:
    """`distillation/reverse_kl_per_token` (mean over every model token of the batch) and
    `distillation/reverse_kl_per_sequence` (mean over sequences of the sum over its tokens)."""
    mask = response_mask.to(torch.float64)
    kl = reverse_kl.to(torch.float64) * mask
    return {"distillation/reverse_kl_per_token": float(masked_mean(kl, mask)),
            "distillation/reverse_kl_per_sequence": float(kl.sum(-1).mean())}
