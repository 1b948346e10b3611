"""The frozen roles in processes of their own: built once, then only scoring (`workers.backends.FrozenBackend`: with
their `megatron.param_offload` their weights wait on the host between passes).

    RewardModelWorker  compute_rm_score (a reward model's score per response)
    TeacherWorker      compute_teacher_log_prob (on-policy distillation's teacher)
"""
from __future__ import annotations

from hybridrl.config.plan import Plan
from hybridrl.controller.base_worker import RankContext, Worker
from hybridrl.controller.dispatch import MeshCoord
from hybridrl.data.batch import Batch
from hybridrl.names import Role
from hybridrl.training.actor import MegatronActor
from hybridrl.training.reward_model import MegatronRewardModel
from hybridrl.workers.backends import FrozenBackend, mesh_coord


class FrozenRoleWorker(Worker):
    BUILT_BY = "init_model"
    ROLE: Role

    def __init__(self, context: RankContext, plan: Plan) -> None:
        super().__init__(context)
        self.plan = plan
        self.frozen: FrozenBackend | None = None

    def _build(self) -> FrozenBackend:
        self.use_torch_threads(self.plan.config.trainer.torch_threads_per_rank)
        self.frozen = FrozenBackend.build(self.plan, self.ROLE)
        return self.frozen

    def mesh_coords(self) -> MeshCoord:
        return mesh_coord(self._require(self.frozen, f"the {self.ROLE}").backend)


class RewardModelWorker(FrozenRoleWorker):
    ROLE = Role.REWARD_MODEL

    def __init__(self, context: RankContext, plan: Plan) -> None:
        super().__init__(context, plan)
        self.reward_model: MegatronRewardModel | None = None

    def init_model(self) -> None:
        self.reward_model = MegatronRewardModel(self._build().backend, self.plan)

    def compute_rm_score(self, batch: Batch) -> Batch | None:
        reward_model = self._require(self.reward_model, "the reward model")
        with self._require(self.frozen, "the reward model").scoring():
            return reward_model.compute_scores(batch)


class TeacherWorker(FrozenRoleWorker):
    """On-policy distillation's teacher: a frozen causal LM in its own processes and layout (`teacher.*`), scoring
    the student's sampled tokens (`teacher_log_probs`, at the rollout's temperature as the student's old
    log-probs are)."""

    ROLE = Role.TEACHER

    def __init__(self, context: RankContext, plan: Plan) -> None:
        super().__init__(context, plan)
        self.teacher: MegatronActor | None = None

    def init_model(self) -> None:
        self.teacher = MegatronActor(self._build().backend, self.plan, log_prob_pass="teacher_log_prob",
                                     output_key="teacher_log_probs")

    def compute_teacher_log_prob(self, batch: Batch) -> Batch | None:
        teacher = self._require(self.teacher, "the teacher")
        with self._require(self.frozen, "the teacher").scoring():
            # top_k_forward_kl: also the teacher's top-k tokens at every response position; full_reverse_kl: its
            # log-probs of every id of the student's vocabulary there. Every signal is the teacher's distribution
            # over the student's vocabulary: a teacher of more rows (a padded vocabulary of the same tokenizer) is
            # renormalised over the ids the student can write, never sends an id the student lacks.
            resolved, student = self.plan.resolved, self.plan.model
            if student is None:  # a plan built without its model folder (plan --layout-only) trains nothing
                raise RuntimeError("the teacher's pass needs the student's vocabulary size: the plan has no model")
            full_vocab = student.vocab_size if resolved.distillation_full_vocab else 0
            return teacher.compute_log_prob(batch, top_k=resolved.distillation_top_k, full_vocab=full_vocab,
                                            vocab_size=student.vocab_size)
