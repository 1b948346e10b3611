"""On-policy distillation's signal against transformers: the teacher's per-token log-probs (the `TeacherWorker`, its
own model and layout, in its own processes) and the student's old log-probs (the actor's pass), each at its own
TP / PP / DP layout, turned into advantages by the trainer's `add_distillation_advantages`; the reference is
written here from the two HF models' logits with plain torch (nothing from `hybridrl.algorithms`).

The teacher is another family and shape than the student (a Qwen2 of 4 layers, 96 wide, against a 2-layer Llama
with GQA) over one vocabulary: the teacher's log-probs cannot be the student's by accident. Every layout is 2 ranks;
the three pairs give each role TP2, PP2 and DP2 (TP1) once, never the same layout as the other role. Both roles run
packed micro-batches (the CPU default) and the rows come in GRPO groups, whose shared prompt each role computes once.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.forked import run_ranks
from tests.support.rollout_models import build_tiny_model
from tests.support.training_fixtures import RESPONSE, job_config, rollout_batch

TEMPERATURE = 0.7  # both passes score at the rollout's temperature
KL_COEF = 0.5
STUDENT = dict(family="llama", vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
TEACHER = dict(family="qwen2", vocab_size=200, hidden_size=96, intermediate_size=160, num_hidden_layers=4,
               num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=False)
TOLERANCE = 1e-5  # fp32: megatron's log-probs equal transformers' to ~1e-6
TOP_K = 5


def distillation_config(student: Path, teacher: Path, *, student_layout: tuple[int, int],
                        teacher_layout: tuple[int, int], top_k: int | None = None, full_vocab: bool = False) -> Any:
    """A 2-rank job distilling `teacher` into `student`, each at its (TP, PP) (DP = 2 / (TP x PP)); with `top_k`
    by the teacher's top-k distribution (`top_k_forward_kl`), with `full_vocab` by its whole distribution
    (`full_reverse_kl`)."""
    config = job_config(student, world=2, tp=student_layout[0], pp=student_layout[1])
    config.actor_rollout_ref.rollout.temperature = TEMPERATURE
    config.algorithm.distillation.enable = True
    config.algorithm.distillation.kl_coef = KL_COEF
    if top_k is not None:
        config.algorithm.distillation.loss, config.algorithm.distillation.top_k = "top_k_forward_kl", top_k
    if full_vocab:
        config.algorithm.distillation.loss = "full_reverse_kl"
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
    from hybridrl.workers.frozen_roles import TeacherWorker
    from hybridrl.workers.policy import PolicyWorker

    plan = build_plan(config)
    context = RankContext(group=role, rank=rank, world_size=world, node_rank=0, local_rank=rank,
                          local_world_size=world, use_gpu=False)
    if role == Role.TEACHER:
        teacher = TeacherWorker(context, plan)
        teacher.init_model()
        dp, dp_rank = plan.layout(Role.TEACHER).mesh.dp, teacher.mesh_coords().dp
        return dp_rank, teacher.compute_teacher_log_prob(batch.split(dp)[dp_rank])
    student = PolicyWorker(context, plan)
    student.init_model()
    dp, dp_rank = plan.layout(Role.ACTOR).mesh.dp, student.mesh_coords().dp
    return dp_rank, student.compute_log_prob(batch.split(dp)[dp_rank])


def megatron_outputs(config: Any, batch: Any, role: str) -> Any:
    """`role`'s workers' output for the whole batch: each DP replica's rows, in the batch's order."""
    from hybridrl.data.batch import Batch

    results = run_ranks(_log_probs_rank, 2, config, batch, role)
    by_replica = dict(sorted((dp, out) for dp, out in results if out is not None))
    return Batch.concat([by_replica[dp] for dp in sorted(by_replica)])


def hf_response_log_softmax(folder: Path, batch: Any, model: Any = None) -> torch.Tensor:
    """log softmax(logits / T) at each response position under the HF model `[B, R, V]` (differentiable when
    `model`, the loaded model, is given in train mode)."""
    import transformers

    if model is None:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                                  attn_implementation="eager")
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"]).logits
    width = batch["input_ids"].shape[1]
    return (logits[:, width - RESPONSE - 1: width - 1] / TEMPERATURE).log_softmax(-1)


def hf_log_probs(folder: Path, batch: Any) -> torch.Tensor:
    """log softmax(logits / T) of each sampled response token under the HF model, 0 on padding `[B, R]`."""
    with torch.no_grad():
        log_softmax = hf_response_log_softmax(folder, batch)
    picked = log_softmax.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    return picked * batch["response_mask"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("distillation")
    return build_tiny_model(base / "student", STUDENT, seed=0), build_tiny_model(base / "teacher", TEACHER, seed=5)


@pytest.mark.parametrize("student_layout,teacher_layout", [((2, 1), (1, 2)), ((1, 2), (1, 1)), ((1, 1), (2, 1))],
                         ids=["student-tp2-teacher-pp2", "student-pp2-teacher-dp2", "student-dp2-teacher-tp2"])
def test_teacher_log_probs_and_distillation_advantages_equal_transformers(models, student_layout, teacher_layout):
    """Also the teacher's top-k distribution at each response position (top_k_forward_kl), its vocabulary split
    over TP at the TP2 layout: log-probs and ids equal torch's topk of the HF teacher's log-softmax."""
    from hybridrl.names import Role
    from hybridrl.trainer.rl_step import add_distillation_advantages

    student, teacher = models
    config = distillation_config(student, teacher, student_layout=student_layout, teacher_layout=teacher_layout,
                                 top_k=TOP_K)
    batch = rollout_batch(8, seed=3, vocab=STUDENT["vocab_size"], groups=[3, 3, 2])  # GRPO groups: shared prompts
    batch.meta["temperature"] = TEMPERATURE
    mask = batch["response_mask"].float()

    teacher_out = megatron_outputs(config, batch, Role.TEACHER)
    teacher_lp = teacher_out["teacher_log_probs"]
    student_lp = megatron_outputs(config, batch, "actor_rollout_ref")["old_log_probs"]
    expected_teacher, expected_student = hf_log_probs(teacher, batch), hf_log_probs(student, batch)
    torch.testing.assert_close(teacher_lp, expected_teacher, rtol=0, atol=TOLERANCE)
    torch.testing.assert_close(student_lp, expected_student, rtol=0, atol=TOLERANCE)
    with torch.no_grad():
        top_log_probs, top_ids = hf_response_log_softmax(teacher, batch).topk(TOP_K, dim=-1)
    real = mask.bool()
    torch.testing.assert_close(teacher_out["teacher_top_log_probs"][real], top_log_probs[real], rtol=0,
                               atol=TOLERANCE)
    assert torch.equal(teacher_out["teacher_top_ids"][real], top_ids[real])
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


def _update_rank(rank: int, world: int, config: Any, batch: Any, out_dir: str) -> Any:
    """One actor update; its reduced gradients written as an HF folder (the bridge's export) to `out_dir`."""
    from hybridrl.config.plan import build_plan
    from hybridrl.models.bridge import export_hf
    from hybridrl.training.actor import MegatronActor
    from hybridrl.training.backend import MegatronBackend, role_spec
    from tests.support.actor_reference import gradients_into_params

    plan = build_plan(config)
    backend = MegatronBackend(role_spec(plan, "actor"))
    metrics = MegatronActor(backend, plan).update_policy(batch.split(backend.ctx.dp)[backend.ctx.dp_rank])
    gradients_into_params(backend)
    export_hf(backend.chunks, out_dir, force=True)
    return metrics


@pytest.mark.parametrize("teacher_layout", [(2, 1), (1, 2)], ids=["teacher-tp2", "teacher-pp2"])
def test_teacher_full_vocabulary_log_probs_equal_transformers(models, teacher_layout):
    """full_reverse_kl: the teacher's pass ships its log-softmax over every id of the student's vocabulary at each
    response position, gathered over a split vocabulary at TP2 and from the last stage at PP2: equal to the HF
    teacher's, 200 columns wide (megatron pads the vocabulary to 256; the padded ids never ship)."""
    from hybridrl.algorithms.distillation import TEACHER_FULL_KEY
    from hybridrl.names import Role

    student, teacher = models
    config = distillation_config(student, teacher, student_layout=(1, 1), teacher_layout=teacher_layout,
                                 full_vocab=True)
    batch = rollout_batch(8, seed=6, vocab=STUDENT["vocab_size"], groups=[3, 3, 2])
    batch.meta["temperature"] = TEMPERATURE
    table = megatron_outputs(config, batch, Role.TEACHER)[TEACHER_FULL_KEY]
    with torch.no_grad():
        expected = hf_response_log_softmax(teacher, batch)
    assert table.shape == expected.shape == (8, RESPONSE, STUDENT["vocab_size"])
    real = batch["response_mask"].bool()
    torch.testing.assert_close(table[real], expected[real], rtol=0, atol=TOLERANCE)
    assert torch.all(table[~real] == 0)


@pytest.mark.parametrize("loss", ["top_k_forward_kl", "full_reverse_kl"])
@pytest.mark.parametrize("layout", [(2, 1), (1, 1)], ids=["student-tp2", "student-dp2"])
def test_distillation_loss_term_and_every_gradient_equal_transformers(models, tmp_path, layout, loss):
    """The student's update under a distillation loss term, pure (advantages 0: the policy gradient is 0), at TP2
    (the teacher's distribution read against a split vocabulary) and DP2: the loss term and the gradient of every HF
    tensor equal the term written here on the transformers student, token-mean over the model tokens --
    top_k_forward_kl: KL(teacher's top-k || student) on the teacher's top-k ids; full_reverse_kl: KL(student ||
    teacher) summed over the whole vocabulary."""
    import transformers

    from hybridrl.algorithms.distillation import TEACHER_FULL_KEY
    from tests.support.models_fixtures import safetensors_state

    student, teacher = models
    top_k = loss == "top_k_forward_kl"
    config = distillation_config(student, teacher, student_layout=layout, teacher_layout=(1, 1),
                                 top_k=TOP_K if top_k else None, full_vocab=not top_k)
    config.actor_rollout_ref.actor.optim.clip_grad = 0.0  # the buffers must hold the unclipped gradient
    # GRPO groups: the update computes each shared prompt once, its response positions read their rows' targets
    batch = rollout_batch(8, seed=4, vocab=STUDENT["vocab_size"], groups=[3, 3, 2])
    batch.meta["temperature"] = TEMPERATURE
    mask = batch["response_mask"].float()
    with torch.no_grad():
        teacher_log_softmax = hf_response_log_softmax(teacher, batch)
        top_log_probs, top_ids = teacher_log_softmax.topk(TOP_K, dim=-1)
    if top_k:
        batch["teacher_top_log_probs"], batch["teacher_top_ids"] = top_log_probs * mask[..., None], top_ids
    else:
        batch[TEACHER_FULL_KEY] = teacher_log_softmax * mask[..., None]
    batch["old_log_probs"] = hf_log_probs(student, batch)
    batch["advantages"] = torch.zeros_like(mask)

    model = transformers.AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32,
                                                              attn_implementation="eager")
    student_log_softmax = hf_response_log_softmax(student, batch, model)
    if top_k:
        student_log_probs = student_log_softmax.gather(-1, top_ids)
        per_token = (top_log_probs.exp() * (top_log_probs - student_log_probs)).sum(-1)
    else:
        per_token = (student_log_softmax.exp() * (student_log_softmax - teacher_log_softmax)).sum(-1)
    expected_loss = (per_token * mask).sum() / mask.sum()
    (KL_COEF * expected_loss).backward()
    expected = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}

    out_dir = tmp_path / "grads"
    metrics = [m for m in run_ranks(_update_rank, 2, config, batch, str(out_dir)) if m is not None]
    assert metrics[0].distillation_loss == pytest.approx(float(expected_loss), rel=1e-5)
    assert metrics[0].as_dict()[f"distillation/{loss}"] == metrics[0].distillation_loss
    assert metrics[0].pg_loss == 0.0
    grads = safetensors_state(out_dir)
    assert sorted(grads) == sorted(expected)
    for name, ref in expected.items():
        scale = float(ref.abs().max())
        assert scale > 0, name
        assert float((grads[name] - ref).abs().max()) <= 1e-5 * scale, name


