"""On-policy distillation's settings at plan time: each mistake refused naming the field, the value and what would be
valid, before any process starts; a valid job's plan shows the teacher (its layout, its pass, its memory).

Jobs are the CPU demo's (`tools/demo_assets.py`), with a teacher folder made from the demo model: a copy (the same
tokenizer) or a copy whose tokenizer or shape was changed here.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hybridrl.config import ConfigError, plan_from_sources
from hybridrl.config.report import render_plan
from hybridrl.names import Role
from tools.demo_assets import demo_overrides

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs/examples/cpu_tiny_grpo.yaml")
D = "algorithm.distillation"


@pytest.fixture(scope="module")
def teachers(demo_assets: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Teacher folders: `same` (the demo model's copy), `other_tokenizer` (one vocabulary entry renamed),
    `small_vocab` (a config.json of fewer rows), `three_layers` (a config.json of 3 layers), `adapter` (a PEFT
    adapter folder: adapter_config.json, no config.json)."""
    base = tmp_path_factory.mktemp("teachers")
    folders = {}
    for name in ("same", "other_tokenizer", "small_vocab", "three_layers"):
        folders[name] = Path(shutil.copytree(demo_assets / "model", base / name))
    tokenizer = json.loads((folders["other_tokenizer"] / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    token = next(t for t in vocab if t == "a")
    vocab["é"] = vocab.pop(token)
    (folders["other_tokenizer"] / "tokenizer.json").write_text(json.dumps(tokenizer))
    folders["adapter"] = base / "adapter"
    folders["adapter"].mkdir()
    (folders["adapter"] / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "base_model_name_or_path": "/models/base", "r": 8, "lora_alpha": 16}))
    (folders["adapter"] / "adapter_model.safetensors").write_bytes(b"")
    for name, field, change in (("small_vocab", "vocab_size", lambda v: v - 8),
                                ("three_layers", "num_hidden_layers", lambda v: 3)):
        config = json.loads((folders[name] / "config.json").read_text())
        config[field] = change(config[field])
        (folders[name] / "config.json").write_text(json.dumps(config))
    return folders


def job(demo_assets: Path, tmp_path: Path, *extra: str) -> list[str]:
    return demo_overrides(demo_assets, tmp_path / "run", *extra)


def refusals(overrides: list[str], check_files: bool = False) -> list[tuple[str, object, str]]:
    with pytest.raises(ConfigError) as info:
        plan_from_sources(CONFIG, overrides, check_files=check_files)
    return [(issue.field, issue.value, issue.rule) for issue in info.value.issues]


def test_a_valid_distillation_job_plans_the_teacher_at_its_own_layout(demo_assets, teachers, tmp_path):
    plan = plan_from_sources(CONFIG, job(demo_assets, tmp_path, f"{D}.enable=true",
                                         f"teacher.model.path={teachers['same']}",
                                         "teacher.megatron.tensor_model_parallel_size=2",
                                         "teacher.log_prob_micro_batch_size_per_gpu=16"), check_files=True)
    assert [layout.role for layout in plan.layouts] == [Role.ACTOR, Role.TEACHER]
    assert plan.layout(Role.TEACHER).mesh.tp == 2 and plan.layout(Role.ACTOR).mesh.tp == 1
    teacher_pass = plan.forward("teacher_log_prob")
    assert (teacher_pass.role, teacher_pass.micro_batch_size) == (Role.TEACHER, 16)
    # the student's log-probs are needed before the update: the old-log-prob pass runs though the update is
    # on-policy (one optimizer step a batch), where it is skipped otherwise
    assert plan.resolved.old_log_prob_pass
    plain = plan_from_sources(CONFIG, job(demo_assets, tmp_path))
    assert not plain.resolved.old_log_prob_pass
    assert plan.resolved.distillation_top_k == 0 == plain.resolved.distillation_top_k  # the sampled-token signal
    top_k = plan_from_sources(CONFIG, job(demo_assets, tmp_path, f"{D}.enable=true", f"{D}.loss=top_k_forward_kl",
                                          f"teacher.model.path={teachers['same']}"))
    assert top_k.resolved.distillation_top_k == 32  # the default
    assert not top_k.resolved.distillation_full_vocab and not plan.resolved.distillation_full_vocab
    full = plan_from_sources(CONFIG, job(demo_assets, tmp_path, f"{D}.enable=true", f"{D}.loss=full_reverse_kl",
                                         f"teacher.model.path={teachers['same']}"))
    assert full.resolved.distillation_full_vocab and full.resolved.distillation_top_k == 0
    text = render_plan(plan)
    assert "teacher: teacher_log_prob micro-batches per GPU" in text
    assert any(line.startswith("teacher ") for line in text.splitlines())  # its memory row


