"""The loop of a run: one controller process, no weights, driving the worker groups through PPO/GRPO steps.

`Trainer.fit`: the data and the reward function; the workers (`topology.WorkerTopology`, rebuilt in place after a
failure up to `trainer.max_restarts`); resume from the last checkpoint; then each step (`step.StepRunner`: generate,
score, the passes, the advantages, the updates, the proven sync; with an async rollout mode on the batch the rollout
thread generated ahead, `async_rollout.RolloutDriver`), validation every `test_freq`, a checkpoint every `save_freq`,
every step's metrics to the tracker; a one-screen summary at the end.
"""
from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hybridrl.algorithms.kl_control import kl_controller_from_config
from hybridrl.config.errors import ConfigError, ConfigIssue
from hybridrl.config.hardware import load_hardware
from hybridrl.config.inputs import ground_truth_required, tokenizer_field, unscored_data_source
from hybridrl.config.plan import Plan
from hybridrl.config.report import failure_cost_lines
from hybridrl.config.resume import check_kept_prompts
from hybridrl.config.schema import JobConfig
from hybridrl.config.step_time import StepLengths, StepTime, predict_step_time, time_vs_plan
from hybridrl.controller.dispatch import RankMesh
from hybridrl.controller.gather import WorkerGroupError
from hybridrl.controller.resource_pool import ResourcePoolError
from hybridrl.controller.worker_group import WorkerGroup
from hybridrl.data.batch import Batch
from hybridrl.data.dataloader import PromptDataLoader
from hybridrl.data.dataset import DatasetError, PromptDataset
from hybridrl.data.tokenizer import load_tokenizer, resolve_pad_token_id
from hybridrl.names import Phase
from hybridrl.rewards.custom import RewardFunctionError
from hybridrl.rewards.manager import RewardManager, extra_metrics
from hybridrl.rewards.registry import UnknownScorerError
from hybridrl.rollout.sampling import RolloutSampling
from hybridrl.rollout.turn_rewards import TurnRewardError, turn_rewarder_from_config
from hybridrl.tool_calling import available_parsers, build_registry
from hybridrl.trainer.async_rollout import DriverSettings, RolloutDriver
from hybridrl.trainer.checkpoints import CheckpointError, CheckpointManager
from hybridrl.trainer.part_metrics import merge_part_metrics
from hybridrl.trainer.step import REWARD_EXTRA_INFO, RunState, StepRunner
from hybridrl.trainer.timing import PhaseTimer
from hybridrl.trainer.topology import WorkerTopology
from hybridrl.trainer.tracking import KlCurve, Tracker, active_kl, plot_run, render_summary
from hybridrl.workers.colocated import ColocatedPolicyWorker
from hybridrl.workers.critic import CriticWorker
from hybridrl.workers.policy import DisaggregatedPolicyWorker, PolicyWorker

VAL_GENERATIONS = "val_generations.jsonl"  # trainer.log_val_generations writes here, in the run dir
# a failed attempt's rollout thread ends once the teardown failed its call in flight (seconds, here); a
# restart waits this long for it before giving up
STOPPED_DRIVER_WAIT_S = 120.0


class TrainingFailure(RuntimeError):
    """Training stopped: which step, which phase, and why (a worker's role, rank and cause when one failed).

    Raised from `Trainer.fit` after the workers are torn down; the last complete checkpoint is
    intact (a save in progress is never the latest), so `trainer.resume_mode=auto` continues from it.
    """

    def __init__(self, step: int, phase: Phase, cause: str) -> None:
        self.step = step
        self.phase = phase
        self.cause = cause
        super().__init__(f"training failed at step {step}, phase {phase}: {cause}")


@contextmanager
def _user_input(field: str, value: Any, *errors: type[Exception]) -> Iterator[None]:
    """Reading a user's file (tokenizer, data, reward code): its failure is the config's error on `field`
    (exit 2, the message, no traceback), not a crash. The plan checked these already; what only a full read
    shows (a malformed row, a tokenizer that will not load) ends here."""
    try:
        yield
    except errors as error:
        raise ConfigError([ConfigIssue(field, value, str(error))]) from error


