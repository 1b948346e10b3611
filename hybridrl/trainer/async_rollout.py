"""The rollout pool running ahead of the trainer (`rollout.async_mode: one_step_off | fully_async`).

A `RolloutDriver` is a thread of the controller that owns the rollout group while the main thread
trains. They meet in three places:

- the buffer: the driver appends scored prompt groups (every sample of a prompt, GRPO's unit), each
  row tagged with the policy versions its tokens came from; the trainer takes `train_batch_size`
  groups, oldest first (`next_batch`);
- `hold()`: the trainer parks the driver at a boundary where no request runs in vLLM, to sync
  weights (or validate, or score a probe) through the rollout group, then lets it go on under the
  new version. one_step_off parks between whole batches; fully_async pauses the requests in flight
  (a partial rollout: they continue under the new weights, `rollout.continuous`), or with
  `partial_rollout: false` lets them finish on the old weights first;
- failures: whichever side fails first, the other stops within a poll slice (the driver's error is
  raised in the trainer's waits through the groups' watchdog; the trainer tearing the groups down
  ends the driver's calls).

one_step_off generates batch k+1 with the weights of step k-1 while step k trains: each batch is
one version old when trained, and the sync waits for that generation to end. fully_async admits a
new batch of prompts only while the samples it could produce stay within `rollout.max_staleness`
versions of the policy that will train on them (AReaL's bound on what is generated), and drops or
keeps (counting them either way) any sample that is older anyway when the trainer reaches it.

Staleness of a sample = the trainer's weight version when it trains on it (global step - 1) minus
the oldest version among its tokens.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from hybridrl.data.batch import Batch
from hybridrl.data.dataloader import unpadded_prompt_ids
from hybridrl.trainer.part_metrics import merge_part_metrics
from hybridrl.workers.generation import concat_left_padded
from hybridrl.workers.rollout_worker import RolloutWorker

if TYPE_CHECKING:
    from hybridrl.config.plan import Plan
    from hybridrl.controller.dispatch import RankMesh
    from hybridrl.controller.worker_group import WorkerGroup
    from hybridrl.rollout.sampling import RolloutSampling

# fully_async: engine steps per `stream_advance` call, so a hold is answered within about this many steps
STREAM_STEPS_PER_CALL = 8
POLL_S = 0.05


class DriverStopped(RuntimeError):
    """The driver was stopped (the run ended or failed) while the trainer waited on it."""


@dataclass
class _Group:
    """One prompt's n scored samples, and what the buffer needs to know about them."""

    rows: Batch
    oldest_version: int
    prompt_batch: int  # which admitted prompt batch it came from (for the loader state of a resume)


@dataclass
class _PromptBatch:
    loader_state: dict[str, Any]  # the data loader's state before this batch was drawn
    groups: int
    consumed: int = 0


@dataclass
class AsyncStats:
    """What the driver measured since the last batch the trainer took."""

    generation_metrics: list[dict[str, float]] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    dropped_groups: int = 0


class RolloutSource(Protocol):
    """What the driver reads of the trainer (the `Trainer` is one), from the driver's thread: prompts in, generated
    and scored rows out."""

    @property
    def global_step(self) -> int: ...  # the weights the rollout serves when the driver starts

    @property
    def rollout_group(self) -> WorkerGroup: ...

    @property
    def rollout_mesh(self) -> RankMesh: ...

    def next_prompts(self) -> Batch: ...  # the next prompt batch of the data loader

    def loader_state(self) -> dict[str, Any]: ...  # the loader's state before the next batch

    def sampling_for_step(self, step: int) -> RolloutSampling: ...  # the sampling (seeds) of a training step

    def generate(self, prompts: Batch, sampling: RolloutSampling) -> Batch: ...  # every replica's samples

    def score(self, batch: Batch) -> dict[str, float]: ...  # token_level_scores set, the reward metrics back


@dataclass(frozen=True)
class DriverSettings:
    mode: str  # one_step_off | fully_async
    batch_groups: int  # prompt groups per training step (data.train_batch_size)
    max_staleness: int
    drop_stale: bool
    partial: bool  # fully_async's partial rollouts (pause and resume under new weights)

    @classmethod
    def of(cls, plan: Plan) -> DriverSettings:
        res = plan.resolved
        fully = res.async_mode == "fully_async"
        return cls(res.async_mode, plan.config.data.train_batch_size, res.max_staleness if fully else 1,
                   fully and res.stale_samples == "drop", fully and res.partial_rollout)