def test_distillation_mistakes_are_refused_naming_the_field(demo_assets, teachers, tmp_path):
    same = f"teacher.model.path={teachers['same']}"
    cases = [
        # (overrides, field, text of the rule)
        ([f"{D}.enable=true"], "teacher.model.path", "must name the teacher's Hugging Face folder"),
        ([same], "teacher.model.path", f"{D}.enable is false, so nothing would use it"),
        ([f"{D}.enable=true", same, f"{D}.kl_coef=0"], f"{D}.kl_coef", "must be a number > 0"),
        ([f"{D}.enable=true", same, f"{D}.top_k=8"], f"{D}.top_k", "applies to algorithm.distillation.loss=top_k"),
        ([f"{D}.enable=true", same, f"{D}.loss=top_k_forward_kl", f"{D}.top_k=0"], f"{D}.top_k", "integer >= 1"),
        ([f"{D}.enable=true", same, f"{D}.loss=top_k_forward_kl", f"{D}.top_k=100000"], f"{D}.top_k",
         "at most the vocabulary"),
        ([f"{D}.enable=true", same, f"{D}.loss=full_vocabulary"], f"{D}.loss", "is not a known value"),
        ([f"{D}.enable=true", same, f"{D}.loss=full_reverse_kl", f"{D}.top_k=8"], f"{D}.top_k",
         "applies to algorithm.distillation.loss=top_k_forward_kl only, not loss=full_reverse_kl"),
        ([f"{D}.enable=true", same, "algorithm.adv_estimator=gae"], "algorithm.adv_estimator",
         "trains a critic on the task reward, which nothing uses"),
        ([f"{D}.enable=true", same, "algorithm.adv_estimator=rloo"], "algorithm.adv_estimator",
         "makes advantages of the task reward, which nothing trains on"),
        ([f"{D}.enable=true", same, "algorithm.adv_estimator=remax"], "algorithm.adv_estimator",
         "makes advantages of the task reward, which nothing trains on"),
        ([f"{D}.enable=true", same, "algorithm.norm_adv_by_std_in_grpo=false"], "algorithm.norm_adv_by_std_in_grpo",
         "scales the task reward's advantages, which nothing trains on"),
        ([f"{D}.enable=true", same, "algorithm.filter_groups.enable=true"], "algorithm.filter_groups.enable",
         "keeps groups by their reward spread"),
        ([f"{D}.enable=true", same, "algorithm.use_kl_in_reward=true"], "algorithm.use_kl_in_reward",
         "puts a KL penalty into the task reward"),
        ([f"{D}.enable=true", same, "teacher.model.lora.rank=8"], "teacher.model.lora.rank",
         "LoRA adapts the actor only"),
        ([f"{D}.enable=true", same, "teacher.megatron.grad_offload=true"], "teacher.megatron.grad_offload",
         "the teacher is frozen"),
        ([f"{D}.enable=true", same, "teacher.model.enable_gradient_checkpointing=true"],
         "teacher.model.enable_gradient_checkpointing", "the teacher is frozen"),
        ([f"{D}.enable=true", same, "teacher.model.tokenizer_path=/tmp"], "teacher.model.tokenizer_path",
         "uses the policy's tokenizer"),
        ([f"{D}.enable=true", same, "teacher.log_prob_micro_batch_size_per_gpu=0"],
         "teacher.log_prob_micro_batch_size_per_gpu", ">= 1"),
        ([f"{D}.enable=true", f"teacher.model.path={teachers['small_vocab']}"], "teacher.model.path",
         "fewer than the student's"),

        # the teacher's own pool: sized when it has one, never sized (or placed) when it does not
        ([f"{D}.enable=true", same, "teacher.mode=disaggregated"], "teacher.n_gpus_per_node",
         "is required with teacher.mode=disaggregated"),
        # refused with the training world's own mistake, not hidden behind it (every error at once)
        ([f"{D}.enable=true", same, "teacher.mode=disaggregated", "trainer.n_gpus_per_node=0"],
         "teacher.n_gpus_per_node", "is required with teacher.mode=disaggregated"),
        ([f"{D}.enable=true", same, "teacher.mode=disaggregated", "teacher.n_gpus_per_node=0"],
         "teacher.n_gpus_per_node", "integer >= 1"),
        ([f"{D}.enable=true", same, "teacher.n_gpus_per_node=2"], "teacher.n_gpus_per_node",
         "with teacher.mode=colocated the teacher runs on the training ranks"),
        ([f"{D}.enable=true", same, "teacher.nnodes=2"], "teacher.nnodes", "sizes the teacher's own pool"),
        (["teacher.mode=disaggregated", "teacher.n_gpus_per_node=2"], "teacher.mode",
         f"places a teacher but {D}.enable is false"),
        ([f"{D}.enable=true", same, "teacher.mode=elsewhere"], "teacher.mode", "is not a known"),
        # its layout spans its pool (3 ranks), not the training world (2): TP2 divides one, not the other
        ([f"{D}.enable=true", same, "teacher.mode=disaggregated", "teacher.n_gpus_per_node=3",
          "teacher.megatron.tensor_model_parallel_size=2"], "teacher.megatron.tensor_model_parallel_size",
         "must divide the 3 GPUs"),
        # the teacher's layout is checked against its own shape (3 layers), not the student's (4)
        ([f"{D}.enable=true", f"teacher.model.path={teachers['three_layers']}",
          "teacher.megatron.pipeline_model_parallel_size=2", "teacher.log_prob_micro_batch_size_per_gpu=16"],
         "teacher.megatron.pipeline_model_parallel_size", "must divide the model's 3 layers"),
    ]
    for overrides, field, text in cases:
        found = refusals(job(demo_assets, tmp_path, *overrides))
        assert any(f == field and text in rule for f, _, rule in found), (overrides, found)
    # a LoRA-tuned teacher named by its adapter folder (a folder check: plan reads the files): what it is, and to
    # merge it first, in one refusal; the same folder as the policy's model: name it as the policy's adapter
    adapter = teachers["adapter"]
    found = refusals(job(demo_assets, tmp_path, f"{D}.enable=true", f"teacher.model.path={adapter}"), check_files=True)
    assert [(f, v) for f, v, _ in found] == [("teacher.model.path", str(adapter))], found
    assert found[0][2].startswith("holds a PEFT adapter (adapter_config.json, its base /models/base), not a whole "
                                  "model: merge it into its base first"), found
    found = refusals([*job(demo_assets, tmp_path), f"actor_rollout_ref.model.path={adapter}"], check_files=True)
    assert any(f == "actor_rollout_ref.model.path" and "actor_rollout_ref.model.lora.adapter_path" in rule
               for f, _, rule in found), found
    # the layout refused for the 3-layer teacher is valid for the 4-layer one
    plan_from_sources(CONFIG, job(demo_assets, tmp_path, f"{D}.enable=true", same,
                                  "teacher.megatron.pipeline_model_parallel_size=2",
                                  "teacher.log_prob_micro_batch_size_per_gpu=16"))


