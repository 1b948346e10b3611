"""Every difference between a GPU (cuda) and a CPU run, as named fields: `DevicePolicy`.

One frozen value per resolved device (`DevicePolicy.for_device("cuda" | "cpu")`), built into the
Plan as `Plan.device_policy`. Code outside `hybridrl.parallel` and `hybridrl.rollout` reads its
fields instead of comparing device strings, so a device difference is written once, here, with
the reason for it, and adding a device path is one new constructor.

Torch-free (the config package builds the Plan without torch); the functions that need torch for
a device (`rank_device`, `default_dtype_for`, ...) stay in `hybridrl.parallel.device`.
"""
from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

# megatron TransformerConfig settings the CPU layer runs with (`cpu_layer.CPU_CONFIG_OVERRIDES`): no fused CUDA
# kernels exist there (where a stand-in fills a fused slot, the bridge installs it itself). Here, torch-free, so
# the plan refuses a user's `override_transformer_config` that asks otherwise on cpu.
CPU_LAYER_TRANSFORMER_SETTINGS: Mapping[str, object] = types.MappingProxyType({
    "batch_p2p_sync": False,
    "gradient_accumulation_fusion": False,
    "apply_rope_fusion": False,
    "bias_activation_fusion": False,
    "masked_softmax_fusion": False,
    "bias_dropout_fusion": False,
    "persist_layer_norm": False,
})
# TransformerConfig settings that need CUDA kernels (TransformerEngine, DeepEP) beyond those: off on cpu.
CUDA_KERNEL_TRANSFORMER_SETTINGS: Mapping[str, object] = types.MappingProxyType({
    "moe_permute_fusion": False,
    "moe_enable_deepep": False,
})

DeviceName = Literal["cuda", "cpu"]
DistBackend = Literal["nccl", "gloo"]
PackedAttention = Literal["cpu_stand_in", "transformer_engine"]


