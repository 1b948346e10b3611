"""The policy's training processes as the trainer drives them, whichever way the rollout is placed.

    PolicyWorker               the actor and (when the job has one) the reference in the same processes, at the
                               same layout: log-prob passes, the update, checkpoints, export, the weight probe's
                               trainer side and memory per phase
    DisaggregatedPolicyWorker  a PolicyWorker on the trainer pool of `rollout.mode: disaggregated`: it
                               sends its weights across the pools (`reshard.cross_pool`) to the
                               `RolloutWorker`s after each update (with `lora.merge: false`, the base
                               once and then its adapter alone: `reshard.adapter_sync`)

`ColocatedPolicyWorker` (`workers/colocated.py`) is the other PolicyWorker: vLLM in the same processes.
The trainer calls the training methods through `PolicyWorker` (`PolicyWorker.update_actor`), which
both groups' classes inherit unchanged.

Methods taking a `Batch` expect this DP rank's chunk (the controller's `dispatch_by_dp`) and return results only on
the output ranks (last pipeline stage, TP rank 0), None elsewhere.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import ray
import torch

from hybridrl.config.plan import Plan
from hybridrl.controller.base_worker import RankContext, Worker
from hybridrl.controller.dispatch import MeshCoord
from hybridrl.data.batch import Batch
from hybridrl.data.tokenizer import model_folder_pad_token_id
from hybridrl.models.bridge import export_hf
from hybridrl.models.lora import PeftMerge, adapters_disabled, lora_adapters, peft_adapter_files
from hybridrl.names import Phase, Role
from hybridrl.parallel.cross_group import CrossGroup, CrossGroupAddress, open_store
from hybridrl.parallel.device import default_dtype_for, rank_device, release_cached_blocks
from hybridrl.parallel.memory import memory_metrics
from hybridrl.reshard.adapter_sync import ShippedAdapter, gather_whole_adapters, send_adapter, served_adapter_digests
from hybridrl.reshard.cross_pool import CrossPoolSender
from hybridrl.training.actor import MegatronActor, PolicyUpdateMetrics
from hybridrl.training.checkpointing import load_role_checkpoint, save_role_checkpoint
from hybridrl.workers import faults
from hybridrl.workers.backends import FrozenBackend, mesh_coord, trained_backend
from hybridrl.workers.probe import RARE_TOKEN_PROBE, ProbeSequence, probe_batch
from hybridrl.workers.rollout_worker import cross_pool_layout


class PolicyWorker(Worker):
    """The actor and the reference of one rank, with per-phase memory figures and the probe's trainer side."""

    BUILT_BY = "init_model"

    def __init__(self, context: RankContext, plan: Plan, pad_token_id: int | None = None) -> None:
        super().__init__(context)
        self.plan = plan
        self.pad_token_id = pad_token_id  # the run's pad id (None: resolved from the model folder at set-up)
        self.actor: MegatronActor | None = None
        self.ref: MegatronActor | None = None
        # the reference's own backend, its weights on the host between its passes (None: no reference, or a LoRA
        # actor's, which is the actor's own model with the adapters off)
        self.ref_backend: FrozenBackend | None = None
        self.phase_memory: dict[str, float] = {}  # this step's memory/* figures, handed out with the sync's

    def init_model(self, total_training_steps: int | None = None) -> None:
        self.use_torch_threads(self.plan.config.trainer.torch_threads_per_rank)
        backend = trained_backend(self.plan, Role.ACTOR, total_training_steps)
        self.actor = MegatronActor(backend, self.plan)
        if not self.plan.resolved.ref_enabled:
            return
        if backend.spec.lora is None:
            # Same processes, so the same megatron layout as the actor (checked by the backend); it waits on the host
            # beside the actor and vLLM
            self.ref_backend = FrozenBackend.build(self.plan, Role.REF, host_between_passes=True)
            backend = self.ref_backend.backend
        # else a LoRA actor's frozen base is the initial policy: the reference is it with the adapters off (one model
        # in memory, as verl's LoRA path does), with its own pass settings (ref.log_prob_micro_batch_size...)
        self.ref = MegatronActor(backend, self.plan, log_prob_pass="ref_log_prob", output_key="ref_log_probs")

    def mesh_coords(self) -> MeshCoord:
        return mesh_coord(self._built_actor().backend)

    def _built_actor(self) -> MegatronActor:
        return self._require(self.actor, "the actor")

    def _ready_actor(self) -> MegatronActor:
        """The actor, its parameters on the device (back from the host with megatron.param_offload: every call
        that reads them starts here)."""
        actor = self._built_actor()
        actor.backend.load_params()
        return actor

    def _resolve_pad_token_id(self) -> int:
        if self.pad_token_id is None:
            model = self.plan.config.actor_rollout_ref.model
            self.pad_token_id = model_folder_pad_token_id(model.path, model.tokenizer_path, model.trust_remote_code)
        return self.pad_token_id

    def _release(self) -> None:
        """Hand this process's cached free GPU blocks back to the driver: vLLM (in this process, or beside it next to
        the critic's) can only map memory the driver holds. No-op on CPU."""
        release_cached_blocks(self.plan.resolved.device)

    def _record_memory(self, phase: str) -> None:
        self.phase_memory.update(memory_metrics(phase, self.plan.resolved.device))

    def take_phase_memory(self) -> dict[str, float]:
        figures, self.phase_memory = self.phase_memory, {}
        return figures

    # ------------------------------------------------------------------------------ passes and the update
    def compute_log_prob(self, batch: Batch, with_entropy: bool = False) -> Batch | None:
        faults.crash_point(Phase.OLD_LOG_PROB)
        return self._ready_actor().compute_log_prob(batch, with_entropy)

    def compute_ref_log_prob(self, batch: Batch) -> Batch | None:
        ref = self._require(self.ref, "the reference policy")
        if self.ref_backend is None:  # a LoRA actor's base
            self._ready_actor()
            with adapters_disabled(ref.backend.chunks):
                return ref.compute_log_prob(batch)
        with self.ref_backend.scoring():
            return ref.compute_log_prob(batch)

    def update_actor(self, batch: Batch) -> PolicyUpdateMetrics | None:
        self._record_memory("update_before")
        actor = self._ready_actor()
        faults.crash_point(Phase.UPDATE_ACTOR)
        if faults.triggered(faults.NAN_UPDATE_ACTOR):
            batch["advantages"] = torch.full_like(batch["advantages"], float("nan"))
        metrics = actor.update_policy(batch)
        actor.backend.offload_training_state()  # idle until the next update (no-op unless configured)
        self._record_memory("update_after")
        return metrics

    # ------------------------------------------------------------------------------ checkpoints and export
    def save_checkpoint(self, path: str) -> str:
        saved = str(save_role_checkpoint(self._ready_actor().backend, Path(path) / Role.ACTOR))
        faults.crash_point(Phase.SAVE_CHECKPOINT)  # files written, checkpoint not yet sealed by the trainer
        return saved

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        return load_role_checkpoint(self._ready_actor().backend, Path(path) / Role.ACTOR)

    def export_hf(self, path: str) -> str:
        """Collective: the current policy as an HF folder (written by rank 0); a LoRA actor's adapters merged into
        the weights they adapt (as `hybridrl convert` and peft's merge_and_unload do)."""
        backend = self._ready_actor().backend
        merge = None
        if backend.spec.lora is not None:
            adapters = gather_whole_adapters(lora_adapters(backend.chunks), backend.ctx)
            merge = PeftMerge.of(adapters.state, backend.spec.lora.scaling)
        return str(export_hf(backend.chunks, path, ctx=backend.ctx, force=True, adjust=merge))

    # ------------------------------------------------------------------------------ what a weight sync reads
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
        probe = probe_batch(sequence, self._resolve_pad_token_id())
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
