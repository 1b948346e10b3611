"""The hybrid engine's worker: actor, reference and vLLM rollout in the same process, on every rank.

Per rank, in this order (vLLM after megatron: the engine joins the process group megatron uses):
  1. megatron actor (trainable) and, when the job needs one, the frozen reference — same layout;
  2. the vLLM `RolloutEngine` on the rollout mesh (infer_tp ranks per replica);
  3. the `Resharder` from the actor's megatron chunks to this rank's vLLM shard, and a first sync.

Every sync (after each actor update) is proven, not assumed:
  - checksums: the resharder's digest of every shard it produced must equal the digest of what vLLM
    holds afterwards, tensor by tensor (a mismatch stops training, naming tensor and rank);
  - a log-prob probe: a fixed short sequence is scored by the megatron actor and by every vLLM
    replica (each replica's TP rank 0 compares its own copy with the trainer's log-probs); the max abs
    gap over replicas is a metric every step and stops training above `probe_tolerance`.

What the checksums cover. On GPU, vLLM's parameters themselves: what serves. On CPU, vLLM packs each
linear and embedding weight for oneDNN after loading and empties the parameter, so the digest is of
the weight as vLLM's loader laid it out, captured just before that packing (`vllm_patches`); the
packing is vLLM's own transform of that verified input, and what the packed weights compute is
proven by the probe on every replica.

Methods the controller calls (all ranks at once; batches dispatched by DP): setup,
generate_sequences (rollout mesh), release_rollout_memory, sync_weights, and the inherited
compute_log_prob, compute_ref_log_prob, update_actor, save/load_checkpoint, export_hf, mesh_coords.

Memory per phase (`hybridrl.parallel.memory`): allocated/reserved before and after generation, the actor
update and the sync are recorded on every rank and returned with the sync's metrics, which the trainer
reduces to the worst rank: the figure that decides whether a step fits.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hybridrl.config.plan import Plan
from hybridrl.controller.base_worker import RankContext
from hybridrl.data.batch import Batch
from hybridrl.data.tokenizer import load_tokenizer, model_folder_pad_token_id
from hybridrl.names import Phase
from hybridrl.parallel.cpu_layer import cuda_to_cpu_mode_suspended
from hybridrl.parallel.device import default_dtype_for, release_cached_blocks
from hybridrl.parallel.memory import memory_metrics
from hybridrl.reshard.checksums import verify_checksums
from hybridrl.reshard.resharder import ReshardConfig, Resharder
from hybridrl.rollout.agent_loop import build_agent_loop
from hybridrl.rollout.engine import RolloutEngine, RolloutEngineConfig
from hybridrl.workers import faults
from hybridrl.workers.ray_roles import ActorRolloutRefWorker

# A fixed probe sequence (token ids < every supported vocab): scored after every sync by both sides.
PROBE_PROMPT = (1, 5, 9, 13, 17, 21, 25, 29)
PROBE_RESPONSE = (33, 37, 41, 45, 49, 53, 57, 61)


class WeightSyncError(RuntimeError):
    """A weight sync that could not be proven: checksums differ or the log-prob probe drifted."""


@dataclass(frozen=True)
class HybridSettings:
    probe_tolerance: float = 1e-4  # fp32 on CPU; bf16 on GPU needs a looser bound (set by the trainer)
    # The run's pad id as the trainer resolved it (`hybridrl.data.tokenizer.resolve_pad_token_id`), so
    # prompts, responses and probe rows pad alike; None (a worker built alone) resolves it the same way.
    pad_token_id: int | None = None


def _planned_kv_cache_bytes(plan: Plan) -> int:
    """CPU: the Plan's KV cache (rollout.cpu_kv_cache_gib, sized for one wave by default)."""
    memory = plan.rollout_memory
    if memory is not None and memory.on_cpu:
        return memory.kv_cache_bytes
    return RolloutEngineConfig.kv_cache_memory_bytes  # GPU (unused there) or no model shape to size it from


def _probe_batch(pad_token_id: int) -> Batch:
    prompt, response = torch.tensor([PROBE_PROMPT]), torch.tensor([PROBE_RESPONSE])
    input_ids = torch.cat([prompt, response], dim=1)
    length = input_ids.shape[1]
    return Batch({
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "position_ids": torch.arange(length).unsqueeze(0),
        "responses": response,
        "response_mask": torch.ones_like(response),
        "prompts": prompt,
    }, meta={"pad_token_id": pad_token_id})


