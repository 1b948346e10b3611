"""Names shared by the config, the trainer and the workers: one vocabulary each (no torch, no imports).

`Phase`: the phases of a training run. One name is used by the trainer's timers (metric
`timing_s/<phase>`), by `Trainer.phase` and `TrainingFailure` (which phase a failure stopped) and by
the test-only fault points (`HYBRIDRL_FAULT=<phase>:<call>:<rank>`, `hybridrl.workers.faults`).

`Role`: the named job a model does (`role_spec(plan, role)`, `plan.layout(role)`,
`plan.update(role)`, role checkpoints). `GroupName`: the worker groups the trainer builds
(`WorkerGroup(name=...)`, `RankContext.group`, `WorkerGroupError.group`, named in a failing worker's message);
the colocated policy's group holds the
actor, the reference and the rollout in the same processes.

Both are `StrEnum`s: a member equals, hashes and formats as its value, so `timing_s/{phase}`, a
dict keyed by role strings and a JSON Plan read the same as before.
"""
from __future__ import annotations

from enum import StrEnum


class Phase(StrEnum):
    START = "start"  # before set-up
    SETUP = "setup"  # worker groups, models, vLLM, the first proven sync
    RESUME = "resume"  # loading a checkpoint
    GEN = "gen"  # generation (the fault point: `ColocatedPolicyWorker.generate_sequences`)
    REWARD = "reward"  # scoring, on the controller or the reward model
    GEN_BASELINE = "gen_baseline"  # ReMax: one greedy response per prompt
    REWARD_BASELINE = "reward_baseline"
    RELEASE_ROLLOUT_MEMORY = "release_rollout_memory"  # vLLM sleeps before training
    OLD_LOG_PROB = "old_log_prob"  # the actor's old-log-prob pass (fault point: `compute_log_prob`)
    REF = "ref"  # the reference's log-probs
    TEACHER = "teacher"  # on-policy distillation: the teacher's log-probs of the sampled tokens
    VALUES = "values"  # the critic's values
    ADV = "adv"  # advantages on the controller
    UPDATE_CRITIC = "update_critic"
    UPDATE_ACTOR = "update_actor"  # also where a run of non-finite steps stops training
    SYNC = "sync"  # weight sync into vLLM, proven
    WAIT_ROLLOUT = "wait_rollout"  # async rollout: the trainer waiting for the pool's next batch
    VALIDATE = "validate"
    SAVE_CHECKPOINT = "save_checkpoint"


# The timed phases of a step, in the order summaries and plots show them.
TIMED_PHASES = (Phase.WAIT_ROLLOUT, Phase.GEN, Phase.REWARD, Phase.RELEASE_ROLLOUT_MEMORY, Phase.OLD_LOG_PROB,
                Phase.REF, Phase.TEACHER, Phase.VALUES, Phase.ADV, Phase.UPDATE_CRITIC, Phase.UPDATE_ACTOR, Phase.SYNC)


class Role(StrEnum):
    ACTOR = "actor"
    REF = "ref"
    CRITIC = "critic"
    REWARD_MODEL = "reward_model"
    TEACHER = "teacher"  # on-policy distillation: a frozen model scoring the student's sampled tokens


class GroupName(StrEnum):
    ACTOR_ROLLOUT_REF = "actor_rollout_ref"  # ColocatedPolicyWorker: actor + reference + vLLM (disaggregated:
    #                                          DisaggregatedPolicyWorker, actor + reference on the trainer pool)
    ROLLOUT = "rollout"  # RolloutWorker: vLLM on the disaggregated rollout pool
    CRITIC = "critic"
    REWARD_MODEL = "reward_model"
    TEACHER = "teacher"
