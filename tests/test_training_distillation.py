"""On-policy distillation's signal against transformers: the teacher's per-token log-probs (the `TeacherWorker`, its
own model and layout, in its own processes) and the student's old log-probs (the actor's pass), each at its own
TP / PP / DP layout, turned into advantages by the trainer's `add_distillation_advantages`; the reference is
written here from the two HF models' logits with plain torch (nothing from `hybridrl.algorithms`).

The teacher is another family and shape than the student (a Qwen2 of 4 layers, 96 wide, against a 2-layer Llama
with GQA) over one vocabulary: the teacher's log-probs cannot be the student's by accident. Every layout is 2 ranks;
the three pairs give each role TP2, PP2 and DP2 (TP1) once, never the same layout as the other role.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hybridrl.parallel.forked import run_ranks
from tests.rollout_models import build_tiny_model
from tests.test_training_fixtures import RESPONSE, job_config, rollout_batch

TEMPERATURE = 0.7  # both passes score at the rollout's temperature
KL_COEF = 0.5
STUDENT = dict(family="llama", vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
TEACHER = dict(family="qwen2", vocab_size=200, hidden_size=96, intermediate_size=160, num_hidden_layers=4,
               num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=False)
TOLERANCE = 1e-5  # fp32: megatron's log-probs equal transformers' to ~1e-6


def distillation_config(student: Path, teacher: Path, *, student_layout: tuple[int, int],
                        teacher_layout: tuple[int, int]) -> Any:
    """A 2-rank job distilling `teacher` into `student`, each at its (TP, PP) (DP = 2 / (TP x PP))."""
    config = job_config(student, world=2, tp=student_layout[0], pp=student_layout[1])
    config.actor_rollout_ref.rollout.temperature = TEMPERATURE
    config.algorithm.distillation.enable = True
    config.algorithm.distillation.kl_coef = KL_COEF
    config.teacher.model.path = str(teacher)
    config.teacher.megatron.tensor_model_parallel_size, config.teacher.megatron.pipeline_model_parallel_size = \
        teacher_layout
    config.teacher.log_prob_micro_batch_size_per_gpu = 2
    return config


def _log_probs_rank(rank: int, world: int, config: Any, batch: Any, role: str) -> tuple[int, Any]:
    """This rank's DP index and its output (the worker's result on an output rank, None elsewhere)."""
    from hybridrl.config.plan import build_plan
    from hybridrl.controller.base_worker import RankContext
    from hybridrl.names import Role
    from hybridrl.workers.ray_roles import ActorRolloutRefWorker, TeacherWorker

    plan = build_plan(config)
    context = RankContext(role=role, rank=rank, world_size=world, node_rank=0, local_rank=rank,
                          local_world_size=world, use_gpu=False)
    if role == Role.TEACHER:
        teacher = TeacherWorker(context, plan)
        teacher.init_model()
        dp, dp_rank = plan.layout(Role.TEACHER).mesh.dp, teacher.mesh_coords()["dp"]
        return dp_rank, teacher.compute_teacher_log_prob(batch.split(dp)[dp_rank])
    student = ActorRolloutRefWorker(context, plan, roles=(Role.ACTOR,))
    student.init_model()
    dp, dp_rank = plan.layout(Role.ACTOR).mesh.dp, student.mesh_coords()["dp"]
    return dp_rank, student.compute_log_prob(batch.split(dp)[dp_rank])


def megatron_log_probs(config: Any, batch: Any, role: str, key: str) -> torch.Tensor:
    """`key` `[B, R]` of the whole batch from `role`'s workers: each DP replica's rows, in the batch's order."""
    results = run_ranks(_log_probs_rank, 2, config, batch, role)
    by_replica = dict(sorted((dp, out) for dp, out in results if out is not None))
    return torch.cat([by_replica[dp][key] for dp in sorted(by_replica)])


def hf_log_probs(folder: Path, batch: Any) -> torch.Tensor:
    """log softmax(logits / T) of each sampled response token under the HF model, 0 on padding `[B, R]`."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits
    width = batch["input_ids"].shape[1]
    log_softmax = (logits[:, width - RESPONSE - 1: width - 1] / TEMPERATURE).log_softmax(-1)
    picked = log_softmax.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    return picked * batch["response_mask"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("distillation")
    return build_tiny_model(base / "student", STUDENT, seed=0), build_tiny_model(base / "teacher", TEACHER, seed=5)


@pytest.mark.parametrize("student_layout,teacher_layout", [((2, 1), (1, 2)), ((1, 2), (1, 1)), ((1, 1), (2, 1))],
                         ids=["student-tp2-teacher-pp2", "student-pp2-teacher-dp2", "student-dp2-teacher-tp2"])
def test_teacher_log_probs_and_distillation_advantages_equal_transformers(models, student_layout, teacher_layout):
    from hybridrl.names import Role
    from hybridrl.trainer.rl_step import add_distillation_advantages

    student, teacher = models
    config = distillation_config(student, teacher, student_layout=student_layout, teacher_layout=teacher_layout)
    batch = rollout_batch(8, seed=3, vocab=STUDENT["vocab_size"])
    batch.meta["temperature"] = TEMPERATURE
    mask = batch["response_mask"].float()

    teacher_lp = megatron_log_probs(config, batch, Role.TEACHER, "teacher_log_probs")
    student_lp = megatron_log_probs(config, batch, "actor_rollout_ref", "old_log_probs")
    expected_teacher, expected_student = hf_log_probs(teacher, batch), hf_log_probs(student, batch)
    torch.testing.assert_close(teacher_lp, expected_teacher, rtol=0, atol=TOLERANCE)
    torch.testing.assert_close(student_lp, expected_student, rtol=0, atol=TOLERANCE)
    assert (expected_teacher - expected_student).abs().max() > 0.5  # two different models, told apart

    # pure distillation: the advantage (and return) of each model token is -coef x (student - teacher)
    batch["old_log_probs"], batch["teacher_log_probs"] = student_lp, teacher_lp
    metrics = add_distillation_advantages(batch, KL_COEF, with_task_reward=False)
    reverse_kl = (expected_student - expected_teacher) * mask
    torch.testing.assert_close(batch["advantages"], -KL_COEF * reverse_kl, rtol=0, atol=TOLERANCE)
    torch.testing.assert_close(batch["returns"], -KL_COEF * reverse_kl, rtol=0, atol=TOLERANCE)
    assert metrics["distillation/reverse_kl_per_token"] == pytest.approx(
        float(reverse_kl.sum() / mask.sum()), abs=TOLERANCE)
    assert metrics["distillation/reverse_kl_per_sequence"] == pytest.approx(
        float(reverse_kl.sum(-1).mean()), abs=TOLERANCE * RESPONSE)

    # mixed with a task reward: added to the reward's advantages; the returns stay the reward's
    task_advantages = torch.randn(mask.shape, generator=torch.Generator().manual_seed(7)) * mask
    batch["advantages"], batch["returns"] = task_advantages.clone(), task_advantages.clone()
    add_distillation_advantages(batch, KL_COEF, with_task_reward=True)
    torch.testing.assert_close(batch["advantages"], task_advantages - KL_COEF * reverse_kl, rtol=0, atol=TOLERANCE)
    torch.testing.assert_close(batch["returns"], task_advantages)