class RolloutDriver:
    """See the module docstring. `start()`, then `next_batch()` / `hold()` from the trainer's thread."""

    def __init__(self, source: RolloutSource, settings: DriverSettings) -> None:
        self.source = source
        self.mode = settings.mode
        self.batch_groups = settings.batch_groups
        self.max_staleness = settings.max_staleness
        self.drop_stale = settings.drop_stale
        self.partial = settings.partial
        self.version = source.global_step  # the weights the rollout serves
        self._lock = threading.Condition()
        self._buffer: deque[_Group] = deque()
        self._prompt_batches: dict[int, _PromptBatch] = {}
        self._admitted_batches = 0  # prompt batches drawn so far (by this driver)
        self._first_batch_index = source.global_step  # the step whose data the first admitted batch is
        self._hold_requested = False
        self._parked = False
        self._stop = False
        self.error: BaseException | None = None
        self._stats = AsyncStats()
        self._thread = threading.Thread(target=self._run, name="rollout-driver", daemon=True)

    # ------------------------------------------------------------------------------ the trainer's side
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        # a call in flight ends when the groups are torn down (the daemon thread then exits on _stop)
        self._thread.join(timeout=5)

    def ended(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the driver's thread to end (after `stop()` and the groups' teardown,
        which ends any call it had in flight); whether it did."""
        self._thread.join(timeout=timeout_s)
        return not self._thread.is_alive()

    def raise_if_failed(self) -> None:
        """The groups' watchdog: the driver's failure, raised in the trainer's thread."""
        if self.error is not None:
            raise self.error

    def _wait(self, ready: Any) -> None:
        """Block the trainer until `ready()` (under the lock), raising the driver's failure."""
        with self._lock:
            while not ready():
                self.raise_if_failed()
                if self._stop or not self._thread.is_alive():
                    self.raise_if_failed()
                    raise DriverStopped("the rollout driver stopped")
                self._lock.wait(POLL_S)

    def next_batch(self, step: int) -> tuple[Batch, dict[str, float]]:
        """The next `train_batch_size` groups for training step `step` (1-based; trained with weights of
        version step - 1), and the async metrics of the batch (staleness, drops, buffer)."""
        trained_version = step - 1
        selected: list[_Group] = []
        stale = dropped = 0
        while len(selected) < self.batch_groups:
            self._wait(lambda: bool(self._buffer))
            with self._lock:
                while self._buffer and len(selected) < self.batch_groups:
                    group = self._buffer.popleft()
                    self._retire(group)
                    if trained_version - group.oldest_version > self.max_staleness:
                        stale += 1
                        if self.drop_stale:
                            dropped += 1
                            continue
                    selected.append(group)
                self._lock.notify_all()  # room for more (one_step_off, the staleness bound)
        with self._lock:
            stats, self._stats = self._stats, AsyncStats()
            buffered = len(self._buffer)
        batch = _concat_groups([g.rows for g in selected])
        metrics = _merge_generation_metrics(stats)
        metrics.update(staleness_metrics(batch, trained_version))
        metrics.update({"async/stale_groups": float(stale), "async/dropped_stale_groups": float(dropped),
                        "async/buffered_groups": float(buffered)})
        return batch, metrics

    @contextmanager
    def hold(self, version: int | None = None) -> Iterator[None]:
        """Park the driver at a boundary with nothing running in vLLM; on exit it goes on, serving
        `version` if given (the weights just synced)."""
        with self._lock:
            self._hold_requested = True
            self._lock.notify_all()
        try:
            self._wait(lambda: self._parked)
            yield
        finally:
            with self._lock:
                if version is not None:
                    self.version = version
                self._hold_requested = False
                self._lock.notify_all()
            if self.error is None and not self._stop:
                self._wait(lambda: not self._parked)

    def loader_state(self) -> dict[str, Any]:
        """The data loader's state a resume should start from: before the oldest prompt batch that still
        has groups not taken by the trainer (those prompts are generated again; see the module docs)."""
        with self._lock:
            live = [b for b in self._prompt_batches.values() if b.consumed < b.groups]
            if live:
                return live[0].loader_state
            return self.source.loader_state()

    def _retire(self, group: _Group) -> None:
        batch = self._prompt_batches[group.prompt_batch]
        batch.consumed += 1

    # ------------------------------------------------------------------------------ the driver's side
    def _run(self) -> None:
        try:
            if self.mode == "one_step_off":
                self._run_one_step_off()
            else:
                self._run_fully_async()
        except BaseException as error:  # noqa: BLE001 - handed to the trainer's thread
            with self._lock:
                if not self._stop:
                    self.error = error
                self._lock.notify_all()

    def _park_if_held(self, before: Any = None, after: Any = None) -> bool:
        """When the trainer asked for a hold: `before()`, park until released, `after()`; whether it parked."""
        with self._lock:
            if not self._hold_requested or self._stop:
                return False
        if before is not None:
            before()
        with self._lock:
            self._parked = True
            self._lock.notify_all()
            while self._hold_requested and not self._stop:
                self._lock.wait(POLL_S)
            self._parked = False
            self._lock.notify_all()
        if after is not None and not self._stop:
            after()
        return True

    def _draw_prompts(self) -> tuple[int, Batch]:
        state = self.source.loader_state()
        prompts = self.source.next_prompts()
        index = self._admitted_batches
        self._admitted_batches += 1
        with self._lock:
            self._prompt_batches[index] = _PromptBatch(state, len(prompts))
        return index, prompts

    def _publish(self, groups: list[_Group], generation_metrics: dict[str, float], rows: int) -> None:
        with self._lock:
            self._buffer.extend(groups)
            self._stats.generation_metrics.append(generation_metrics)
            self._stats.rows.append(rows)
            # forget prompt batches whose groups have all been taken
            done = [i for i, b in self._prompt_batches.items() if b.consumed >= b.groups]
            for i in done[:-1]:
                del self._prompt_batches[i]
            self._lock.notify_all()

    def _score(self, batch: Batch) -> dict[str, float]:
        metrics = self.source.score(batch)
        batch.meta.pop("reward_output", None)
        return metrics

    def _run_one_step_off(self) -> None:
        source = self.source
        while True:
            # at most one batch ahead of the trainer: wait until it took the last one (or a hold comes)
            with self._lock:
                while self._buffer and not self._hold_requested and not self._stop:
                    self._lock.wait(POLL_S)
                if self._stop:
                    return
            if self._park_if_held():
                continue
            index, prompts = self._draw_prompts()
            step = self._first_batch_index + index + 1
            started = time.perf_counter()
            batch = source.generate(prompts, source.sampling_for_step(step))
            metrics = dict(batch.meta.pop("metrics", {}) or {})
            metrics.update(self._score(batch))
            metrics["timing_s/rollout_batch"] = time.perf_counter() - started
            version = int(batch["policy_version"].min()) if "policy_version" in batch else self.version
            self._publish(_split_groups(batch, version, index), metrics, len(batch))

    def _run_fully_async(self) -> None:
        source = self.source
        group = source.rollout_group
        in_flight_batches = 0  # admitted prompt batches whose groups are not all generated yet
        generated: dict[int, int] = {}
        while True:
            if self._stop:
                return
            if self.partial:
                parked = self._park_if_held(before=lambda: group.call_all(RolloutWorker.stream_pause),
                                            after=lambda: group.call_all(RolloutWorker.stream_resume))
            else:
                parked = in_flight_batches == 0 and self._park_if_held()
            if parked:
                continue
            draining = not self.partial and self._hold_requested
            with self._lock:
                # admit while what this batch could yield stays within the staleness bound of the trainer
                bound = (self.version + self.max_staleness + 1) - self._first_batch_index
                can_admit = (not draining and self._admitted_batches < bound
                             and in_flight_batches < self.max_staleness + 1)
            if can_admit:
                index, prompts = self._draw_prompts()
                padded = prompts
                padded["raw_prompt_ids"] = unpadded_prompt_ids(padded)
                padded["prompt_batch"] = np.full(len(padded), index, dtype=np.int64)
                # the seeds of the step this batch is meant for (a resumed run draws the same ones)
                sampling = source.sampling_for_step(self._first_batch_index + index + 1)
                group.call_by_dp_outputs(RolloutWorker.stream_submit, padded, sampling, mesh=source.rollout_mesh)
                in_flight_batches += 1
                generated[index] = 0
                continue
            if in_flight_batches == 0:
                with self._lock:  # wait for the trainer to move on (a new version), a hold or the end
                    self._lock.wait(POLL_S)
                continue
            outs = group.call_all(RolloutWorker.stream_advance, 1, STREAM_STEPS_PER_CALL)
            finished = [out for out in outs if out is not None]
            if not finished:
                continue
            batch = _concat_groups(finished)  # replicas' rows: prompt widths may differ
            metrics = _merge_stream_metrics(finished)
            metrics.update(self._score(batch))
            groups = _split_groups(batch, None, None)
            for g in groups:
                generated[g.prompt_batch] += 1
                if generated[g.prompt_batch] == self._prompt_batches[g.prompt_batch].groups:
                    in_flight_batches -= 1
            self._publish(groups, metrics, len(batch))


