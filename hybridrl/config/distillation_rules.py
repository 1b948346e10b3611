"""The rules of on-policy distillation (`algorithm.distillation`, the `teacher` section), checked at plan time.

Torch-free. Called by `config.validate` with its list of issues: every rule appends a `ConfigIssue` naming the
field, the value and what would be valid. The teacher's tokenizer is compared with the policy's by
`config.inputs` (it reads files: `plan` checks it, `plan --layout-only` does not).
"""
from __future__ import annotations

from hybridrl.config.errors import ConfigIssue
from hybridrl.config.model_shapes import load_model_shape
from hybridrl.config.schema import JobConfig
from hybridrl.models.arch import ModelShape

DISTILLATION = "algorithm.distillation"


def teacher_shape(config: JobConfig, issues: list[ConfigIssue]) -> ModelShape | None:
    """The teacher's shape from its config.json when distillation is on and the folder has one (else None: the
    input checks refuse a missing folder); an unsupported or unreadable config.json is refused there."""
    if not config.algorithm.distillation.enable:
        return None
    return load_model_shape(config.teacher.model.path, issues, [], "teacher.model.path", quiet=True)


def check_distillation(config: JobConfig, student: ModelShape | None, teacher: ModelShape | None,
                       critic_enabled: bool, issues: list[ConfigIssue]) -> None:
    """Distillation's settings: a teacher named when it is on, never when it is off (a setting silently dropped);
    the teacher a causal LM the student's token ids index; what pure distillation leaves without meaning."""
    settings, algorithm = config.algorithm.distillation, config.algorithm
    teacher_model = config.teacher.model
    if not settings.enable:
        if teacher_model.path:
            issues.append(ConfigIssue("teacher.model.path", teacher_model.path,
                                      f"names a teacher but {DISTILLATION}.enable is false, so nothing would use "
                                      f"it: set {DISTILLATION}.enable=true to distil from it, or remove it"))
        return
    if not teacher_model.path:
        issues.append(ConfigIssue("teacher.model.path", teacher_model.path,
                                  f"must name the teacher's Hugging Face folder when {DISTILLATION}.enable=true "
                                  "(a causal LM with the policy's tokenizer)"))
    top_k = settings.top_k
    if top_k is not None and settings.loss != "top_k_forward_kl":
        issues.append(ConfigIssue(f"{DISTILLATION}.top_k", top_k, f"applies to {DISTILLATION}.loss=top_k_forward_kl "
                                                                  f"only, not loss={settings.loss}; leave it null",
                                  [None]))
    elif top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1
                                or (student is not None and top_k > student.vocab_size)):
        bound = f" and at most the vocabulary ({student.vocab_size})" if student is not None else ""
        issues.append(ConfigIssue(f"{DISTILLATION}.top_k", top_k, f"must be an integer >= 1{bound}: the teacher's "
                                                                  "tokens kept at each position"))
    _check_full_vocab_table(config, student, issues)
    coef = settings.kl_coef
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not coef > 0:
        issues.append(ConfigIssue(f"{DISTILLATION}.kl_coef", coef, "must be a number > 0 (the weight of the "
                                                                   "distillation signal: the reverse KL in the "
                                                                   "advantage, or the top-k loss term)"))
    if teacher is not None and student is not None and teacher.vocab_size < student.vocab_size:
        issues.append(ConfigIssue(
            "teacher.model.path", teacher_model.path,
            f"has a vocabulary of {teacher.vocab_size} rows, fewer than the student's {student.vocab_size} "
            f"(actor_rollout_ref.model.path): the teacher must score every token id the student can sample; "
            "name a teacher of the same tokenizer family with at least as many rows"))
    if not settings.task_reward:
        pure = f"with {DISTILLATION}.task_reward=false (pure distillation: the reward is logged, not trained on)"
        if critic_enabled:
            field, value = (("critic.enable", True) if config.critic.enable else
                            ("algorithm.adv_estimator", algorithm.adv_estimator))
            valid = ["grpo"] if field == "algorithm.adv_estimator" else [False]
            issues.append(ConfigIssue(field, value, f"trains a critic on the task reward, which nothing uses {pure}; "
                                                    "use a critic-free estimator or task_reward=true",
                                      valid))
        elif algorithm.adv_estimator != "grpo":  # the default, which nothing reads either
            issues.append(ConfigIssue("algorithm.adv_estimator", algorithm.adv_estimator,
                                      f"makes advantages of the task reward, which nothing trains on {pure}; leave "
                                      "it at grpo or set task_reward=true", ["grpo"]))
        if not algorithm.norm_adv_by_std_in_grpo:
            issues.append(ConfigIssue("algorithm.norm_adv_by_std_in_grpo", False,
                                      f"scales the task reward's advantages, which nothing trains on {pure}; leave "
                                      "it true or set task_reward=true", [True]))
        if algorithm.filter_groups.enable:
            issues.append(ConfigIssue("algorithm.filter_groups.enable", True,
                                      f"keeps groups by their reward spread, which nothing trains on {pure}; set it "
                                      "false or task_reward=true", [False]))
        if algorithm.use_kl_in_reward:
            issues.append(ConfigIssue("algorithm.use_kl_in_reward", True,
                                      f"puts a KL penalty into the task reward, which nothing trains on {pure}; "
                                      "use actor.use_kl_loss for a reference KL, or task_reward=true", [False]))