@dataclass(frozen=True)
class DevicePolicy:
    """What a resolved device changes in a run; one instance per device (see `for_device`)."""

    name: DeviceName
    # torch.distributed backend of every worker group: NCCL takes only CUDA tensors, gloo CPU ones.
    dist_backend: DistBackend
    # Config dtype names used when actor.megatron.dtype / rollout.dtype are unset: bf16 on GPUs;
    # fp32 on CPU, whose runs are the correctness checks against HF (bit-exact or ~1e-6).
    default_train_dtype: str
    default_rollout_dtype: str
    # Ray: whether each worker's bundle holds a GPU (and the worker is pinned to it).
    ray_use_gpu: bool
    # Ray CPUs per worker bundle: a whole one next to a GPU; half on CPU, so a 2-core host fits
    # the actor, critic and reward-model groups colocated on the same ranks.
    ray_cpus_per_worker: float
    # None: Ray counts the node's CPUs. Else Ray is told max(this, world size) logical CPUs: on CPU
    # they are scheduling tokens (torch threads are capped per rank by `torch_threads_per_rank`),
    # and a small host must still admit one bundle per rank and group.
    ray_min_cluster_cpus: int | None
    # megatron runs through hybridrl's CPU layer (parallel/cpu/layer.py: the TransformerConfig
    # overrides, the CPU fused RoPE, the per-thread torch-function mode).
    megatron_cpu_layer: bool
    # Transformer Engine can exist here (its kernels are CUDA-only); without it megatron's local
    # layer spec is built, whose attention takes no packed sequences.
    transformer_engine_possible: bool
    # What runs attention over packed (THD) sequences, which megatron's local attention refuses:
    # TE's fused attention on GPUs (the gpu extra installs TE; the workers stop at start-up without
    # it), the CPU layer's stand-in on CPU (`hybridrl/parallel/cpu/attention.py`). None: nothing does,
    # and `model.use_remove_padding` left unset resolves to false. Set, it resolves to true.
    packed_attention: PackedAttention | None
    # Packed attention that also honours a shared prompt's tree (one segment [prompt, response_1, ...],
    # each response seeing the prompt and itself; `model.shared_prefix`): the CPU layer's stand-in does,
    # TE's fused attention has no such mask. False: `model.shared_prefix` left unset resolves to false,
    # and true is refused.
    shared_prefix_attention: bool
    # Parameters live in host memory: offloading a frozen role's parameters is a no-op, and
    # micro-batches need not be moved to an accelerator.
    params_on_host: bool
    # Offloading / restoring megatron's DDP grad buffers: wait for the device's queued kernels
    # before freeing storage they may read, and hand the cached blocks back to the driver so vLLM
    # can map them. Both are CUDA-only notions.
    synchronize_on_offload: bool
    empty_cache_on_offload: bool
    # The per-GPU memory estimate (trainer.gpu_memory_gib) is a hard limit: a colocated policy over
    # it would run out of memory minutes after start-up, so the Plan refuses it. On CPU the
    # estimate only warns (host memory is not what the budget describes).
    gpu_memory_budget_binding: bool
    # vLLM: rollout.enforce_eager is passed through (CUDA graphs exist); on CPU vLLM always runs
    # eagerly and the setting is not honoured.
    vllm_honours_enforce_eager: bool
    # vLLM repacks linear weights (oneDNN) after loading: a direct write into a parameter must be
    # followed by the layer's post-load processing, and the as-loaded copy is kept
    # (`capture_loaded_weights`) so the sync's checksums can be read back.
    vllm_repacks_weights: bool
    # vLLM's KV cache is sized by the Plan in bytes (rollout.cpu_kv_cache_gib, or enough for one
    # wave); on GPUs vLLM sizes it itself from rollout.gpu_memory_utilization.
    vllm_kv_cache_from_plan: bool
    # vLLM's sleep mode (free the KV cache, offload weights during training) exists.
    vllm_sleep_mode: bool
    # vLLM may prefill a prompt in chunks over several scheduler steps. It rewinds a seeded request's
    # generator after each partial step, which torch's CPU generator cannot ("CPU Generator does not
    # use offset"), so on CPU each prompt is prefilled in one step and a step's token budget
    # (rollout.max_num_batched_tokens) must hold a whole sequence.
    vllm_chunked_prefill: bool
    # vLLM's kernel for unquantized MoE experts, named so that the expert weights the resharder writes
    # straight into vLLM's parameters are in the layout the kernel reads. On GPUs vLLM's own choice
    # (`fused_moe/oracle/unquantized.py`) prefers FlashInfer's TRT-LLM / CUTLASS kernels on Blackwell,
    # whose post-load step pads and block-reorders w13/w2 or swaps w13's halves to [up; gate]: a direct
    # write of checkpoint-layout shards would then be wrong. Triton's experts keep the checkpoint layout
    # ([E, 2I, H] gate then up, [E, H, I]) on every CUDA GPU. "auto" on CPU: vLLM's CPU experts, whose
    # repacking the CPU path re-runs after each write (`vllm_patches.capture_loaded_weights`).
    vllm_moe_backend: str
    # vLLM's top-k keeps every logit equal to the k-th largest (its PyTorch path, CPU) rather than
    # exactly k tokens (its Triton kernel, CUDA: ties at the k-th taken in vocabulary order); the
    # trainer's truncated log-probs (`algorithm.rollout_correction.match_truncation`) follow suit.
    vllm_top_k_keeps_ties: bool
    # The head sizes (head_dim) vLLM's attention kernel here has code for (vLLM's CPU_ATTN backend's
    # `get_supported_head_sizes`), or None where vLLM picks among backends of its own (GPUs). A model of another
    # head_dim fails as vLLM builds its first attention call, in every rollout worker.
    vllm_attention_head_dims: tuple[int, ...] | None
    # The device has its own random generator (torch.cuda's), saved and restored with a role
    # checkpoint beside torch's, python's, numpy's and megatron's tracker's streams.
    device_rng: bool
    # Environment given to every worker process (a user's own value of a variable is kept). On CPU
    # the tensors live in host memory, and glibc hands every freed block above its mmap threshold
    # (128 KiB-32 MiB) back to the kernel: each step's logits, activations, grads and sync buffers
    # are page-faulted and zeroed again on their next allocation (measured here: an elementwise op
    # over a 50 MB tensor 4-7x slower, the embedding's grad zeroing 10x). No mmap'ed blocks and no
    # trimming keep freed memory in the heap for reuse; the process keeps its peak size.
    # On GPUs megatron orders its TP communication (sequence parallelism's all-gather before the GEMM that
    # reads it, the async grad all-reduce) by issuing kernels in program order on one hardware queue:
    # CUDA_DEVICE_MAX_CONNECTIONS=1 (megatron's own training scripts set it; without it the kernels may
    # run out of order and the overlap is lost or wrong).
    # On CPU, the warnings megatron and vLLM give at import about the GPU libraries hybridrl's CPU path runs
    # without by design (Transformer Engine, Apex: the CPU layer, `hybridrl.parallel.cpu`, stands in for their
    # kernels; Triton: vLLM's dispatcher reads a deprecated torch name looking for Triton kernels) are ignored
    # in the workers (`CPU_WORKER_WARNINGS`): ten lines a rank in every CPU run that say nothing a user can act on.
    # Likewise torch's log line when vLLM's CPU worker looks for Triton kernels, which the CPU stack does not install
    # (`CPU_WORKER_TORCH_LOGS`).
    worker_env: tuple[tuple[str, str], ...]  # (name, value) pairs: the policy pickles and prints as JSON
    # Flush subnormal floats to zero in the worker's compute thread (`torch.set_flush_denormal`). On
    # CPU, a vocab head's grad holds millions of values near 1e-38 (the softmax of tokens the model
    # all but rules out): clip-scaling SmolLM2-135M's tied embedding grad took 1.65 s with subnormal
    # results and 0.014 s flushed. Values below 1.2e-38 change; no tolerance this project checks does.
    flush_denormals: bool
    # The weight sync keeps its send/receive buffers from one sync to the next
    # (`hybridrl.reshard.exchange.ScratchBuffers`): a fresh host buffer is faulted in page by page
    # (PP2 on SmolLM2-135M: a 212 MB receive took 1.5-6.6 s in the trainer, ~0.1 s kept); a GPU's
    # memory is handed back to training between syncs instead.
    reshard_keeps_buffers: bool
    # The optimizer's state (Adam's moments) is allocated when the trainer is built, not at its first
    # step. On CPU the first step would place ~2x the parameters in the heap among the first update's
    # freed activations, and the next updates grow the heap into fresh pages around them (first touch
    # is dear on VMs); built first, they sit below everything a step allocates and frees. On a GPU the
    # memory before vLLM's build sizes its KV cache: keep torch's lazy allocation there.
    optimizer_state_at_setup: bool
    # Who serves megatron's gradient-accumulation fusion for trained roles (weight-gradient GEMMs that
    # accumulate into DDP's main_grad: no grad tensor, no add pass per weight and micro-batch), or None
    # to leave megatron's flag off. CPU: the stand-in for Apex's CUDA kernel
    # (`hybridrl.parallel.cpu.wgrad`). CUDA: None here; `speed_settings` turns megatron's flag on where
    # Apex's kernel imports on the worker (megatron's own output layer needs it even under TE's spec).
    wgrad_accumulation_fusion: str | None
    # megatron's fused kernels and DDP communication overlap on by default where they apply
    # (`hybridrl.parallel.speed_settings`): CUDA kernels and NCCL's asynchronous collectives. Off on CPU,
    # where the CPU layer decides its own settings.
    megatron_speed_defaults: bool

    @classmethod
    def for_device(cls, name: str) -> DevicePolicy:
        """The policy of a resolved device ('cuda' or 'cpu'; 'auto' is resolved before this)."""
        try:
            return DEVICE_POLICIES[name]
        except KeyError:
            raise ValueError(f"no device policy for device {name!r}: expected one of "
                             f"{', '.join(DEVICE_POLICIES)} (a resolved device)") from None

    @property
    def adapters_change_spec(self) -> bool:
        """Whether a model with LoRA adapters is built on another layer spec than the others here: megatron's local
        one where TE's would be (`device.layer_spec_kind`; `ADAPTERS_ON_LOCAL_SPEC`)."""
        return self.transformer_engine_possible

    def packed_attention_for(self, adapters: bool) -> PackedAttention | None:
        """What serves packed attention to a role's model here: `packed_attention`, but nothing to a model with LoRA
        adapters (`adapters`) where those change the spec (the local spec's attention takes no packed sequences)."""
        return None if adapters and self.adapters_change_spec else self.packed_attention

    def ray_cluster_cpus(self, world_size: int) -> int | None:
        """The CPUs to declare to Ray for `world_size` ranks (None: let Ray count the node's)."""
        if self.ray_min_cluster_cpus is None:
            return None
        return max(self.ray_min_cluster_cpus, world_size)


