"""The disaggregated rollout's worker: a vLLM engine on a rank of the rollout pool, nothing else.

`rollout.mode: disaggregated` puts vLLM on ranks of its own (`rollout.nnodes` × `n_gpus_per_node`),
apart from the trainer's. Each rank of this group holds one vLLM TP shard (the pool's replicas are
consecutive ranks, `config.meshes.build_pool_groups`) and no megatron model. Weights arrive over the
cross-pool group (`parallel.cross_group`) from the training ranks that hold them
(`reshard.cross_pool`), and every sync is proven as in the colocated policy: the digest of each tensor
received must equal what vLLM then holds, and each replica's log-probs of the weight probe must match
the trainer's (`workers.probe`). With a LoRA actor whose adapters vLLM serves (`lora.merge: false`) the first
sync brings the frozen base and every sync the current adapter, a PEFT folder shipped by one training rank
(`reshard.adapter_sync`), loaded as a new adapter id and proven by the digests the trainer computed of it.

Methods the controller calls (all ranks at once): setup, rollout_coords, join_weight_sync,
receive_weights, probe_gap, generate_sequences (rollout mesh), and the streaming calls of
`rollout.async_mode: fully_async` (stream_submit, stream_advance, stream_pause, stream_resume).
"""
from __future__ import annotations

import time
from typing import Any

import torch

from hybridrl.config.plan import Plan
from hybridrl.controller.base_worker import RankContext, Worker
from hybridrl.data.batch import Batch
from hybridrl.names import Phase, Role
from hybridrl.parallel.cross_group import CrossGroup, CrossGroupAddress
from hybridrl.parallel.device import default_dtype_for, release_cached_blocks, vllm_device
from hybridrl.reshard.adapter_sync import receive_adapter
from hybridrl.reshard.checksums import verify_checksums
from hybridrl.reshard.cross_pool import CrossPoolReceiver
from hybridrl.reshard.cross_pool_plan import CrossPoolLayout
from hybridrl.rollout.agent_loop import AgentLoop
from hybridrl.rollout.continuous import ContinuousGeneration
from hybridrl.rollout.engine import RolloutEngine
from hybridrl.rollout.sampling import RolloutSampling
from hybridrl.workers import faults
from hybridrl.workers.generation import (
    agent_loop_for,
    carry_prompt_columns,
    concat_left_padded,
    engine_config,
    generate_rows,
)
from hybridrl.workers.probe import WeightSyncError, probe_gap_of
from hybridrl.workers.served_adapter import ServedAdapters


def cross_pool_layout(plan: Plan) -> CrossPoolLayout:
    """Both pools of this run as the cross-pool plan sees them (the same on every member)."""
    actor = plan.layout(Role.ACTOR)
    return CrossPoolLayout(actor.mesh, plan.resolved.rollout_world,
                           plan.config.actor_rollout_ref.rollout.tensor_model_parallel_size,
                           ep=actor.megatron.expert_model_parallel_size)


