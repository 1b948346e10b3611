"""The colocated policy worker (`rollout.mode: colocated`, verl's "hybrid engine"): actor, reference and vLLM rollout
in the same process, on every rank.

Per rank, in this order (vLLM after megatron: the engine joins the process group megatron uses):
  1. megatron actor (trainable) and, when the job needs one, the frozen reference — same layout;
  2. the vLLM `RolloutEngine` on the rollout mesh (infer_tp ranks per replica);
  3. the `Resharder` from the actor's megatron chunks to this rank's vLLM shard, and a first sync.

A LoRA actor with `lora.merge: false`: vLLM serves the adapters itself; the resharder writes the frozen base by
the first sync alone and every sync loads the current adapter (`reshard.adapter_sync`), proven by the digests of
what vLLM's LoRA manager loaded and by the same probe.

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

import torch

from hybridrl.config.plan import Plan
from hybridrl.controller.base_worker import RankContext
from hybridrl.data.batch import Batch
from hybridrl.names import Phase, Role
from hybridrl.parallel.device import default_dtype_for
from hybridrl.reshard.checksums import verify_checksums
from hybridrl.reshard.resharder import ReshardConfig, Resharder
from hybridrl.rollout.agent_loop import AgentLoop
from hybridrl.rollout.engine import RolloutEngine
from hybridrl.rollout.sampling import RolloutSampling
from hybridrl.workers import faults
from hybridrl.workers.generation import agent_loop_for, engine_config, generate_rows
from hybridrl.workers.policy import PolicyWorker
from hybridrl.workers.probe import RARE_TOKEN_PROBE, ProbeSequence, WeightSyncError, probe_gap_of
from hybridrl.workers.served_adapter import ServedAdapters


@dataclass(frozen=True)
class ColocatedSettings:
    probe_tolerance: float = 1e-4  # fp32 on CPU; bf16 on GPU needs a looser bound (set by the trainer)
    # The run's pad id as the trainer resolved it (`hybridrl.data.tokenizer.resolve_pad_token_id`), so
    # prompts, responses and probe rows pad alike; None (a worker built alone) resolves it the same way.
    pad_token_id: int | None = None


class ColocatedPolicyWorker(PolicyWorker):
    """`PolicyWorker` (megatron actor + reference) plus the vLLM rollout and the resharder."""

    def __init__(self, context: RankContext, plan: Plan, settings: ColocatedSettings | None = None) -> None:
        settings = settings or ColocatedSettings()
        super().__init__(context, plan, settings.pad_token_id)
        self.settings = settings
        self.rollout: RolloutEngine | None = None  # vLLM in this process (built in setup, kept for its life)
        self.resharder: Resharder | None = None
        self.syncs = 0
        self.replica_probe_gaps: dict[int, float] = {}  # the last sync's probe gap per replica, by its TP-0 rank
        self.agent: AgentLoop | None = None  # the agent loop, when rollout.multi_turn is enabled (built in setup)
        self.probe: ProbeSequence = RARE_TOKEN_PROBE  # what every sync scores (bench/probe_gap.py swaps it)
        # lora.merge false: vLLM serves the adapters; its base weights are written by the first sync alone
        self.served_adapters: ServedAdapters | None = None
        self.base_in_vllm = False

    # the parts `setup` builds, for the calls that come after it
    def _engine(self) -> RolloutEngine:
        return self._require(self.rollout, "the rollout engine")

    def _built_resharder(self) -> Resharder:
        return self._require(self.resharder, "the resharder")

    # ------------------------------------------------------------------------------ bring-up
    def setup(self, total_training_steps: int | None = None) -> dict[str, Any]:
        plan = self.plan
        started = time.perf_counter()
        self.init_model(total_training_steps)
        # vLLM checks at build that gpu_memory_utilization x the GPU is free: what the actor offloads
        # between its updates (grad_offload, optimizer_offload) leaves before it, not after the first update
        self._built_actor().backend.offload_training_state()
        self._actor_params_out()  # megatron.param_offload: vLLM builds with the actor's weights on the host
        # vLLM builds on dummy weights (reads nothing from the model folder): the first sync below writes every
        # parameter it holds before anything is generated, checked by `_sync_base`'s digests and the probe
        self.rollout = RolloutEngine(engine_config(plan, self._resolve_pad_token_id(), load_format="dummy"))
        # The shard a rank must receive is that of the TP rank vLLM actually gave it; it equals
        # the Plan's (checked: a difference would mean more traffic than planned, not wrong weights).
        gathered: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(gathered, self._engine().tp_rank)
        actual = [int(g) for g in gathered]
        self.placement_as_planned = actual == list(plan.reshard.groups.gen_tp_index)
        # Shards travel and are digested in vLLM's dtype (bf16 rollout from fp32 training: the cast
        # vLLM's loader would do, done before the digest), so the digests compare like with like.
        rollout_dtype = default_dtype_for(plan.resolved.device, plan.resolved.rollout_dtype)
        self.resharder = Resharder(self._built_actor().backend.chunks, plan.reshard.groups, gen_tp_index=actual,
                                   config=ReshardConfig(bucket_bytes=plan.resolved.sync_bucket_bytes,
                                                        output_dtype=rollout_dtype,
                                                        keep_buffers=plan.device_policy.reshard_keeps_buffers,
                                                        merge_adapters=not plan.resolved.serves_adapters))
        if plan.resolved.serves_adapters:  # this rank's folder for the adapter vLLM loads at each sync
            self.served_adapters = ServedAdapters(self.rank)
        self.agent = agent_loop_for(plan, self._engine())
        sync = self.sync_weights()
        return {"setup_s": time.perf_counter() - started, "rollout_build_s": self._engine().build_seconds,
                "vllm_tp_rank": self._engine().tp_rank, "placement_as_planned": self.placement_as_planned, **sync}

    def rollout_coords(self) -> dict[str, int]:
        """This rank's place on the rollout mesh: its replica (named by the replica's lowest rank;
        the controller numbers replicas densely) and its TP rank inside it."""
        return {"replica": self._engine().replica_index, "tp": self._engine().tp_rank}

    # ------------------------------------------------------------------------------ generation
    def generate_sequences(self, prompts: Batch, sampling: RolloutSampling) -> Batch | None:
        """`prompts` carries `raw_prompt_ids` (object array of token lists) and `uid` per prompt."""
        return generate_rows(self._engine(), self.agent, prompts, sampling, self._resolve_pad_token_id(),
                             self.plan.resolved.device, self.phase_memory)

    def release_rollout_memory(self) -> None:
        """After generation: vLLM sleeps while training runs, KV cache and weights freed.

        Level 2 discards the weights instead of copying them to host and back (level 1): the next
        sync rewrites every parameter, and vLLM keeps its buffers (rotary caches) across level 2. With
        adapters served (lora.merge false) a sync writes the adapters alone, so the base weights are kept (level 1).
        """
        self._engine().sleep(level=1 if self.plan.resolved.serves_adapters else 2)

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
        self._built_actor().backend.load_params()  # the resharder reads them (back from the host with param_offload)
        # GPU with sleep mode, in the order that frees memory first (the actor's grads and Adam states
        # left at the end of its update, when offloaded): weights back (the sync writes into them),
        # the resharder's buckets returned to the driver, then the KV cache. No-ops on CPU.
        self._engine().wake_up(tags=["weights"])
        metrics = {} if self.base_in_vllm else self._sync_base()
        self._release()
        self._engine().wake_up(tags=["kv_cache"])
        if self.served_adapters is not None:
            metrics.update(self._sync_adapter(self.served_adapters))
        self.syncs += 1
        proving = time.perf_counter()
        gap = self.prove_by_probe()
        finished = time.perf_counter()
        metrics.update({"reshard/probe_max_abs_gap": gap, "reshard/probe_replicas": float(len(self.replica_probe_gaps)),
                        "timing_s/sync_probe": finished - proving, "timing_s/sync_total": finished - started})
        self._actor_params_out()  # idle until the next log-prob pass or update (with param_offload)
        self._record_memory("sync_after")
        metrics.update(self.take_phase_memory())
        return metrics

    def _sync_base(self) -> dict[str, float]:
        """The resharder's sync of the actor's weights (adapters merged, or the frozen base once when vLLM serves
        the adapters), proven by the digests of what vLLM holds."""
        engine, resharder = self._engine(), self._built_resharder()
        engine.update_weights(resharder.shards(), weight_format="vllm_shard")
        report = resharder.finished_report()
        held = engine.parameter_digests()
        try:
            # every parameter vLLM holds: it was built on dummy weights, so one the sync left out would serve random
            # values (and after a level-2 sleep on GPU any vLLM weight is the sync's alone anyway)
            verify_checksums(report.checksums, held, self.rank)
        except Exception as exc:  # the error names tensors and rank; keep its type for the controller
            raise WeightSyncError(f"sync {self.syncs}: {exc}") from exc
        self.base_in_vllm = self.plan.resolved.serves_adapters  # a merged sync rewrites the weights every time
        return report.as_metrics()

    def _sync_adapter(self, served: ServedAdapters) -> dict[str, float]:
        """vLLM serves the actor's current adapters (`reshard.adapter_sync`), proven by the digests of what its
        LoRA manager loaded."""
        started = time.perf_counter()
        adapter, received = self._whole_adapter()
        served.serve(self._engine(), adapter, f"sync {self.syncs}")
        return {"reshard/adapter_bytes": float(adapter.adapter_bytes),
                "reshard/adapter_bytes_received": float(received),
                "timing_s/sync_adapter": time.perf_counter() - started}

    def _actor_params_out(self) -> None:
        """megatron.param_offload on the actor: its parameters wait on the host while vLLM generates; every call
        that reads them reloads them first (`_ready_actor`, `sync_weights`). Frees the cached blocks for vLLM."""
        if self.plan.layout(Role.ACTOR).megatron.param_offload:
            self._built_actor().backend.offload_params()
        self._release()

    def _probe_gap(self) -> float:
        """Max |megatron log-prob - vLLM log-prob| over the probe's response tokens, over every replica.

        The trainer's log-probs (computed on its output ranks) go to every rank; each replica's TP
        rank 0 compares them with what its own vLLM copy computes, so every copy that serves is
        proven, not only the one in the output rank's process. Every rank returns the same value;
        the per-replica gaps stay in `replica_probe_gaps` (`prove_by_probe` judges them).
        """
        # every rank of the actor must run the forward (pipeline schedule is collective), and every
        # TP peer of a replica must score the prompt (vLLM's TP forward is collective)
        gap = probe_gap_of(self._engine(), self.probe_log_probs(self.probe), self.probe)
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