CUDA = DevicePolicy(
    name="cuda", dist_backend="nccl", default_train_dtype="bf16", default_rollout_dtype="bf16",
    ray_use_gpu=True, ray_cpus_per_worker=1.0, ray_min_cluster_cpus=None,
    megatron_cpu_layer=False, transformer_engine_possible=True, packed_attention="transformer_engine",
    shared_prefix_attention=False, params_on_host=False,
    synchronize_on_offload=True, empty_cache_on_offload=True, gpu_memory_budget_binding=True,
    vllm_honours_enforce_eager=True, vllm_repacks_weights=False, vllm_kv_cache_from_plan=False,
    vllm_sleep_mode=True, vllm_chunked_prefill=True, vllm_moe_backend="triton",
    vllm_top_k_keeps_ties=False, vllm_attention_head_dims=None, device_rng=True,
    worker_env=(("CUDA_DEVICE_MAX_CONNECTIONS", "1"),),
    flush_denormals=False,
    reshard_keeps_buffers=False, optimizer_state_at_setup=False, wgrad_accumulation_fusion=None,
    megatron_speed_defaults=True,
)

# PYTHONWARNINGS entries (action:message prefix:category; a comma separates entries) for CPU workers
CPU_WORKER_WARNINGS = ",".join((
    "ignore:Transformer Engine and Apex are not installed:UserWarning",  # megatron's optimizer and clip_grads
    "ignore:Apex is not installed:UserWarning",  # megatron's local layer spec
    "ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning",  # vLLM's Triton dispatcher, no Triton
    # megatron-core 0.16's TP gathers and distributed optimizer call the collectives by the names the CPU stack's
    # torch 2.13 deprecates (bound at import: `tensor_parallel.mappings`, `distributed.param_and_grad_buffer`)
    "ignore:`torch.distributed.all_gather_into_tensor` is deprecated:FutureWarning",
    "ignore:`torch.distributed.reduce_scatter_tensor` is deprecated:FutureWarning",
    # megatron's TP linear layers' advice for CUDA streams (the cuda policy sets the variable: `worker_env`)
    "ignore:When using async grad allreduce it is recommended to set the environment variable "
    "CUDA_DEVICE_MAX_CONNECTIONS:UserWarning",
))

