"""The policy's training processes as the trainer drives them, whichever way the rollout is placed.

    PolicyWorker               actor + reference (`ActorRolloutRefWorker`), plus what every step needs of
                               them beside the math: memory per phase, the update's metrics as a dict, the
                               weight probe's trainer-side log-probs
    DisaggregatedPolicyWorker  a PolicyWorker on the trainer pool of `rollout.mode: disaggregated`: it
                               sends its weights across the pools (`reshard.cross_pool`) to the
                               `RolloutWorker`s after each update (with `lora.merge: false`, the base
                               once and then its adapter alone: `reshard.adapter_sync`)

`HybridEngineWorker` (`workers/hybrid.py`) is the other PolicyWorker: vLLM in the same processes.
The trainer calls the training methods through `PolicyWorker` (`PolicyWorker.update_actor`), which
both groups' classes inherit unchanged.
"""
from __future__ import annotations

import time
from typing import Any

import ray
import torch

from hybridrl.config.plan import Plan
from hybridrl.controller.base_worker import RankContext
from hybridrl.data.batch import Batch
from hybridrl.data.tokenizer import model_folder_pad_token_id
from hybridrl.models.lora import lora_adapters, peft_adapter_files
from hybridrl.names import Phase
from hybridrl.parallel.cross_group import CrossGroup, CrossGroupAddress, open_store
from hybridrl.parallel.device import default_dtype_for, rank_device
from hybridrl.parallel.memory import memory_metrics
from hybridrl.reshard.adapter_sync import ShippedAdapter, gather_whole_adapters, send_adapter, served_adapter_digests
from hybridrl.reshard.cross_pool import CrossPoolSender
from hybridrl.training.actor import PolicyUpdateMetrics
from hybridrl.workers import faults
from hybridrl.workers.probe import RARE_TOKEN_PROBE, ProbeSequence, probe_batch
from hybridrl.workers.ray_roles import ActorRolloutRefWorker
from hybridrl.workers.rollout_worker import cross_pool_layout


class PolicyWorker(ActorRolloutRefWorker):
    """Actor + reference with per-phase memory figures and the probe's trainer side."""

    def __init__(self, context: RankContext, plan: Plan, pad_token_id: int | None = None) -> None:
        super().__init__(context, plan)
        self.pad_token_id = pad_token_id  # the run's pad id (None: resolved from the model folder at set-up)
        self.phase_memory: dict[str, float] = {}  # this step's memory/* figures, handed out with the sync's

    def _resolve_pad_token_id(self) -> None:
        if self.pad_token_id is None:
            model = self.plan.config.actor_rollout_ref.model
            self.pad_token_id = model_folder_pad_token_id(model.path, model.tokenizer_path, model.trust_remote_code)

    def _record_memory(self, phase: str) -> None:
        self.phase_memory.update(memory_metrics(phase, self.plan.resolved.device))

    def take_phase_memory(self) -> dict[str, float]:
        figures, self.phase_memory = self.phase_memory, {}
        return figures

    def update_actor(self, batch: Batch) -> PolicyUpdateMetrics | None:
        self._record_memory("update_before")
        metrics = super().update_actor(batch)
        self._record_memory("update_after")
        return metrics

    def _whole_adapter(self) -> tuple[ShippedAdapter, int]:
        """The actor's whole adapter on every rank (collective over the actor's world: `gather_whole_adapters`) as
        what vLLM is given: the PEFT folder's files and the digests vLLM must hold once it serves them (in the
        rollout's dtype, alpha / rank folded into B); and the bytes this rank received to have it whole."""
        backend = self._built_actor().backend
        settings = self._require(backend.spec.lora, "the actor's LoRA settings")
        sync = gather_whole_adapters(lora_adapters(backend.chunks), backend.ctx)
        dtype = default_dtype_for(self.plan.resolved.device, self.plan.resolved.rollout_dtype)
        files = peft_adapter_files(sync.state, settings, base_model=self.plan.config.actor_rollout_ref.model.path)
        digests = served_adapter_digests(sync.state, settings.scaling, dtype)
        return ShippedAdapter(files, digests, sync.adapter_bytes), sync.bytes_received

    def probe_log_probs(self, sequence: ProbeSequence = RARE_TOKEN_PROBE) -> list[float]:
        """The actor's log-probs of the weight probe's response (`workers.probe`), on every rank.
        Collective over the actor's ranks (the pipeline schedule is)."""
        probe = probe_batch(sequence, self.pad_token_id)
        # With routing replay the probe still routes freely: it proves the weights (router included)
        # on a sequence no rollout generated, so there is no vLLM routing to replay.
        trained = self._ready_actor().compute_log_prob(probe.select(list(probe.tensors)), free_routing=True)
        local = None if trained is None else trained["old_log_probs"][0].tolist()
        everyone: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(everyone, local)
        return next(t for t in everyone if t is not None)