class HybridEngineWorker(ActorRolloutRefWorker):
    """`ActorRolloutRefWorker` (megatron actor + reference) plus the vLLM rollout and the resharder."""

    def __init__(self, context: RankContext, plan: Plan, settings: HybridSettings | None = None) -> None:
        super().__init__(context, plan)
        self.settings = settings or HybridSettings()
        self.resharder = None
        self.syncs = 0
        self.phase_memory: dict[str, float] = {}  # this step's memory/* figures, handed out by sync_weights
        self.replica_probe_gaps: dict[int, float] = {}  # the last sync's probe gap per replica, by its TP-0 rank
        self.agent = None  # the agent loop, when rollout.multi_turn is enabled (built in setup)

    def _record_memory(self, phase: str) -> None:
        self.phase_memory.update(memory_metrics(phase, self.plan.resolved.device))

    # ------------------------------------------------------------------------------ bring-up
    def setup(self, total_training_steps: int | None = None) -> dict[str, Any]:
        plan = self.plan
        started = time.perf_counter()
        self.init_model(total_training_steps)
        arr = plan.config.actor_rollout_ref
        model_path = arr.model.path
        self.pad_token_id = self.settings.pad_token_id
        if self.pad_token_id is None:
            self.pad_token_id = model_folder_pad_token_id(arr.model.path, arr.model.tokenizer_path,
                                                          arr.model.trust_remote_code)
        self.attach_rollout(RolloutEngine(RolloutEngineConfig(
            model_path=model_path,
            device=plan.resolved.device,
            dtype=plan.resolved.rollout_dtype,
            infer_tp=arr.rollout.tensor_model_parallel_size,
            max_model_len=plan.resolved.max_sequence_length,
            seed=arr.rollout.seed + plan.config.trainer.seed,
            pad_token_id=self.pad_token_id,
            kv_cache_memory_bytes=_planned_kv_cache_bytes(plan),
            max_num_batched_tokens=arr.rollout.max_num_batched_tokens,
            gpu_memory_utilization=arr.rollout.gpu_memory_utilization,
            max_num_seqs=arr.rollout.max_num_seqs,
            enforce_eager=arr.rollout.enforce_eager if plan.device_policy.vllm_honours_enforce_eager else None,
            # Where vLLM repacks weights (oneDNN, on CPU): keep the as-loaded copy so the sync's
            # checksums can be read back (the probe checks the repacked weights that run).
            capture_loaded_weights=plan.device_policy.vllm_repacks_weights,
            # the Plan's HybridFlow generation TP groups (strided when training TP is a multiple
            # of inference TP), so each rank's generation shard contains its training shard
            tp_groups=plan.reshard.groups.rollout.replicas,
            # routing replay: each row carries the experts vLLM routed its tokens to (`routed_experts`)
            return_routed_experts=arr.actor.router_replay == "rollout",
        )))
        # The shard a rank must receive is that of the TP rank vLLM actually gave it; it equals
        # the Plan's (checked: a difference would mean more traffic than planned, not wrong weights).
        gathered: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(gathered, self.rollout.tp_rank)
        actual = [int(g) for g in gathered]
        self.placement_as_planned = actual == list(plan.reshard.groups.gen_tp_index)
        # Shards travel and are digested in vLLM's dtype (bf16 rollout from fp32 training: the cast
        # vLLM's loader would do, done before the digest), so the digests compare like with like.
        rollout_dtype = default_dtype_for(plan.resolved.device, plan.resolved.rollout_dtype)
        self.resharder = Resharder(self.actor.backend.chunks, plan.reshard.groups, gen_tp_index=actual,
                                   config=ReshardConfig(bucket_bytes=plan.resolved.sync_bucket_bytes,
                                                        output_dtype=rollout_dtype))
        multi_turn = arr.rollout.multi_turn
        if multi_turn.enable:
            # Observations are tokens of the policy's chat template; the tools run in this process.
            tokenizer = load_tokenizer(arr.model.tokenizer_path or arr.model.path, arr.model.trust_remote_code)
            self.agent = build_agent_loop(multi_turn, tokenizer,
                                          (*self.rollout.eos_token_ids, *arr.rollout.stop_token_ids))
        sync = self.sync_weights()
        return {"setup_s": time.perf_counter() - started, "rollout_build_s": self.rollout.build_seconds,
                "vllm_tp_rank": self.rollout.tp_rank, "placement_as_planned": self.placement_as_planned, **sync}

    def rollout_coords(self) -> dict[str, int]:
        """This rank's place on the rollout mesh: its replica (named by the replica's lowest rank;
        the controller numbers replicas densely) and its TP rank inside it."""
        return {"replica": self.rollout.replica_index, "tp": self.rollout.tp_rank}

    # ------------------------------------------------------------------------------ generation
    def generate_sequences(self, prompts: Batch, sampling: Any) -> Batch | None:
        """`prompts` carries `raw_prompt_ids` (object array of token lists) and `uid` per prompt."""
        faults.crash_point(Phase.GEN)
        faults.arm_vllm_collective_crash()
        ids = [list(map(int, p)) for p in prompts["raw_prompt_ids"]]
        uids = list(prompts["uid"]) if "uid" in prompts else None
        self._record_memory("gen_before")
        with cuda_to_cpu_mode_suspended():  # vLLM never needs megatron's CPU device translation
            if self.agent is not None:  # rollout.multi_turn: conversations with tool calls
                out = self.rollout.generate_multi_turn(ids, sampling, self.agent, uids=uids,
                                                       rows=tool_sample_rows(prompts))
            else:
                out = self.rollout.generate_sequences(ids, sampling, uids=uids)
        self._record_memory("gen_after")
        # Replicas pad to their own longest prompt; the controller concatenates them, so every
        # replica pads to the width of the batch it was cut from.
        out = left_pad_prompts(out, prompts["input_ids"].shape[1], self.pad_token_id)
        # Carry each prompt's metadata (ground truth, data source, ...) onto its n samples.
        rows = out["prompt_index"]
        for key in prompts.non_tensors:
            if key not in ("raw_prompt_ids", "uid") and key not in out.non_tensors:
                out[key] = prompts[key][rows]
        return out if self.rollout.tp_rank == 0 else None

    def release_rollout_memory(self) -> None:
        """After generation: vLLM sleeps while training runs, KV cache and weights freed.

        Level 2 discards the weights instead of copying them to host and back (level 1): the next
        sync rewrites every parameter, and vLLM keeps its buffers (rotary caches) across level 2.
        """
        self.rollout.sleep(level=2)

    def update_actor(self, batch: Batch) -> dict[str, float] | None:
        self._record_memory("update_before")
        metrics = super().update_actor(batch)
        self._record_memory("update_after")
        return None if metrics is None else metrics.as_dict()

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """Restore the actor, then sync the restored weights into vLLM (proven like every sync)."""
        super().load_checkpoint(path)
        return self.sync_weights()

    # ------------------------------------------------------------------------------ weight sync
    def sync_weights(self) -> dict[str, float]:
        """Reshard the actor into vLLM, then prove it (checksums + log-prob probe)."""
        faults.crash_point(Phase.SYNC)
        started = time.perf_counter()
        self._record_memory("sync_before")
        # GPU with sleep mode, in the order that frees memory first (the actor's grads and Adam states
        # left at the end of its update, when offloaded): weights back (the sync writes into them),
        # the resharder's buckets returned to the driver, then the KV cache. No-ops on CPU.
        self.rollout.wake_up(tags=["weights"])
        self.rollout.update_weights(self.resharder.shards(), weight_format="vllm_shard")
        release_cached_blocks(self.plan.resolved.device)
        self.rollout.wake_up(tags=["kv_cache"])
        report = self.resharder.last_report
        held = self.rollout.parameter_digests()
        try:
            verify_checksums(report.checksums, held, self.rank, ignore_extra=True)
        except Exception as exc:  # the error names tensors and rank; keep its type for the controller
            raise WeightSyncError(f"sync {self.syncs}: {exc}") from exc
        self.syncs += 1
        gap = self.prove_by_probe()
        metrics = report.as_metrics()
        metrics.update({"reshard/probe_max_abs_gap": gap, "reshard/probe_replicas": float(len(self.replica_probe_gaps)),
                        "timing_s/sync_total": time.perf_counter() - started})
        self._record_memory("sync_after")
        metrics.update(self.phase_memory)
        self.phase_memory = {}
        return metrics

    def _probe_gap(self) -> float:
        """Max |megatron log-prob - vLLM log-prob| over the probe's response tokens, over every replica.

        The trainer's log-probs (computed on its output ranks) go to every rank; each replica's TP
        rank 0 compares them with what its own vLLM copy computes, so every copy that serves is
        proven, not only the one in the output rank's process. Every rank returns the same value;
        the per-replica gaps stay in `replica_probe_gaps` (`prove_by_probe` judges them).
        """
        probe = _probe_batch(self.pad_token_id)
        # every rank of the actor must run the forward (pipeline schedule is collective), and every
        # TP peer of a replica must score the prompt (vLLM's TP forward is collective)
        # With routing replay the probe still routes freely: it proves the weights (router included)
        # on a sequence no rollout generated, so there is no vLLM routing to replay.
        trained = self.actor.compute_log_prob(probe.select(list(probe.tensors)), free_routing=True)
        rollout = self.rollout.prompt_log_probs(list(PROBE_PROMPT + PROBE_RESPONSE))
        local = None if trained is None else trained["old_log_probs"][0].tolist()
        everyone: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(everyone, local)
        ours = torch.tensor(next(t for t in everyone if t is not None), dtype=torch.float64)
        gap = None
        if self.rollout.tp_rank == 0:
            theirs = torch.tensor(rollout[len(PROBE_PROMPT):], dtype=torch.float64)
            gap = float((ours - theirs).abs().max())
        gaps: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(gaps, gap)
        self.replica_probe_gaps = {rank: g for rank, g in enumerate(gaps) if g is not None}
        return max(self.replica_probe_gaps.values())

    def prove_by_probe(self) -> float:
        """The probe gap over every replica; raises `WeightSyncError` naming the worst one above tolerance."""
        gap = self._probe_gap()
        if gap > self.settings.probe_tolerance:
            worst = max(self.replica_probe_gaps, key=self.replica_probe_gaps.__getitem__)
            each = ", ".join(f"rank {r}: {g:.3g}" for r, g in sorted(self.replica_probe_gaps.items()))
            raise WeightSyncError(
                f"sync {self.syncs}: log-prob probe gap {gap:.3g} between megatron and the vLLM replica "
                f"led by rank {worst} exceeds {self.settings.probe_tolerance:g} (per replica: {each})"
            )
        return gap