def padded_teacher(student: Path, out: Path, rows: int) -> Path:
    """The student with `rows` vocabulary rows more (a teacher of the student's tokenizer and a larger, padded
    vocabulary, as Qwen2.5-7B's 152,064 rows against Qwen2.5-0.5B's 151,936): its first rows are the student's own
    weights, the new rows random and large, so that they hold most of the teacher's probability mass."""
    import json

    from safetensors.torch import load_file, save_file

    out.mkdir()
    config = json.loads((student / "config.json").read_text())
    vocab = config["vocab_size"]
    config["vocab_size"] = vocab + rows
    (out / "config.json").write_text(json.dumps(config))
    generator = torch.Generator().manual_seed(11)
    tensors = {}
    for name, tensor in load_file(str(student / "model.safetensors")).items():
        if tensor.shape[0] == vocab and name.endswith(("embed_tokens.weight", "lm_head.weight")):
            tensor = torch.cat([tensor, 3 * torch.randn(rows, tensor.shape[1], generator=generator)])
        tensors[name] = tensor.contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("loss", ["top_k_forward_kl", "full_reverse_kl"])
def test_a_teacher_of_more_vocabulary_rows_is_read_over_the_students_ids(models, tmp_path, loss):
    """A teacher whose vocabulary has rows past the student's (the student's ids mean the same to it; plan accepts
    it) is read over the ids the student can write: its distribution renormalised over them. Here the teacher is
    the student with 56 rows more, which take most of its mass, at TP2 (the extra rows on the second rank's
    shard): over the student's 200 ids it is the student, so its sampled-token log-probs, its top-k (every id one
    the student has) and its full table each equal the HF student's own, and the reverse KL is 0."""
    from hybridrl.algorithms.distillation import TEACHER_FULL_KEY
    from hybridrl.names import Role

    student, _ = models
    teacher = padded_teacher(student, tmp_path / "teacher", rows=56)
    top_k = loss == "top_k_forward_kl"
    config = distillation_config(student, teacher, student_layout=(1, 1), teacher_layout=(2, 1),
                                 top_k=TOP_K if top_k else None, full_vocab=not top_k)
    batch = rollout_batch(8, seed=3, vocab=STUDENT["vocab_size"], groups=[3, 3, 2])
    batch.meta["temperature"] = TEMPERATURE
    out = megatron_outputs(config, batch, Role.TEACHER)
    with torch.no_grad():
        expected = hf_response_log_softmax(student, batch)  # the student's distribution: the reference
        teacher_all = hf_response_log_softmax(teacher, batch)
    real = batch["response_mask"].bool()
    assert float(teacher_all[..., STUDENT["vocab_size"]:].exp().sum(-1)[real].min()) > 0.5  # the extra rows' mass
    torch.testing.assert_close(out["teacher_log_probs"], hf_log_probs(student, batch), rtol=0, atol=TOLERANCE)
    if top_k:
        top_log_probs, top_ids = expected.topk(TOP_K, dim=-1)
        assert torch.equal(out["teacher_top_ids"][real], top_ids[real])
        torch.testing.assert_close(out["teacher_top_log_probs"][real], top_log_probs[real], rtol=0, atol=TOLERANCE)
    else:
        assert out[TEACHER_FULL_KEY].shape == expected.shape
        torch.testing.assert_close(out[TEACHER_FULL_KEY][real], expected[real], rtol=0, atol=TOLERANCE)
