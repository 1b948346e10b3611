"""What every process that hosts a vLLM engine does the same way, colocated or not: build the
engine from the Plan, turn a DP chunk of prompts into rollout rows, and score the weight probe.

`ColocatedPolicyWorker` (vLLM inside the training processes) and `RolloutWorker` (vLLM on a
disaggregated pool of its own) both use these, so the rows a step trains on are the same whichever
way the rollout is placed.
"""
from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any, Literal

import numpy as np
import torch

from hybridrl.config.plan import Plan
from hybridrl.data.batch import Batch
from hybridrl.data.tokenizer import load_tokenizer
from hybridrl.models.lora_targets import vllm_lora_rank
from hybridrl.names import Phase
from hybridrl.parallel.device_policy import DevicePolicy
from hybridrl.parallel.memory import memory_metrics
from hybridrl.rollout.agent_loop import AgentLoop, build_agent_loop
from hybridrl.rollout.engine import RolloutEngine, RolloutEngineConfig
from hybridrl.rollout.sampling import RolloutSampling
from hybridrl.workers import faults


def planned_kv_cache_bytes(plan: Plan) -> int:
    """CPU: the Plan's KV cache (rollout.cpu_kv_cache_gib, sized for one wave by default)."""
    memory = plan.rollout_memory
    if memory is not None and memory.on_cpu:
        return memory.kv_cache_bytes
    return RolloutEngineConfig.kv_cache_memory_bytes  # GPU (unused there) or no model shape to size it from


def engine_config(plan: Plan, pad_token_id: int, load_format: Literal["auto", "dummy"]) -> RolloutEngineConfig:
    """The vLLM engine of this run's rollout ranks, from the Plan. `load_format`: dummy where the first weight sync
    writes every parameter before anything is generated (`RolloutEngineConfig.load_format`)."""
    arr = plan.config.actor_rollout_ref
    return RolloutEngineConfig(
        model_path=arr.model.path,
        device=plan.resolved.device,
        dtype=plan.resolved.rollout_dtype,
        infer_tp=arr.rollout.tensor_model_parallel_size,
        max_model_len=plan.resolved.max_sequence_length,
        seed=arr.rollout.seed + plan.config.trainer.seed,
        pad_token_id=pad_token_id,
        kv_cache_memory_bytes=planned_kv_cache_bytes(plan),
        max_num_batched_tokens=arr.rollout.max_num_batched_tokens,
        gpu_memory_utilization=arr.rollout.gpu_memory_utilization,
        max_num_seqs=arr.rollout.max_num_seqs,
        enforce_eager=arr.rollout.enforce_eager if plan.device_policy.vllm_honours_enforce_eager else None,
        # Where vLLM repacks weights (oneDNN, on CPU): keep the as-loaded copy so the sync's
        # checksums can be read back (the probe checks the repacked weights that run).
        capture_loaded_weights=plan.device_policy.vllm_repacks_weights,
        # colocated: the Plan's HybridFlow generation TP groups (strided when training TP is a multiple of
        # inference TP), so each rank's generation shard contains its training shard; disaggregated: the
        # pool's consecutive replicas
        tp_groups=plan.reshard.groups.rollout.replicas,
        # routing replay: each row carries the experts vLLM routed its tokens to (`routed_experts`)
        return_routed_experts=arr.actor.router_replay == "rollout",
        # lora.merge false: vLLM serves the actor's adapters (`reshard.adapter_sync`)
        lora_rank=vllm_lora_rank(plan.resolved.lora_rank) if plan.resolved.serves_adapters else 0,
        load_format=load_format,
    )


def agent_loop_for(plan: Plan, rollout: RolloutEngine) -> AgentLoop | None:
    """The multi-turn agent loop when rollout.multi_turn is enabled (observations are tokens of the
    policy's chat template; the tools run in this process)."""
    arr = plan.config.actor_rollout_ref
    multi_turn = arr.rollout.multi_turn
    if not multi_turn.enable:
        return None
    tokenizer = load_tokenizer(arr.model.tokenizer_path or arr.model.path, arr.model.trust_remote_code)
    return build_agent_loop(multi_turn, tokenizer, (*rollout.eos_token_ids, *arr.rollout.stop_token_ids))


def generate_rows(rollout: RolloutEngine, agent: AgentLoop | None, prompts: Batch, sampling: RolloutSampling,
                  pad_token_id: int, device: str, memory: dict[str, float]) -> Batch | None:
    """This replica's samples of its DP chunk of `prompts` (which carries `raw_prompt_ids` and `uid`);
    the rows on TP rank 0, None on the others. Memory before/after goes into `memory`."""
    faults.crash_point(Phase.GEN)
    faults.arm_vllm_collective_crash()
    ids = [list(map(int, p)) for p in prompts["raw_prompt_ids"]]
    uids = list(prompts["uid"]) if "uid" in prompts else None
    memory.update(memory_metrics("gen_before", device))
    with _cpu_layer_suspended(device):
        if agent is not None:  # rollout.multi_turn: conversations with tool calls
            out = rollout.generate_multi_turn(ids, sampling, agent, uids=uids, rows=tool_sample_rows(prompts))
        else:
            out = rollout.generate_sequences(ids, sampling, uids=uids)
    memory.update(memory_metrics("gen_after", device))
    return carry_prompt_columns(out, prompts, pad_token_id) if rollout.tp_rank == 0 else None


def _cpu_layer_suspended(device: str) -> AbstractContextManager[None]:
    """vLLM never needs megatron's CPU device translation: suspended on a CPU rank (a GPU rank has none)."""
    if not DevicePolicy.for_device(device).megatron_cpu_layer:
        return contextlib.nullcontext()
    from hybridrl.parallel.cpu.layer import cuda_to_cpu_mode_suspended

    return cuda_to_cpu_mode_suspended()


def carry_prompt_columns(out: Batch, prompts: Batch, pad_token_id: int) -> Batch:
    """Widen `out`'s prompts to the width of the batch they were cut from (replicas pad to their own
    longest prompt; the controller concatenates them) and carry each prompt's metadata (ground truth,
    data source, ...) onto its samples."""
    out = left_pad_prompts(out, prompts["input_ids"].shape[1], pad_token_id)
    rows = out["prompt_index"]
    for key in prompts.non_tensors:
        if key not in ("raw_prompt_ids", "uid") and key not in out.non_tensors:
            out[key] = prompts[key][rows]
    return out


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


def concat_left_padded(parts: list[Batch], pad_token_id: int) -> Batch:
    """Rollout rows generated from different prompt batches (their prompt parts of different widths) as one
    batch: each part's prompts left-padded to the widest first."""
    if len(parts) == 1:
        return parts[0]
    width = max(part["prompts"].shape[1] for part in parts)
    return Batch.concat([left_pad_prompts(part, width, pad_token_id) for part in parts])


# The prompt columns a tool that reads its calling sample gets (`hybridrl.tool_calling.SAMPLE_PARAMETER`).
TOOL_SAMPLE_COLUMNS = ("index", "uid", "data_source", "ground_truth", "extra_info")


def tool_sample_rows(prompts: Batch) -> list[dict[str, Any]]:
    """Per prompt, its data row for the tools: the `TOOL_SAMPLE_COLUMNS` the batch carries."""
    columns = [c for c in TOOL_SAMPLE_COLUMNS if c in prompts.non_tensors]
    def plain(value: Any) -> Any:  # numpy scalars as Python values: tools are user code
        return value.item() if isinstance(value, np.generic) else value

    return [{c: plain(prompts[c][i]) for c in columns} for i in range(len(prompts))]