# TORCH_LOGS for CPU workers: torch's `torch._library.triton` logger at ERROR ("Triton not available,
# find_triton_kernels = []", once a rank at vLLM's engine build: the CPU stack has no Triton, by design)
CPU_WORKER_TORCH_LOGS = "-torch._library.triton"

CPU = DevicePolicy(
    name="cpu", dist_backend="gloo", default_train_dtype="fp32", default_rollout_dtype="fp32",
    ray_use_gpu=False, ray_cpus_per_worker=0.5, ray_min_cluster_cpus=4,
    megatron_cpu_layer=True, transformer_engine_possible=False, packed_attention="cpu_stand_in",
    shared_prefix_attention=True, params_on_host=True,
    synchronize_on_offload=False, empty_cache_on_offload=False, gpu_memory_budget_binding=False,
    vllm_honours_enforce_eager=False, vllm_repacks_weights=True, vllm_kv_cache_from_plan=True,
    vllm_sleep_mode=False, vllm_chunked_prefill=False, vllm_moe_backend="auto",
    vllm_top_k_keeps_ties=True, vllm_attention_head_dims=(32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512),
    device_rng=False,
    worker_env=(("MALLOC_MMAP_MAX_", "0"), ("MALLOC_TRIM_THRESHOLD_", str(1 << 40)),
                ("PYTHONWARNINGS", CPU_WORKER_WARNINGS), ("TORCH_LOGS", CPU_WORKER_TORCH_LOGS)),
    flush_denormals=True, reshard_keeps_buffers=True, optimizer_state_at_setup=True,
    wgrad_accumulation_fusion="cpu_stand_in", megatron_speed_defaults=False,
)

# What Transformer Engine decides on cuda, in the one wording `hybridrl doctor`, `hybridrl plan` and the
# workers use: without it megatron's local layer spec is built, which serves no packed sequences (its attention
# asserts no cu_seqlens; sequence parallelism it serves with `sequence_parallel_norm`).
WITHOUT_TE = ("without Transformer Engine the workers build megatron's local layer spec, which runs no packed "
              "sequences (model.use_remove_padding: true, the default on cuda): a job that packs stops at start-up; "
              "install it (the gpu extra does) or set use_remove_padding false (slower)")

# Why a LoRA actor's model is built on megatron's local layer spec on GPUs too (`device.layer_spec_kind`), and
# what it costs, in the one wording the plan and the workers use.
ADAPTERS_ON_LOCAL_SPEC = ("LoRA adapters build the actor on megatron's local layer spec (TransformerEngine's layers "
                          "fuse the norm into linear_qkv and linear_fc1, whose adapters need the normed input), whose "
                          "attention takes no packed sequences")

# resolved device name -> its policy (read-only); also the list of valid trainer.device values
DEVICE_POLICIES: Mapping[str, DevicePolicy] = types.MappingProxyType({p.name: p for p in (CUDA, CPU)})