QWEN_7B = str(ROOT / "configs/examples/qwen2.5_7b_grpo_8gpu.yaml")
QWEN_32B_TEACHER = [f"{D}.enable=true", f"teacher.model.path={ROOT / 'configs/models/qwen2.5-32b'}",
                    "teacher.megatron.tensor_model_parallel_size=8", "teacher.log_prob_micro_batch_size_per_gpu=4"]
CONTEXT_GIB, COMMUNICATOR_GIB = 0.75, 0.5  # estimates.GpuOverheads' constants, written again


def test_a_teacher_on_a_pool_of_its_own_spans_its_ranks_and_leaves_the_training_gpus(demo_assets, teachers,
                                                                                      tmp_path):
    """teacher.mode=disaggregated: a Qwen2.5-32B teacher at TP8 on two machines of its own beside the 7B student's
    eight GPUs. Its mesh spans its 16 ranks (DP 2), the job holds 24; the training GPUs' phases no longer hold it
    (each lighter by exactly what the colocated teacher's process kept there: its weights, a CUDA context and 4
    communicators: world, TP, DP, TP x PP), and the pool's own GPU holds its pass alone."""
    pooled = plan_from_sources(QWEN_7B, [*QWEN_32B_TEACHER, "teacher.mode=disaggregated", "teacher.nnodes=2",
                                         "teacher.n_gpus_per_node=8"])
    mesh = pooled.layout(Role.TEACHER).mesh
    assert (mesh.tp, mesh.dp, mesh.world_size) == (8, 2, 16) and pooled.resolved.teacher_world == 16
    assert pooled.resolved.total_ranks == 24 and pooled.layout(Role.ACTOR).mesh.world_size == 8
    assert pooled.forward("teacher_log_prob").sequences_per_rank == 256 * 8 // 2
    teacher = next(m for m in pooled.training_memory if m.role == Role.TEACHER)
    assert teacher.params_gib == pytest.approx(32.76e9 * 2 / 8 / 2**30, rel=0.01)  # bf16 weights over TP8
    assert not any("teacher" in item for phase in pooled.gpu_memory.phases for item, _ in phase.items)
    own = pooled.teacher_gpu_memory
    assert [phase.name for phase in own.phases] == ["teacher pass"]
    assert own.phases[0].total_gib == pytest.approx(
        teacher.params_gib + teacher.activations_gib_in_flight + CONTEXT_GIB + 4 * COMMUNICATOR_GIB, abs=0.01)
    colocated = plan_from_sources(QWEN_7B, [*QWEN_32B_TEACHER, "teacher.megatron.tensor_model_parallel_size=8"])
    assert colocated.teacher_gpu_memory is None and colocated.resolved.total_ranks == 8
    kept = teacher.params_gib + CONTEXT_GIB + 3 * COMMUNICATOR_GIB  # at DP1 on 8 GPUs: world, TP, TP x PP
    for phase in pooled.gpu_memory.phases:
        assert colocated.gpu_memory.phase(phase.name).total_gib == pytest.approx(phase.total_gib + kept, abs=0.01)
    text = render_plan(pooled)
    assert "Teacher pool (disaggregated): 2 node(s) × 8 = 16 ranks of its own" in text
    assert "GPU memory per phase of a step, estimated (GiB on one teacher-pool GPU" in text
    # a pool too small for the teacher is refused before any process starts, saying what would fit
    with pytest.raises(ConfigError) as info:
        plan_from_sources(QWEN_7B, [*QWEN_32B_TEACHER, "teacher.mode=disaggregated", "teacher.n_gpus_per_node=1",
                                    "teacher.megatron.tensor_model_parallel_size=1",
                                    "teacher.log_prob_micro_batch_size_per_gpu=16"])
    (issue,) = info.value.issues
    assert issue.field == "teacher.megatron.tensor_model_parallel_size"
    assert "leaves the teacher's pool short of memory" in issue.rule and "split the teacher further" in issue.rule
    # on the CPU demo the pool adds its ranks and the plan says where the teacher runs
    cpu = plan_from_sources(CONFIG, job(demo_assets, tmp_path, f"{D}.enable=true",
                                        f"teacher.model.path={teachers['same']}", "teacher.mode=disaggregated",
                                        "teacher.n_gpus_per_node=1", "teacher.log_prob_micro_batch_size_per_gpu=16"))
    assert cpu.layout(Role.TEACHER).mesh.world_size == 1 and cpu.resolved.total_ranks == 3