# ---------------------------------------------------------------------------------------- batches
def _split_groups(batch: Batch, version: int | None, prompt_batch: int | None) -> list[_Group]:
    """A scored batch as its prompt groups (rows sharing a uid, in order). `version`: every token's
    (whole-batch generation); None: read from the rows' `token_versions`."""
    uids = [str(u) for u in batch["uid"]]
    order: dict[str, list[int]] = {}
    for row, uid in enumerate(uids):
        order.setdefault(uid, []).append(row)
    groups = []
    for rows in order.values():
        part = batch.index(rows)
        if "token_versions" not in part.tensors:
            mask = part.tensor("attention_mask")[:, part.tensor("prompts").shape[1]:]
            part["token_versions"] = torch.where(mask.bool(), torch.full_like(mask, version), torch.full_like(mask, -1))
        versions = part["token_versions"]
        real = versions[versions >= 0]
        oldest = int(real.min()) if real.numel() else (version if version is not None else 0)
        index = prompt_batch if prompt_batch is not None else int(part["prompt_batch"][0])
        groups.append(_Group(part, oldest, index))
    return groups


def _concat_groups(parts: list[Batch]) -> Batch:
    """Groups generated at different times in one batch: prompts left-padded to the widest."""
    return concat_left_padded(parts, int(parts[0].meta.get("pad_token_id", 0)))