def _refuse_unscored(config: JobConfig, field: str, prompts: PromptDataset) -> None:
    """A row whose data_source names no scorer (algorithm.reward_fn=auto): the config's error before Ray starts, not
    the step that samples it."""
    issue = unscored_data_source(config, field, prompts)
    if issue is not None:
        raise ConfigError([issue])


class NonFiniteGuard:
    """Counts training steps in a row with a skipped optimizer step (NaN/Inf loss or gradients).

    The workers skip such an optimizer step themselves (`hybridrl.training.nonfinite`); a run whose
    steps keep being skipped is not training, so after `limit` in a row (0 = never) it stops.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.consecutive = 0

    def observe(self, metrics: dict[str, float]) -> dict[str, float]:
        skipped = metrics.get("actor/skipped_steps", 0.0) + metrics.get("critic/skipped_steps", 0.0)
        self.consecutive = self.consecutive + 1 if skipped > 0 else 0
        return {"training/consecutive_nonfinite_steps": float(self.consecutive)}

    @property
    def exhausted(self) -> bool:
        return self.limit > 0 and self.consecutive >= self.limit


@dataclass
class RunResult:
    steps: int
    history: list[dict[str, float]] = field(default_factory=list)
    run_dir: Path | None = None
    summary: str = ""


def run_dir_for(plan: Plan) -> Path:
    return plan.config.trainer.run_folder


def checkpoint_root_for(plan: Plan) -> Path:
    return plan.config.trainer.checkpoint_root


class Trainer:
    """The loop of a run: builds the data and the reward function from a Plan, then `fit()`: the workers
    (`topology.WorkerTopology`), resume, the steps (`step.StepRunner`), validation and checkpoint cadence, restarts in
    place, the tracker and the summary."""

    def __init__(self, plan: Plan, *, write=print, progress: bool = True) -> None:
        self.plan = plan
        self.config = plan.config
        self.write = write
        self.progress = progress
        self.run_dir = run_dir_for(plan)
        self.checkpoints = CheckpointManager(checkpoint_root_for(plan), plan.config.trainer.keep_last_n)
        self.run = RunState(kl_controller_from_config(plan.config.algorithm.kl_ctrl))
        self.workers = WorkerTopology(plan, write)
        self._steps: StepRunner | None = None  # once the data and the reward function are built (`fit`)
        hardware = plan.config.trainer.hardware
        # trainer.hardware set: each step logs measured over predicted per phase, predicted at the step's own lengths
        self.hardware = load_hardware(hardware) if hardware else None
        self.predicted_step = predict_step_time(plan, self.hardware) if self.hardware else None
        self.driver: RolloutDriver | None = None  # rollout.async_mode one_step_off / fully_async
        self._stopped_driver: RolloutDriver | None = None  # a failed attempt's, until its thread ended

    @property
    def steps(self) -> StepRunner:
        """What runs a step: built by `fit` once the data and the reward function are."""
        if self._steps is None:
            raise RuntimeError("the step runner is built by fit(), after the data and the reward function")
        return self._steps

    def _build_data(self) -> None:
        """The tokenizer, the train and validation loaders and the reward function; a user's file that does not
        load is the config's error on its field."""
        cfg = self.config
        model = cfg.actor_rollout_ref.model
        # the tokenizers library raises Exception itself (a serde message naming no file): any failure is the field's
        with _user_input(*tokenizer_field(model), Exception):
            self.tokenizer = load_tokenizer(model.tokenizer_path or model.path,
                                            trust_remote_code=model.trust_remote_code)
        # Resolved once here and handed to the workers: prompts, responses and probe rows pad alike.
        self.pad_token_id = resolve_pad_token_id(self.tokenizer, model.path)
        extra: dict[str, Any] = {}
        multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
        if multi_turn.enable:
            # The chat template shows the model its tools (templates without a tools section ignore them).
            extra["tools"] = build_registry(multi_turn.tools, tools_file=multi_turn.tools_file).schemas()
            if multi_turn.tool_parser not in available_parsers():  # none built in, none in the tools file
                raise ConfigError([ConfigIssue(
                    "actor_rollout_ref.rollout.multi_turn.tool_parser", multi_turn.tool_parser,
                    f"is neither built in nor in the TOOL_PARSERS of {multi_turn.tools_file}", available_parsers())])
            try:  # the per-turn reward function is loaded by every worker; a missing one is refused here first
                turn_rewarder_from_config(multi_turn.turn_reward)
            except TurnRewardError as error:
                raise ConfigError([ConfigIssue("actor_rollout_ref.rollout.multi_turn.turn_reward.name",
                                               multi_turn.turn_reward.name, str(error))]) from None
        with _user_input("data.train_files", cfg.data.train_files, DatasetError):
            train = PromptDataset.from_config(cfg.data, cfg.data.train_files, self.tokenizer, **extra,
                                              require_ground_truth=ground_truth_required(cfg, "data.train_files"))
        self.write(f"train data: {train.stats.summary()}")
        _refuse_unscored(cfg, "data.train_files", train)
        if len(train) < cfg.data.train_batch_size:  # the plan counted rows; filtering and skipping drop some
            raise ConfigError([ConfigIssue(
                "data.train_batch_size", cfg.data.train_batch_size,
                f"is more than the {len(train)} usable prompts of data.train_files ({train.stats.summary()}): not "
                f"one batch; lower it to at most {len(train)}, raise data.max_prompt_length, or add data")])
        self.train_rows = train.stats.total_rows  # saved with each checkpoint: the plan compares a resume's data
        self.train_kept = train.stats.summary()
        self.train_loader = PromptDataLoader(train, cfg.data.train_batch_size, self.pad_token_id,
                                             shuffle=cfg.data.shuffle, seed=cfg.trainer.seed)
        left_out = self.train_loader.left_out_note()
        if left_out:  # batches are whole (the step arithmetic): say which prompts that costs
            self.write(f"train data: {left_out} (data.train_batch_size, data.shuffle)")
        self.val_loader = None
        if cfg.data.val_files:
            with _user_input("data.val_files", cfg.data.val_files, DatasetError):
                val = PromptDataset.from_config(cfg.data, cfg.data.val_files, self.tokenizer, **extra,
                                                require_ground_truth=ground_truth_required(cfg, "data.val_files"))
            self.write(f"val data: {val.stats.summary()}")  # over-long prompts are counted there too
            _refuse_unscored(cfg, "data.val_files", val)
            self.val_loader = PromptDataLoader(val, cfg.data.val_batch_size or len(val), self.pad_token_id,
                                               shuffle=False, drop_last=False)
        custom = cfg.algorithm.custom_reward_function
        reward_field, reward_value = (("algorithm.custom_reward_function.path", custom.path) if custom.path
                                      else ("algorithm.reward_fn", cfg.algorithm.reward_fn))
        with _user_input(reward_field, reward_value, RewardFunctionError, UnknownScorerError):
            self.reward = RewardManager.from_config(cfg.algorithm)
        steps_per_epoch = len(self.train_loader)
        self.total_steps = cfg.trainer.total_training_steps or cfg.trainer.total_epochs * steps_per_epoch

    # ------------------------------------------------------------------------------ the rollout driver's source
    # (`async_rollout.RolloutSource`: what an asynchronous rollout reads of the trainer, from its own thread)
    @property
    def kl_curves(self) -> tuple[KlCurve, ...]:
        """The KLs this job is steered by, as the console, the summary and run.png show them."""
        cfg = self.config
        return active_kl(cfg.actor_rollout_ref.actor.use_kl_loss, cfg.algorithm.use_kl_in_reward)

    @property
    def global_step(self) -> int:
        return self.run.global_step

    @property
    def rollout_group(self) -> WorkerGroup:
        return self.workers.rollout_group

    @property
    def rollout_mesh(self) -> RankMesh:
        return self.workers.rollout_mesh

    def next_prompts(self) -> Batch:
        return next(self._prompts)

    def loader_state(self) -> dict[str, Any]:
        return self.train_loader.state_dict()

    def sampling_for_step(self, step: int) -> RolloutSampling:
        return self.steps.sampling(step=step)

    def generate(self, prompts: Batch, sampling: RolloutSampling) -> Batch:
        return self.steps.generate(prompts, sampling)

    def score(self, batch: Batch) -> dict[str, float]:
        return self.steps.score(batch)

    # ------------------------------------------------------------------------------ validation

    def validate(self) -> dict[str, float]:
        if self.val_loader is None:
            return {}
        if self.driver is not None:  # the rollout pool runs ahead: validate while it is parked
            with self.driver.hold():
                return self._validate(self.val_loader)
        return self._validate(self.val_loader)

    def _validate(self, val_loader: PromptDataLoader) -> dict[str, float]:
        scores: list[float] = []
        details: list[Any] = []  # the scorer's extra keys per sample
        turn_parts: list[dict[str, float]] = []  # multi-turn: how the validation conversations went
        samples: list[int] = []
        self.run.phase = Phase.VALIDATE
        shown: list[dict[str, Any]] = []  # trainer.log_val_generations: the first samples, as scored
        for prompts in val_loader:
            batch = self.steps.generate(prompts, self.steps.sampling(validation=True))
            _, output = self.reward.score_batch(batch, self.tokenizer)
            shown.extend(self._generations(batch, output, self.config.trainer.log_val_generations - len(shown)))
            scores.extend(output.scores)
            details.extend(output.details)
            generated = batch.meta.get("metrics") or {}
            turn_parts.append({k: v for k, v in generated.items()
                               if k.startswith("multi_turn/") and k.endswith("_mean")})
            samples.append(len(batch))
        metrics = {"val/score/mean": float(np.mean(scores)) if scores else math.nan}
        metrics.update(extra_metrics(details, prefix="val/extra/", suffix="/mean"))  # as val/score/mean
        if shown:
            with (self.run_dir / VAL_GENERATIONS).open("a", encoding="utf-8") as out:  # one JSON line per sample
                out.writelines(json.dumps(row, ensure_ascii=False, default=str) + "\n" for row in shown)
        if any(turn_parts):
            merged = merge_part_metrics(turn_parts, samples)
            metrics.update({f"val/{k}": v for k, v in merged.items()})
        return metrics

    def _generations(self, batch: Batch, output: Any, count: int) -> list[dict[str, Any]]:
        """Up to `count` of a validation batch's samples as rows of val_generations.jsonl."""
        rows = []
        for i in range(min(max(count, 0), len(output.responses))):
            prompt = batch.non_tensors["raw_prompt"][i] if "raw_prompt" in batch.non_tensors else None
            rows.append({"step": self.run.global_step, "prompt": prompt, "response": output.responses[i],
                         "ground_truth": batch["ground_truth"][i], "score": output.scores[i],
                         REWARD_EXTRA_INFO: output.details[i]})  # the scorer's extra keys, as in the rollout dump
        return rows

    def save(self) -> Path:

        self.run.phase = Phase.SAVE_CHECKPOINT
        partial = self.checkpoints.begin(self.run.global_step)
        try:
            self.workers.actor_group.call_all(PolicyWorker.save_checkpoint, str(partial))
            if self.config.trainer.export_hf_on_save:
                self.workers.actor_group.call_all(PolicyWorker.export_hf, str(partial / "actor_hf"))
            if self.workers.critic is not None:
                self.workers.critic.call_all(CriticWorker.save_checkpoint, str(partial))
            # an async rollout has drawn prompts the trainer has not trained on yet: resume before them
            loader = self.driver.loader_state() if self.driver is not None else self.train_loader.state_dict()
            state = {"dataloader": loader, **self.run.checkpoint_state(),
                     "train_rows": self.train_rows}  # the rows of data.train_files, for the plan's resume check
            return self.checkpoints.commit(partial, self.run.global_step, state)
        except BaseException:
            self.checkpoints.abort(partial)
            raise

    def resume(self, path: Path) -> None:
        """Restore workers, data order and KL coefficient from a complete checkpoint."""

        self.run.phase = Phase.RESUME
        state = self.checkpoints.read_state(path)
        if self.plan.resolved.disaggregated:  # restore the trainer pool, then serve its weights
            self.workers.actor_group.call_all(DisaggregatedPolicyWorker.load_checkpoint, str(path))
            self.workers.sync_weights(version=int(state["global_step"]))
        else:  # the colocated policy restores the actor and syncs vLLM itself
            self.workers.actor_group.call_all(ColocatedPolicyWorker.load_checkpoint, str(path))
        if self.workers.critic is not None:
            self.workers.critic.call_all(CriticWorker.load_checkpoint, str(path))
        self.train_loader.load_state_dict(state["dataloader"])
        kl_note = self.run.restore(state)
        self.write(f"resumed from {path} at step {self.run.global_step}" + (f"; {kl_note}" if kl_note else ""))

    def fit(self) -> RunResult:
        """Run the job to `total_steps`. A worker failure stops it (`TrainingFailure`), or, with
        `trainer.max_restarts`, restarts the workers in place from the last checkpoint this run wrote or
        resumed from (step 0 before any) and goes on, up to that many times."""
        from tqdm import tqdm

        cfg = self.config
        started = time.perf_counter()
        self._build_data()
        self.run.kl_controller = kl_controller_from_config(cfg.algorithm.kl_ctrl)
        self._steps = StepRunner(self.plan, self.workers, self.reward, self.tokenizer, self.run, self.next_prompts)
        self._fresh_loader_state = self.train_loader.state_dict()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.checkpoints.remove_partials()
        try:  # a bad trainer state is refused before Ray or any worker starts
            resume_from = self.checkpoints.resolve_resume(cfg.trainer.resume_mode)
            resume_step = int(self.checkpoints.read_state(resume_from)["global_step"]) if resume_from else 0
        except CheckpointError as error:
            raise TrainingFailure(0, Phase.RESUME, str(error)) from error
        if resume_from is not None:  # the prompts kept, which only reading the data whole tells: before Ray
            issues = check_kept_prompts(cfg, resume_from, self.checkpoints.read_state(resume_from),
                                        self._fresh_loader_state, self.train_kept)
            if issues:
                raise ConfigError(issues)
        self.last_checkpoint = resume_from  # what a restart resumes from: this run's newest sealed checkpoint
        tracker = Tracker.create(cfg.trainer.logger, self.run_dir, project=cfg.trainer.project_name,
                                 experiment=cfg.trainer.experiment_name, config=self.plan.to_dict()["config"],
                                 write=tqdm.write if self.progress else self.write, resume_step=resume_step,
                                 kl=self.kl_curves)
        failures: list[TrainingFailure] = []
        try:
            while True:
                try:
                    self._run_steps(tracker, restart=len(failures))
                    break
                except ResourcePoolError as error:
                    if not failures:
                        raise
                    failures.append(TrainingFailure(self.run.global_step, Phase.SETUP,
                                                    f"restart {len(failures)} found no resources: {error}"))
                    raise _final_failure(failures, cfg.trainer.max_restarts) from error
                except WorkerGroupError as error:
                    # The group is already torn down (fail-fast gather); name where in the step it happened.
                    detected_at = time.time()
                    failure = TrainingFailure(self.run.global_step, self.run.phase, str(error))
                    failures.append(failure)
                    if len(failures) > cfg.trainer.max_restarts:
                        raise _final_failure(failures, cfg.trainer.max_restarts) from error
                    self._restart_in_place(tracker, failure, error, len(failures), detected_at)
        finally:
            tracker.close()
            self.shutdown()
        history = tracker.history
        summary = render_summary(history, f"{cfg.trainer.project_name}/{cfg.trainer.experiment_name}",
                                 kl=self.kl_curves)
        if failures:
            summary += f"\n{'restarts':>16}: " + "; ".join(
                f"step {f.step} ({f.phase}): {f.cause.splitlines()[0]}" for f in failures)
        step_times = [h["timing_s/step"] for h in history if "timing_s/step" in h]
        if step_times:
            cost = failure_cost_lines(cfg.trainer.save_freq, cfg.trainer.max_restarts, float(np.median(step_times)))
            summary += f"\n{'failure cost':>16}: {cost[0]}"
        ratios = {key: float(np.median([h[key] for h in history if key in h]))
                  for key in dict.fromkeys(k for h in history for k in h if k.startswith("time_vs_plan/"))}
        if ratios:
            summary += f"\n{'time vs plan':>16}: " + ", ".join(
                f"{key.removeprefix('time_vs_plan/')} x{value:.2f}" for key, value in ratios.items()) + \
                f" (median measured / predicted on {self.hardware.name if self.hardware else '-'})"
        summary += f"\n{'wall time':>16}: {time.perf_counter() - started:.1f} s; run dir {self.run_dir}"
        if history:
            plot = plot_run(history, self.run_dir / "run.png", kl=self.kl_curves)
            summary += f"\n{'plot':>16}: {plot}"
        return RunResult(self.run.global_step, history, self.run_dir, summary)

    def _run_steps(self, tracker: Tracker, restart: int = 0) -> None:
        """Start the workers (the `restart`-th time), resume from `last_checkpoint`, and train to the end."""
        from tqdm import tqdm

        cfg = self.config
        guard = NonFiniteGuard(cfg.trainer.max_consecutive_nonfinite_steps)
        self.run.phase = Phase.SETUP
        self.workers.build(restart, self.total_steps, self.pad_token_id)
        if self.last_checkpoint is not None:
            self.resume(self.last_checkpoint)
        if cfg.trainer.val_before_train and self.run.global_step == 0:
            tracker.log(0, self.validate())
        bar = tqdm(total=self.total_steps, initial=self.run.global_step, desc="training", unit="step",
                   disable=not self.progress)
        self._prompts = self._prompt_stream()
        if self.plan.resolved.async_mode != "sync":  # the rollout pool runs ahead in a thread
            self.driver = RolloutDriver(self, DriverSettings.of(self.plan))
            for group in self.workers.groups:
                if group is not self.workers.rollout:  # the trainer's groups stop when the rollout thread fails
                    group.watchdog = self.driver.raise_if_failed
            self.driver.start()
        try:
            self._train_loop(tracker, guard, bar)
        finally:
            if self.driver is not None:
                self.driver.stop()
                self._stopped_driver, self.driver = self.driver, None

    def _predicted(self, metrics: dict[str, float]) -> StepTime | None:
        """The plan's prediction of this step (trainer.hardware set): at its own prompt and response lengths where it
        logged them."""
        if self.hardware is None:
            return None
        lengths = StepLengths.from_metrics(metrics)
        step = None if lengths is None else predict_step_time(self.plan, self.hardware, lengths=lengths)
        return step or self.predicted_step

    def _train_loop(self, tracker: Tracker, guard: NonFiniteGuard, bar: Any) -> None:
        cfg = self.config
        while self.run.global_step < self.total_steps:
            self.run.global_step += 1
            metrics = self.steps.step(self.next_prompts()) if self.driver is None else self._async_step(self.driver)
            predicted = self._predicted(metrics)
            if predicted is not None:  # trainer.hardware: where the run departs from its plan's time
                metrics.update(time_vs_plan(predicted, metrics))
            metrics.update(guard.observe(metrics))
            metrics["training/global_step"] = self.run.global_step
            metrics["training/epoch"] = self.train_loader.epoch
            last = self.run.global_step >= self.total_steps
            # the last step validates too, as it saves: a run ends with its final score measured
            if cfg.trainer.test_freq > 0 and (self.run.global_step % cfg.trainer.test_freq == 0 or last):
                metrics.update(self.validate())
            tracker.log(self.run.global_step, metrics)
            bar.update(1)
            if guard.exhausted:
                raise TrainingFailure(self.run.global_step, Phase.UPDATE_ACTOR, (
                    f"{guard.consecutive} steps in a row skipped their optimizer step for a non-finite "
                    "loss or gradient (trainer.max_consecutive_nonfinite_steps="
                    f"{guard.limit}); the weights are those of the last finite step"))
            if cfg.trainer.save_freq > 0 and (self.run.global_step % cfg.trainer.save_freq == 0 or last):
                self.last_checkpoint = self.save()
        bar.close()

    def _async_step(self, driver: RolloutDriver) -> dict[str, float]:
        """One training step on the rollout pool's next batch (generated ahead, one or more versions old),
        then the sync of the new weights with the driver held at a boundary."""
        timer = PhaseTimer()
        with self.steps.timed(timer, Phase.WAIT_ROLLOUT):
            batch, metrics = driver.next_batch(self.run.global_step)

        def sync() -> dict[str, float]:
            with driver.hold(version=self.run.global_step):
                return self.workers.sync_weights(self.run.global_step)

        return self.steps.train_on(batch, timer, metrics, sync)

    def _restart_in_place(self, tracker: Tracker, failure: TrainingFailure, error: WorkerGroupError,
                          restart: int, detected_at: float) -> None:
        """Tear every group down, go back to `last_checkpoint` (or step 0), and log why (and when the
        failure was detected: `detected_at`, wall-clock seconds)."""
        self.workers.shutdown_workers()
        self._await_stopped_driver(failure.step)
        self.checkpoints.remove_partials()  # a save the failure interrupted
        if self.last_checkpoint is not None:
            resume_step = int(self.checkpoints.read_state(self.last_checkpoint)["global_step"])
        else:  # no checkpoint yet: step 0, with the data order and KL state of a fresh start
            resume_step = 0
            self.run.global_step = 0
            self.train_loader.load_state_dict(self._fresh_loader_state)
            self.run.kl_controller = kl_controller_from_config(self.config.algorithm.kl_ctrl)
        tracker.rewind(resume_step)
        where = f"from {self.last_checkpoint}" if self.last_checkpoint is not None else "from the start"
        # the headline on one line (what failed, where it goes on from), the workers' reports after it
        headline, _, details = str(failure).partition("\n")
        self.write(f"restart {restart}/{self.config.trainer.max_restarts} in place: {headline}; "
                   f"resuming {where} at step {resume_step}" + (f"\n{details}" if details else ""))
        tracker.event(failure.step, {
            "event": "restart", "restart": restart, "max_restarts": self.config.trainer.max_restarts,
            "phase": str(failure.phase), "group": error.group, "rank": error.rank,
            "cause": str(error).splitlines()[0], "detected_at": detected_at, "resume_step": resume_step,
            "resume_from": str(self.last_checkpoint) if self.last_checkpoint is not None else None,
        })

    def _await_stopped_driver(self, step: int) -> None:
        """The failed attempt's rollout thread must be gone before new groups start: it reads the trainer's
        groups and prompt stream, so a thread still running would call into the new workers or take a prompt
        batch of the resumed run. The teardown just ended any call it had in flight."""
        driver, self._stopped_driver = self._stopped_driver, None
        if driver is not None and not driver.ended(STOPPED_DRIVER_WAIT_S):
            raise TrainingFailure(step, Phase.SETUP, (
                f"the rollout driver of the failed attempt was still running {STOPPED_DRIVER_WAIT_S:.0f} s after "
                "its workers were torn down; restarting would let it call into the new workers"))

    def _prompt_stream(self):
        """Prompt batches across epochs (the loader reshuffles per epoch and resumes mid-epoch)."""
        while True:
            yield from self.train_loader

    def shutdown(self) -> None:
        self.workers.shutdown()
        reward = getattr(self, "reward", None)
        if reward is not None:
            reward.close()  # its worker process, with algorithm.custom_reward_function.timeout_s

    def stop_report(self, signal_name: str) -> str:
        """What a run stopped by `signal_name` (Ctrl-C's SIGINT, SIGTERM, SIGHUP) tells its user once its workers are
        shut down: where it was, and where the next run goes on from."""
        return f"stopped by {signal_name} {self.where()}; its workers and Ray are shut down; {self.resume_hint()}"

    def where(self) -> str:
        """Where in the run it is now, for a message: before its steps, or the step and its phase."""
        before_steps = {Phase.START: "before its workers started", Phase.SETUP: "while its workers started",
                        Phase.RESUME: "while resuming"}
        return before_steps.get(self.run.phase, f"at step {self.run.global_step} ({self.run.phase})")

    def resume_hint(self) -> str:
        """Where the next run goes on from: the newest complete checkpoint on disk, or step 0."""
        latest = self.checkpoints.latest()
        save_freq = self.config.trainer.save_freq
        if latest is not None:
            return (f"the newest complete checkpoint is {latest}: trainer.resume_mode=auto (the default) continues "
                    "from it")
        if save_freq > 0:
            return f"no checkpoint yet (the first is at step {save_freq}): the next run starts from step 0"
        return f"no checkpoint (trainer.save_freq={save_freq}): the next run starts from step 0"


def _final_failure(failures: list[TrainingFailure], max_restarts: int) -> TrainingFailure:
    """The failure that stops the run; with restarts, it names every failure before it too."""
    last = failures[-1]
    if len(failures) == 1:
        return last
    earlier = "; ".join(f"{i}) step {f.step}, phase {f.phase}: {f.cause.splitlines()[0]}"
                        for i, f in enumerate(failures[:-1], 1))
    return TrainingFailure(last.step, last.phase, (
        f"{last.cause}\n(the run's failure {len(failures)}, with trainer.max_restarts={max_restarts}; it had "
        f"restarted in place after: {earlier})"))