def test_a_teacher_with_another_tokenizer_is_refused_naming_both_models(demo_assets, teachers, tmp_path):
    other = teachers["other_tokenizer"]
    found = refusals(job(demo_assets, tmp_path, f"{D}.enable=true", f"teacher.model.path={other}"), check_files=True)
    assert [(f, v) for f, v, _ in found] == [("teacher.model.path", str(other))]
    rule = found[0][2]
    assert "does not share the policy's tokenizer" in rule and str(demo_assets / "model") in rule
    assert "vocabulary or merges differ" in rule
    (tmp_path / "no_tokenizer").mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(teachers["same"] / name, tmp_path / "no_tokenizer" / name)
    found = refusals(job(demo_assets, tmp_path, f"{D}.enable=true", f"teacher.model.path={tmp_path / 'no_tokenizer'}"),
                     check_files=True)
    assert any("holds no tokenizer to compare" in rule for _, _, rule in found), found
    # through the command line as a user runs it: exit 2, the field named, no traceback
    result = subprocess.run([sys.executable, "-m", "hybridrl.cli", "train", CONFIG,
                             *job(demo_assets, tmp_path, f"{D}.enable=true", f"teacher.model.path={other}")],
                            capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "teacher.model.path" in result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr


def test_the_plan_shows_the_teachers_share_of_a_steps_compute(demo_assets, teachers, tmp_path):
    def plan_for(teacher: str):
        return plan_from_sources(CONFIG, job(demo_assets, tmp_path, f"{D}.enable=true",
                                             f"teacher.model.path={teachers[teacher]}",
                                             "teacher.log_prob_micro_batch_size_per_gpu=16"))

    same, small = plan_for("same"), plan_for("three_layers")
    flops = dict(same.step_flops)
    # the teacher is the student's copy: its pass costs what the student's old-log-prob pass does; the update is a
    # forward and a backward (3 forwards) per epoch
    assert flops[Role.TEACHER] == flops["old_log_prob"] > 0
    assert flops["update_actor"] == pytest.approx(3 * flops["old_log_prob"])
    assert 0 < flops["gen"] < flops["old_log_prob"]  # the prompt once per group of n samples
    # a teacher of 3 of the 4 layers: its layers cost 3/4, its vocabulary head (the response tokens of every row,
    # 2 x hidden x vocab FLOPs a token; by hand from config.json) the same
    shape = json.loads((demo_assets / "model" / "config.json").read_text())
    rows, response = same.sequences_per_step, same.config.data.max_response_length
    head = rows * response * 2 * shape["hidden_size"] * shape["vocab_size"]
    smaller = dict(small.step_flops)[Role.TEACHER]
    assert smaller - head == pytest.approx(0.75 * (flops[Role.TEACHER] - head))
    line = next(line for line in render_plan(same).splitlines() if line.startswith("Matmul FLOPs per step"))
    share = flops[Role.TEACHER] / sum(flops.values())
    assert f"teacher {share:.0%}" in line


def test_verls_teacher_server_keys_are_refused_naming_hybridrls_teacher(demo_assets, tmp_path):
    found = refusals(job(demo_assets, tmp_path, "actor_rollout_ref.teacher.server_ip=10.0.0.1",
                         "actor_rollout_ref.teacher.server_port=15555"))
    assert {field for field, _, _ in found} == {"actor_rollout_ref.teacher.server_ip",
                                                 "actor_rollout_ref.teacher.server_port"}
    assert all("teacher.model.path" in rule and "algorithm.distillation.enable" in rule for _, _, rule in found)


def test_the_documented_distillation_figures_are_the_benchs_result():
    """docs/performance.md's table of the real-model distillation runs is bench/results/distillation.json's."""
    runs = json.loads((ROOT / "bench/results/distillation.json").read_text())
    text = (ROOT / "docs/performance.md").read_text()
    section = text[text.index("## On-policy distillation on the real model"):]
    section = section[:section.index("\n## ", 1)]
    assert sorted(runs) == ["full_reverse_kl", "sampled_reverse_kl", "top_k_forward_kl"]
    for loss, run in runs.items():
        row = next(line for line in section.splitlines() if line.startswith(f"| `{loss}`"))
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert cells[1] == str(run["steps"])
        assert cells[2] == f"{run['lr']:.0e}".replace("e-0", "e-")
        assert cells[3] == f"{run['reverse_kl_per_token_first']:.2f} → {run['reverse_kl_per_token_last']:.2f}"
        term = loss if f"{loss}_first" in run else None  # the update's loss term, when the loss is one
        assert cells[4] == (f"{run[f'{term}_first']:.2f} → {run[f'{term}_last']:.2f}" if term else "-")
        assert cells[5] == f"{run['entropy_first']:.2f} → {run['entropy_last']:.2f}"
        assert cells[6] == f"{run['reward_first']:.3f} → {run['reward_last']:.3f}"
        assert cells[7] == f"{run['val_greedy_before']:.3f} → {run['val_greedy_after']:.3f}"
        assert cells[8] == f"{run['median_step_s']:.2f} s"
        minutes, seconds = divmod(round(run["wall_s"]), 60)
        assert cells[9] == f"{minutes} min {seconds} s"


def test_full_reverse_kl_is_refused_above_its_teacher_table_bound_naming_the_top_k_loss(demo_assets, teachers,
                                                                                      tmp_path):
    """full_reverse_kl ships rows x response positions x vocabulary x 4 B of teacher log-probs a step through the
    controller: a job over 4 GiB is refused at plan time naming the figure and the losses that ship less; one just
    under plans. The demo: 16 response positions, a 96-token vocabulary, n = 8: 87,376 prompts are 4,294,705,152 B
    (under 4 GiB = 4,294,967,296 B), 87,384 are 4,295,098,368 B."""
    common = [f"{D}.enable=true", f"{D}.loss=full_reverse_kl", f"teacher.model.path={teachers['same']}"]
    under = plan_from_sources(CONFIG, job(demo_assets, tmp_path, *common, "data.train_batch_size=87376"))
    assert under.resolved.distillation_full_vocab
    found = [r for r in refusals(job(demo_assets, tmp_path, *common, "data.train_batch_size=87384"))
             if r[0] == f"{D}.loss"]
    assert found == [(f"{D}.loss", "full_reverse_kl",
                      "ships the teacher's whole distribution each step: 87384 prompts x 8 samples x 16 response "
                      "positions x 96 token ids x 4 B = 4,295,098,368 B (4.00 GiB), over the 4 GiB this loss "
                      "allows (the controller holds it whole); use top_k_forward_kl (the teacher's top-k tokens, 8 B "
                      "each a position) or sampled_reverse_kl, or fewer rows or positions a step")]


def test_the_plan_says_what_distillation_trains_on_and_what_the_teacher_sends(demo_assets, teachers, tmp_path):
    """One line per job: the signal, its weight, with or without the reward, and what crosses from the teacher a
    step; for full_reverse_kl the table's size: 8 prompts x 8 samples x 16 positions x 96 ids x 4 B = 393,216 B,
    0.4 MiB."""
    same = f"teacher.model.path={teachers['same']}"
    lines = {}
    for loss in ("sampled_reverse_kl", "top_k_forward_kl", "full_reverse_kl"):
        plan = plan_from_sources(CONFIG, job(demo_assets, tmp_path, f"{D}.enable=true", same, f"{D}.loss={loss}",
                                             f"{D}.kl_coef=0.5", f"{D}.task_reward={loss == 'top_k_forward_kl'}"))
        lines[loss] = next(line for line in render_plan(plan).splitlines() if line.startswith("On-policy"))
    head = (f"On-policy distillation from {teachers['same']} (LlamaForCausalLM: 0.6M params, 4 layers, hidden 128, "
            "heads 4/2 (q/kv), vocab 96): ")
    assert lines["sampled_reverse_kl"] == head + ("the sampled token's reverse KL x 0.5 as its advantage, alone (the "
                                                  "reward logged, not trained on)")
    assert lines["top_k_forward_kl"] == head + (
        "KL(teacher's top-32 || student) a loss term x 0.5, added to the task reward's advantages; the teacher sends "
        "32 log-probs and ids a position")
    assert lines["full_reverse_kl"] == head + (
        "KL(student || teacher) over the whole vocabulary a loss term x 0.5, alone (the reward logged, not trained "
        "on); the teacher sends its log-probs of all 96 ids a position: 0.4 MiB a step (refused above 4 GiB)")
    plain = render_plan(plan_from_sources(CONFIG, job(demo_assets, tmp_path)))
    assert "On-policy distillation" not in plain


def test_the_plan_shows_the_teachers_own_model_and_its_layers_per_stage():
    """A teacher of another size than the student (Qwen2.5-32B's 64 layers for 7B's 28), at PP2: its mesh row
    splits its own layers (32+32, where it showed the student's 14+14) and the distillation line names its shape
    (its config.json: configs/models/qwen2.5-32b)."""
    plan = plan_from_sources(QWEN_7B, [*QWEN_32B_TEACHER, "teacher.megatron.tensor_model_parallel_size=4",
                                       "teacher.megatron.pipeline_model_parallel_size=2"])
    text = render_plan(plan)
    meshes = text.split("Training meshes", 1)[1].split("\n\n", 1)[0].splitlines()
    rows = {line.split()[0]: line.split() for line in meshes if line.startswith(("actor ", "teacher "))
            and line.split()[1].isdigit()}
    assert rows["actor"][1:7] == ["2", "1", "-", "1", "4", "28"]
    assert rows["teacher"][1:7] == ["4", "2", "-", "1", "1", "32+32"]
    line = next(line for line in text.splitlines() if line.startswith("On-policy"))
    assert "qwen2.5-32b (Qwen2ForCausalLM: 32,763.9M params, 64 layers, hidden 5120, heads 40/8 (q/kv), vocab " \
           "152064): " in line


def test_a_teacher_too_large_at_its_layout_is_refused_naming_the_smallest_split_of_it_that_fits():
    """A Qwen2.5-32B teacher beside the 7B student on their 8 GPUs, at the teacher's default TP1 (61 GiB of weights
    a GPU): the memory refusal names the teacher's smallest split that fits (8-way; no single doubling of any role
    reaches it, and `plan --search` keeps the teacher's layout as written), which, pasted, plans within the GPU;
    a 4-way split (TP4, or TP2 x PP2) does not fit: the plan refuses it."""
    teacher = [f"{D}.enable=true", f"teacher.model.path={ROOT / 'configs/models/qwen2.5-32b'}",
               "teacher.log_prob_micro_batch_size_per_gpu=4"]
    with pytest.raises(ConfigError) as info:
        plan_from_sources(QWEN_7B, teacher)
    (issue,) = info.value.issues
    assert issue.field == "trainer.gpu_memory_gib" and "would fit with: " in issue.rule, issue.rule
    ways = [way.rsplit(" (", 1)[0] for way in issue.rule.split("would fit with: ", 1)[1].split("; or ")]
    split = ("teacher.megatron.tensor_model_parallel_size=8 and teacher.megatron.pipeline_model_parallel_size=1")
    assert split in ways, ways
    assert plan_from_sources(QWEN_7B, [*teacher, *split.split(" and ")]).gpu_memory.fits
    for tp, pp in ((4, 1), (2, 2)):
        with pytest.raises(ConfigError, match="trainer.gpu_memory_gib"):
            plan_from_sources(QWEN_7B, [*teacher, f"teacher.megatron.tensor_model_parallel_size={tp}",
                                        f"teacher.megatron.pipeline_model_parallel_size={pp}"])


def test_one_tokenizer_in_either_tokenizer_json_format_is_the_same_tokenizer(tmp_path):
    """The teacher's tokenizer is compared by what it does, not by how its tokenizer.json is written: a BPE
    tokenizer saved by tokenizers >= 0.20 (merges as pairs, `ignore_merges` written) and the same one as older
    files hold it (a hub folder saved before: merges as "a b" strings, no `ignore_merges`) encode every text alike
    (checked here with the tokenizers library) and are one tokenizer; one merge dropped is still refused."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from hybridrl.config.inputs import tokenizer_difference

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tokenizer.train_from_iterator(["the cat sat on the mat", "what is 12 plus 35", "the answer is 47"] * 20,
                                  trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<eos>"],
                                                      show_progress=False))
    new, old, other = (tmp_path / name for name in ("new", "old", "other"))
    for folder in (new, old, other):
        folder.mkdir()
    tokenizer.save(str(new / "tokenizer.json"))
    data = json.loads((new / "tokenizer.json").read_text())
    assert isinstance(data["model"]["merges"][0], list) and "ignore_merges" in data["model"]
    data["model"]["merges"] = [" ".join(pair) for pair in data["model"]["merges"]]
    del data["model"]["ignore_merges"]
    (old / "tokenizer.json").write_text(json.dumps(data))
    data["model"]["merges"] = data["model"]["merges"][1:]  # its first merge ("a t") gone
    (other / "tokenizer.json").write_text(json.dumps(data))
    text = "the cat is 47, what is the mat<eos>"
    encodings = [Tokenizer.from_file(str(f / "tokenizer.json")).encode(text).ids for f in (new, old, other)]
    assert encodings[0] == encodings[1] != encodings[2]
    assert tokenizer_difference(new, old) is None and tokenizer_difference(old, new) is None
    assert tokenizer_difference(new, other) == "its vocabulary or merges differ"