# full_reverse_kl: the most bytes of teacher distribution a step may ship. The table goes whole through the
# controller (the teacher's output ranks -> the driver -> every rank of each student DP replica), as float32: a few
# GiB is what a driver and the object store hold beside the rest of a step; above it the top-k loss is the tool.
FULL_VOCAB_TABLE_LIMIT_BYTES = 4 * 2**30


def full_vocab_table_bytes(config: JobConfig, student: ModelShape) -> int:
    """full_reverse_kl's teacher table a step: rows x response positions x the student's vocabulary x 4 B."""
    rows = config.data.train_batch_size * config.actor_rollout_ref.rollout.n
    return rows * config.data.max_response_length * student.vocab_size * 4


def _check_full_vocab_table(config: JobConfig, student: ModelShape | None, issues: list[ConfigIssue]) -> None:
    if config.algorithm.distillation.loss != "full_reverse_kl" or student is None:
        return
    counts = (config.data.train_batch_size, config.actor_rollout_ref.rollout.n, config.data.max_response_length)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in counts):
        return  # refused by the batch and length checks
    size = full_vocab_table_bytes(config, student)
    if size > FULL_VOCAB_TABLE_LIMIT_BYTES:
        rows, n, length = counts
        issues.append(ConfigIssue(
            f"{DISTILLATION}.loss", "full_reverse_kl",
            f"ships the teacher's whole distribution each step: {rows} prompts x {n} samples x {length} response "
            f"positions x {student.vocab_size} token ids x 4 B = {size:,} B ({size / 2**30:.2f} GiB), over the "
            f"{FULL_VOCAB_TABLE_LIMIT_BYTES // 2**30} GiB this loss allows (the controller holds it whole); use "
            "top_k_forward_kl (the teacher's top-k tokens, 8 B each a position) or sampled_reverse_kl, or fewer "
            "rows or positions a step", ["sampled_reverse_kl", "top_k_forward_kl"]))


def check_teacher_placement(config: JobConfig, issues: list[ConfigIssue]) -> bool:
    """teacher.mode and its pool: the pool's sizes required (and valid) when the teacher has ranks of its own, never
    set when it shares the training ranks or distillation is off (a setting silently dropped). False when the pool
    is invalid, so that the teacher's layout is not checked against it."""
    teacher = config.teacher
    enabled = config.algorithm.distillation.enable
    if enabled and teacher.mode == "disaggregated":
        ok = True
        for name, value in (("nnodes", teacher.nnodes), ("n_gpus_per_node", teacher.n_gpus_per_node)):
            if value is None:
                ok = False
                issues.append(ConfigIssue(f"teacher.{name}", None, "is required with teacher.mode=disaggregated: "
                                          "the teacher pool's ranks per machine (GPUs apart from the trainer's)"))
            elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
                ok = False
                issues.append(ConfigIssue(f"teacher.{name}", value, "must be an integer >= 1"))
        return ok
    if not enabled and teacher.mode == "disaggregated":
        issues.append(ConfigIssue("teacher.mode", teacher.mode, f"places a teacher but {DISTILLATION}.enable is "
                                  "false, so there is none: remove it, or turn distillation on", ["colocated"]))
    elif teacher.mode == "colocated":  # an unknown mode: reported with the other choices
        for name, value, default in (("nnodes", teacher.nnodes, 1), ("n_gpus_per_node", teacher.n_gpus_per_node, None)):
            if value != default:
                issues.append(ConfigIssue(
                    f"teacher.{name}", value, "sizes the teacher's own pool; with teacher.mode=colocated the teacher "
                    "runs on the training ranks (trainer.nnodes × trainer.n_gpus_per_node): remove it, or set "
                    "teacher.mode=disaggregated", [default]))
    return True