def staleness_metrics(batch: Batch, trained_version: int) -> dict[str, float]:
    """Per sample: trained version minus the oldest version among its tokens; mean, max and a histogram
    (`async/staleness_k`: the share of samples k versions old; the last bucket counts >= 3)."""
    versions = batch["token_versions"]
    present = versions >= 0
    big = torch.iinfo(versions.dtype).max
    oldest = torch.where(present, versions, torch.full_like(versions, big)).min(-1).values
    oldest = torch.where(present.any(-1), oldest, torch.full_like(oldest, trained_version))
    staleness = (trained_version - oldest).clamp(min=0)
    out = {"async/staleness_mean": float(staleness.float().mean()), "async/staleness_max": float(staleness.max()),
           "async/weight_version": float(trained_version)}
    for k in range(4):
        share = (staleness >= k) if k == 3 else (staleness == k)
        out[f"async/staleness_{k}{'+' if k == 3 else ''}"] = float(share.float().mean())
    if "resumed" in batch.tensors:
        resumed = batch["resumed"] > 0
        out["async/partial_sample_fraction"] = float(resumed.float().mean())
        # a partial sample (paused for a sync, resumed under the new weights) carries the versions its tokens
        # were generated under: more than one, never decreasing along the response
        newest = torch.where(present, versions, torch.full_like(versions, -1)).max(-1).values
        out["async/partial_samples"] = float(resumed.sum())
        out["async/partial_samples_mixed_versions"] = float((resumed & (newest > oldest)).sum())
        both = present[:, 1:] & present[:, :-1]
        ordered = ((versions[:, 1:] >= versions[:, :-1]) | ~both).all(-1)
        out["async/token_versions_ordered_fraction"] = float(ordered.float().mean())
    return out


def _merge_generation_metrics(stats: AsyncStats) -> dict[str, float]:
    if not stats.generation_metrics:
        return {}
    return merge_part_metrics(stats.generation_metrics, stats.rows)


def _merge_stream_metrics(parts: list[Batch]) -> dict[str, float]:
    metrics = [dict(p.meta.pop("metrics", {}) or {}) for p in parts]
    return merge_part_metrics(metrics, [len(p) for p in parts], concurrent=True)