class DisaggregatedPolicyWorker(PolicyWorker):
    """The trainer pool's policy rank: trains, and sends its weights to the rollout pool."""

    def __init__(self, context: RankContext, plan: Plan, pad_token_id: int | None = None) -> None:
        super().__init__(context, plan, pad_token_id)
        self.sender: CrossPoolSender | None = None
        self._store: Any = None
        self.version = 0  # weight versions sent so far (0: the model folder's)
        self.base_sent = False  # lora.merge false: the frozen base crosses once, then the adapter alone

    def setup(self, total_training_steps: int | None = None) -> dict[str, Any]:
        started = time.perf_counter()
        self.init_model(total_training_steps)
        self._resolve_pad_token_id()
        return {"setup_s": time.perf_counter() - started}

    def open_weight_sync(self) -> tuple[str, int] | None:
        """Rank 0: open the cross-pool group's store on a free port of this node; (host, port)."""
        if self.rank != 0:
            return None
        host = ray.util.get_node_ip_address()
        size = self.plan.resolved.total_ranks  # the cross-pool group: every trainer and rollout rank
        self._store = open_store(host, size, self.plan.config.trainer.nccl_timeout_s)
        return host, int(self._store.port)

    def join_weight_sync(self, address: CrossGroupAddress) -> None:
        """Join the cross-pool group (with every rollout rank at once) and plan this rank's sends."""
        group = CrossGroup(address, address.member_of_trainer(self.rank), self.plan.device_policy.dist_backend,
                           self.plan.config.trainer.nccl_timeout_s, store=self._store)
        plan = self.plan
        self.sender = CrossPoolSender(
            self._built_actor().backend.chunks, cross_pool_layout(plan), group, rank=self.rank,
            dtype=default_dtype_for(plan.resolved.device, plan.resolved.rollout_dtype),
            bucket_bytes=plan.resolved.sync_bucket_bytes, keep_buffers=plan.device_policy.reshard_keeps_buffers,
            merge_adapters=not plan.resolved.serves_adapters)

    def send_weights(self, version: int) -> dict[str, Any]:
        """Send this rank's share of the weights (collective with every rollout rank's
        `receive_weights`), then score the probe; the sync's figures, memory, and the probe's log-probs."""
        faults.crash_point(Phase.SYNC)
        if self.sender is None:
            raise RuntimeError(f"trainer rank {self.rank}: join_weight_sync was not called")
        started = time.perf_counter()
        self._record_memory("sync_before")
        metrics: dict[str, float] = {}
        if not self.base_sent:
            metrics.update(self.sender.send().as_metrics("reshard/trainer_"))
            self.base_sent = self.plan.resolved.serves_adapters  # merged weights cross at every sync
        if self.plan.resolved.serves_adapters:
            metrics.update(self._send_adapter(self.sender.group))
        self.version = version
        metrics["timing_s/sync_send"] = time.perf_counter() - started
        probe = self.probe_log_probs()
        self._record_memory("sync_after")
        metrics.update(self.take_phase_memory())
        return {"metrics": metrics, "probe": probe}

    def _send_adapter(self, group: CrossGroup) -> dict[str, float]:
        """The actor's whole adapter as a PEFT folder to the rollout ranks this rank serves (`send_adapter`)."""
        adapter, _ = self._whole_adapter()
        sent = send_adapter(group, adapter, rank=self.rank, device=rank_device(self.plan.resolved.device))
        return {"reshard/trainer_adapter_bytes_sent": float(sent),
                "reshard/adapter_bytes": float(adapter.adapter_bytes)}