def left_pad_prompts(batch: Batch, width: int, pad_token_id: int) -> Batch:
    """Widen the prompt part of a rollout batch to `width` columns of left padding."""
    extra = width - batch["prompts"].shape[1]
    if extra <= 0:
        return batch
    rows = len(batch)

    def widen(name: str, fill: int) -> None:
        column = batch[name]
        pad = torch.full((rows, extra, *column.shape[2:]), fill, dtype=column.dtype)
        batch[name] = torch.cat([pad, column], dim=1)

    widen("prompts", pad_token_id)
    widen("input_ids", pad_token_id)
    widen("attention_mask", 0)
    widen("position_ids", 0)
    if "routed_experts" in batch.tensors:  # routing replay: aligned with input_ids, -1 = routed nothing
        widen("routed_experts", -1)
    return batch


# The prompt columns a tool that reads its calling sample gets (`hybridrl.tools.SAMPLE_PARAMETER`).
TOOL_SAMPLE_COLUMNS = ("index", "uid", "data_source", "ground_truth", "extra_info")


def tool_sample_rows(prompts: Batch) -> list[dict[str, Any]]:
    """Per prompt, its data row for the tools: the `TOOL_SAMPLE_COLUMNS` the batch carries."""
    columns = [c for c in TOOL_SAMPLE_COLUMNS if c in prompts.non_tensors]
    def plain(value: Any) -> Any:  # numpy scalars as Python values: tools are user code
        return value.item() if isinstance(value, np.generic) else value

    return [{c: plain(prompts[c][i]) for c in columns} for i in range(len(prompts))]