class RolloutWorker(Worker):
    """One rank of the rollout pool: its vLLM engine, its side of the weight sync, its generation."""

    def __init__(self, context: RankContext, plan: Plan, pad_token_id: int) -> None:
        super().__init__(context)
        self.plan = plan
        self.pad_token_id = pad_token_id
        self.rollout: RolloutEngine | None = None
        self.agent: AgentLoop | None = None
        self.receiver: CrossPoolReceiver | None = None
        self._loader_digests: dict[str, str] | None = None
        self.stream: ContinuousGeneration | None = None
        self.version = 0  # the policy version vLLM serves (0: the model folder's weights)
        self.phase_memory: dict[str, float] = {}
        # lora.merge false: where the adapters vLLM serves are written; whether the frozen base is in vLLM yet
        self.served_adapters = ServedAdapters(self.rank) if plan.resolved.serves_adapters else None
        self.base_received = False

    # the parts `setup` builds, for the calls that come after it
    def _engine(self) -> RolloutEngine:
        return self._require(self.rollout, "the rollout engine")

    def _stream(self) -> ContinuousGeneration:
        return self._require(self.stream, "the generation stream")

    def setup(self) -> dict[str, Any]:
        started = time.perf_counter()
        self.use_torch_threads(self.plan.config.trainer.torch_threads_per_rank)
        # vLLM's own loader reads the model folder: the first sync is checked against what it made of it
        self.rollout = RolloutEngine(engine_config(self.plan, self.pad_token_id, load_format="auto"))
        self.agent = agent_loop_for(self.plan, self._engine())
        self.stream = ContinuousGeneration(self._engine())
        # what vLLM's own loader made of the model folder: the first sync (the trainer's weights as
        # loaded from the same folder) must equal it tensor by tensor
        self._loader_digests = self._engine().parameter_digests()
        return {"setup_s": time.perf_counter() - started, "rollout_build_s": self._engine().build_seconds,
                "vllm_tp_rank": self._engine().tp_rank}

    def rollout_coords(self) -> dict[str, int]:
        """This rank's replica (named by its lowest pool rank) and its TP rank inside it."""
        return {"replica": self._engine().replica_index, "tp": self._engine().tp_rank}

    # ------------------------------------------------------------------------------ weight sync
    def join_weight_sync(self, address: CrossGroupAddress) -> None:
        """Join the cross-pool group (all members at once) and plan this rank's side of every sync."""
        group = CrossGroup(address, address.member_of_rollout(self.rank), self.plan.device_policy.dist_backend,
                           self.plan.config.trainer.nccl_timeout_s)
        if self.plan.model is None:  # a plan built without the model folder (plan --layout-only) trains nothing
            raise RuntimeError("the cross-pool weight sync needs the model's shape: the plan has none")
        self.receiver = CrossPoolReceiver(
            self.plan.model, cross_pool_layout(self.plan), group, rollout_rank=self.rank,
            dtype=default_dtype_for(self.plan.resolved.device, self.plan.resolved.rollout_dtype),
            device=vllm_device(self.plan.resolved.device),
            bucket_bytes=self.plan.resolved.sync_bucket_bytes,
            keep_buffers=self.plan.device_policy.reshard_keeps_buffers)

    def receive_weights(self, version: int) -> dict[str, float]:
        """This rank's vLLM shard from the training ranks, written into vLLM and checked tensor by
        tensor (collective with the trainer pool's `send_weights`)."""
        faults.crash_point(Phase.SYNC)
        if self.receiver is None:
            raise RuntimeError(f"rollout rank {self.rank}: join_weight_sync was not called")
        started = time.perf_counter()
        metrics: dict[str, float] = {}
        if not self.base_received:
            metrics.update(self._receive_base(version))
            self.base_received = self.served_adapters is not None  # merged weights cross at every sync
        if self.served_adapters is not None:
            metrics.update(self._receive_adapter(self.served_adapters, version))
        self.version = version
        return {**metrics, "timing_s/sync_receive": time.perf_counter() - started}

    def _receive_base(self, version: int) -> dict[str, float]:
        """The cross-pool sync of the weights (the adapters merged in, or the frozen base once when vLLM serves
        them), proven by the digests of what vLLM holds; the first also against what vLLM's own loader made of the
        model folder."""
        receiver = self._require(self.receiver, "the cross-pool receiver")
        self._engine().wake_up(tags=["weights"])
        self._engine().update_weights(receiver.shards(), weight_format="vllm_shard")
        release_cached_blocks(self.plan.resolved.device)
        self._engine().wake_up(tags=["kv_cache"])
        report = receiver.finished_report()
        try:
            if self._loader_digests is not None:  # the first sync: the folder's weights, laid out by us
                verify_checksums(report.checksums, self._loader_digests, self.rank, ignore_extra=True)
                self._loader_digests = None
            verify_checksums(report.checksums, self._engine().parameter_digests(), self.rank, ignore_extra=True)
        except Exception as exc:  # the error names tensors and rank; keep its type for the controller
            raise WeightSyncError(f"sync to version {version}: {exc}") from exc
        return report.as_metrics("reshard/rollout_")

    def _receive_adapter(self, served: ServedAdapters, version: int) -> dict[str, float]:
        """The actor's adapter from the training rank that ships it, served by vLLM from now on and proven."""
        receiver = self._require(self.receiver, "the cross-pool receiver")
        adapter, received = receive_adapter(receiver.group, rollout_rank=self.rank, device=receiver.device)
        served.serve(self._engine(), adapter, f"sync to version {version}")
        return {"reshard/rollout_adapter_bytes_received": float(received),
                "reshard/adapter_bytes": float(adapter.adapter_bytes)}

    def probe_gap(self, trainer_log_probs: list[float], tolerance: float) -> float | None:
        """This replica's probe gap against the trainer's log-probs (TP rank 0; None elsewhere); raises
        `WeightSyncError` above `tolerance`."""
        gap = probe_gap_of(self.rollout, trainer_log_probs)
        if gap is not None and gap > tolerance:
            raise WeightSyncError(f"version {self.version}: log-prob probe gap {gap:.3g} between megatron and the "
                                  f"vLLM replica led by rollout rank {self.rank} exceeds {tolerance:g}")
        return gap

    # ------------------------------------------------------------------------------ generation
    def generate_sequences(self, prompts: Batch, sampling: RolloutSampling) -> Batch | None:
        """Whole-batch generation of this replica's chunk (as the colocated policy's)."""
        out = generate_rows(self._engine(), self.agent, prompts, sampling, self.pad_token_id,
                            self.plan.resolved.device, self.phase_memory)
        if out is not None:
            out["policy_version"] = torch.full((len(out),), self.version, dtype=torch.long)
        return out

    # ------------------------------------------------------------------------- fully_async streaming
    def stream_submit(self, prompts: Batch, sampling: RolloutSampling) -> int:
        """Start `sampling.n` samples of each prompt of this replica's chunk; returns the samples in flight."""
        ids = [list(map(int, p)) for p in prompts["raw_prompt_ids"]]
        self._stream().submit(ids, list(prompts["uid"]), sampling, prompts)
        return self._stream().in_flight

    def stream_advance(self, min_groups: int, max_steps: int) -> Batch | None:
        """Run vLLM until `min_groups` prompts have all their samples (or `max_steps` engine steps, or
        nothing is left in flight); the finished groups' rows (TP rank 0; None elsewhere)."""
        faults.crash_point(Phase.GEN)
        groups = self._stream().advance(self.version, min_groups=min_groups, max_steps=max_steps)
        if self._engine().tp_rank != 0 or not groups:
            return None
        rows = [carry_prompt_columns(batch, prompts, self.pad_token_id) for batch, prompts in groups]
        # groups of different prompt batches finish in one call: their prompt widths may differ
        return concat_left_padded(rows, self.pad_token_id)

    def stream_pause(self) -> int:
        """Stop every request in flight, keeping what it generated (a partial rollout); returns how many."""
        return self._stream().pause()

    def stream_resume(self) -> int:
        """Continue the paused requests under the weights now served; returns how many."""
        return self._stream().resume()

    def stream_state(self) -> dict[str, int]:
        return {"in_flight": self._stream().in_flight, "paused": self._stream().paused, "version": self.version}
