"""The megatron actor's PPO step against an independent reference: transformers + plain torch, written here.

Every other actor-update test compares the megatron actor with itself on another layout, and after
an Adam step the weights are ~lr * sign(g): blind to a wrong gradient scale. Here one update is
recomputed from the HF model with the objective spelled out below (nothing from
`hybridrl.algorithms`): log-probs and entropy at a sampling temperature != 1, PPO's clipped
surrogate with asymmetric clip bounds and the dual clip, an entropy bonus, a KL loss (k1 or k3)
and each `loss_agg_mode`; at DP2 two of the cases also correct the rollout mismatch
(`algorithm.rollout_correction`: token TIS with token MIS, sequence TIS with the geometric mask),
the weights recomputed here from `rollout_log_probs`. The comparison is of the loss terms, the
metrics, the grad norm and every HF tensor's gradient before the optimizer step: megatron DDP's
reduced `main_grad` buffers, gathered over TP (and over DP for the distributed optimizer's shards)
and mapped back to HF names by the bridge's export. Layouts: TP2 x PP2 (4 ranks) and DP2 with the distributed optimizer.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from tests.support.actor_reference import (
    CASES,
    POLICY,
    Case,
    assert_matches_reference,
    megatron_steps,
    ppo_batch,
    reference_step,
)
from tests.support.rollout_models import build_tiny_model


def _check_layout(tmp_path: Path, cases: tuple[Case, ...] = CASES, **layout: Any) -> list[dict[str, Any]]:
    hf = build_tiny_model(tmp_path / "hf", POLICY)
    batch = ppo_batch(hf)
    references = [reference_step(hf, batch, case) for case in cases]
    # the reference exercises what it claims to: both clips active, terms that matter
    for ref in references:
        assert 0 < ref["clipfrac"] < 0.9 and ref["clipfrac_lower"] > 0
        assert ref["grad_norm"] > 1e-2
    losses = [ref["loss"] for ref in references]
    assert len({round(v, 4) for v in losses}) == len(cases)  # the modes give different objectives
    runs = megatron_steps(tmp_path, hf, batch, cases=cases, **layout)
    for case, ref, (metrics, grads) in zip(cases, references, runs):
        assert_matches_reference(ref, metrics, grads, f"{layout} {case}")
    return references


def test_actor_update_equals_reference_at_tp2_pp2(tmp_path):
    _check_layout(tmp_path, tp=2, pp=2, dp=1, distributed_optimizer=False)


# Two of the cases with the rollout-mismatch correction on (same cost: the same number of updates).
TOKEN_TIS_MIS = dict(is_level="token", is_cap=1.5, mask_level="token", mask_low=0.5, mask_high=2.2)
SEQUENCE_TIS_GEOMETRIC_MIS = dict(is_level="sequence", is_cap=2.0, mask_level="geometric", mask_low=0.8,
                                  mask_high=1.25)
CORRECTED_CASES = (replace(CASES[0], **TOKEN_TIS_MIS), *CASES[1:3], replace(CASES[3], **SEQUENCE_TIS_GEOMETRIC_MIS),
                   CASES[4])


def test_actor_update_equals_reference_at_dp2_distributed_optimizer(tmp_path):
    references = _check_layout(tmp_path, CORRECTED_CASES, tp=1, pp=1, dp=2, distributed_optimizer=True)
    # the corrections act: some weights capped, some tokens masked, in each corrected case
    for i in (0, 3):
        assert 0 < references[i]["is_capped"] < 1 and references[i]["masked"] > 0, references[i]["rollout_correction"]
