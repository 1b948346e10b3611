"""The device functions that need torch (or the machine): resolving 'auto', the rank's torch device,
dtypes, the layer spec, cached-block release.

The differences between a cuda and a cpu run are the fields of `DevicePolicy`
(`hybridrl.parallel.device_policy`); the functions here read them rather than restating them. The
rest of hybridrl asks these functions instead of testing `torch.cuda.is_available()` itself, so the
GPU-only branches are plain logic that the CPU test suite covers (issue 9).

Importing this module is cheap: torch is imported lazily inside the functions that need it, and the CPU stand-ins
(`hybridrl.parallel.cpu`) only on the CPU branches: the GPU path never loads them.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Literal

from hybridrl.parallel.device_policy import DeviceName as Device
from hybridrl.parallel.device_policy import DevicePolicy
from hybridrl.parallel.device_policy import DistBackend as Backend

if TYPE_CHECKING:
    import torch

LayerSpecKind = Literal["te", "local"]

_DEVICES: tuple[str, ...] = ("auto", "cuda", "cpu")
_DTYPE_NAMES: dict[str, str] = {
    "fp32": "float32", "float32": "float32", "float": "float32",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "float16": "float16", "half": "float16",
}


def cuda_available() -> bool:
    """Whether torch sees a usable CUDA device (the single place hybridrl asks torch)."""
    import torch

    return bool(torch.cuda.is_available())


def resolve_device(requested: str, *, cuda_is_available: bool | None = None) -> Device:
    """Map a configured device ('auto' | 'cuda' | 'cpu', 'cuda:N' accepted) to 'cuda' or 'cpu'.

    'auto' picks cuda when available. Asking for cuda on a machine without it is an error rather
    than a silent fallback: a GPU config running on CPU would be orders of magnitude slower.
    `cuda_is_available` overrides the probe (tests of the GPU branch on CPU machines).
    """
    name = requested.strip().lower()
    base = name.split(":", 1)[0]
    if base not in _DEVICES:
        raise ValueError(f"unknown device {requested!r}: expected one of {', '.join(_DEVICES)}")
    has_cuda = cuda_available() if cuda_is_available is None else cuda_is_available
    if base == "auto":
        return "cuda" if has_cuda else "cpu"
    if base == "cuda" and not has_cuda:
        raise RuntimeError(
            f"device {requested!r} requested but CUDA is not available (torch.cuda.is_available() is "
            "False: CPU-only torch build or no visible GPU). Use device='cpu' or device='auto'."
        )
    return "cuda" if base == "cuda" else "cpu"


def dist_backend_for(device: str) -> Backend:
    """torch.distributed backend for a resolved device (its `DevicePolicy.dist_backend`)."""
    return DevicePolicy.for_device(device).dist_backend


def default_dtype_for(device: str, requested: str | torch.dtype | None = None) -> torch.dtype:
    """Parameter/compute dtype: the requested one if given, else the device's
    (`DevicePolicy.default_train_dtype`: bf16 on cuda, fp32 on cpu).

    fp32 is the CPU default because the CPU path is used for correctness checks against HF (bit-exact
    or ~1e-6); bf16 on CPU is faster on AVX512-BF16 machines but must be asked for explicitly.
    """
    import torch

    if requested is None:
        requested = DevicePolicy.for_device(device).default_train_dtype
    if isinstance(requested, torch.dtype):
        return requested
    key = requested.strip().lower().removeprefix("torch.")
    if key not in _DTYPE_NAMES:
        raise ValueError(f"unknown dtype {requested!r}: expected one of {sorted(_DTYPE_NAMES)}")
    return getattr(torch, _DTYPE_NAMES[key])


def rank_device(device: str) -> torch.device:
    """The torch device a rank's model lives on: where micro-batches and collective buffers go.

    cuda: this process's current GPU. cpu: the CPU, or, under strict-device mode
    (`hybridrl.parallel.cpu.strict_device`), "cuda", which the CPU layer maps to the CPU while marking
    the tensor as one that would be on the GPU, so a forgotten move fails in CPU tests as on GPUs.
    """
    import torch

    if device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    if device == "cpu":
        from hybridrl.parallel.cpu.strict_device import cpu_rank_device

        return cpu_rank_device()
    raise ValueError(f"rank_device expects a resolved device 'cuda' or 'cpu', got {device!r}")


def vllm_device(device: str) -> torch.device:
    """Where a vLLM engine in this process keeps its weights: this process's current GPU, or the CPU
    (vLLM's CPU tensors are plain host tensors; the strict-device marking is megatron's business)."""
    import torch

    if device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    if device == "cpu":
        return torch.device("cpu")
    raise ValueError(f"vllm_device expects a resolved device 'cuda' or 'cpu', got {device!r}")


def to_rank_device(tensor: torch.Tensor, device: str) -> torch.Tensor:
    """`tensor` on the rank's device (`rank_device`); from host memory through a pinned staging copy
    with a non-blocking transfer on cuda, so copies of several micro-batches overlap."""
    target = rank_device(device)
    if device == "cuda" and tensor.device.type == "cpu":
        if not tensor.is_pinned():
            tensor = tensor.pin_memory()
        return tensor.to(target, non_blocking=True)
    return tensor.to(target)


def collective_device(group: object = None) -> torch.device:
    """The device a tensor must be on to enter a collective on `group` (None: the default group).

    NCCL takes only CUDA tensors (on this process's GPU); gloo takes CPU tensors. Under strict-device
    mode a CPU rank answers as for the NCCL group the group would be on GPUs (see `rank_device`).
    """
    import torch
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    strict = loaded_strict_device()  # a gloo group on a GPU cluster (metadata) stays on the host
    return strict.cpu_collective_device(group) if strict is not None else torch.device("cpu")


STRICT_DEVICE_MODULE = "hybridrl.parallel.cpu.strict_device"


def loaded_strict_device() -> ModuleType | None:
    """The strict-device module when this process has loaded it, else None. Only the CPU layer turns the mode on, and
    it imports the module first, so its checks and marks matter only then: code that serves both devices asks this
    instead of importing it (the GPU path never loads a CPU stand-in)."""
    return sys.modules.get(STRICT_DEVICE_MODULE)


def megatron_cpu_initialization(device: str) -> bool:
    """megatron's `use_cpu_initialization`: on cpu parameters are allocated on the host, except under
    strict-device mode, where a CPU rank allocates them "on the device" as the GPU path does (so the
    mode sees the model where a GPU run has it)."""
    if device != "cpu":
        return False
    from hybridrl.parallel.cpu.strict_device import strict_device_active

    return not strict_device_active()


def te_available() -> bool:
    """Whether transformer_engine is importable (found without importing it: the import is slow)."""
    try:
        return importlib.util.find_spec("transformer_engine") is not None
    except (ImportError, ValueError):
        return False


def apex_wgrad_available() -> bool:
    """Whether Apex's fused_weight_gradient_mlp_cuda (megatron's gradient-accumulation fusion) is importable."""
    try:
        return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None
    except (ImportError, ValueError):
        return False


def layer_spec_kind(device: str, te_available: bool | None = None, *, adapters: bool = False) -> LayerSpecKind:
    """Which megatron layer spec to build: 'te' on GPUs with Transformer Engine, else 'local'.

    TE does not install on CPU machines and its kernels are CUDA-only, so CPU always gets the local
    (pure torch) spec. `adapters` (a LoRA actor's model) gets the local spec everywhere: TE's spec fuses
    the norm into linear_qkv and linear_fc1 (TELayerNormColumnParallelLinear), whose adapters need the
    normed input that TE's layer keeps inside; the local spec has the norm and the linear as two layers
    (`ADAPTERS_ON_LOCAL_SPEC` says what that costs). `te_available=None` probes the environment.
    """
    if device == "cpu":
        return "local"
    if device != "cuda":
        raise ValueError(f"layer_spec_kind expects a resolved device 'cuda' or 'cpu', got {device!r}")
    if adapters:
        return "local"
    has_te = _probe_te() if te_available is None else te_available
    return "te" if has_te else "local"


# `layer_spec_kind` has a parameter named like the module-level probe; keep a private alias.
_probe_te = te_available


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity set, which a cgroup's cpuset or `taskset` narrows)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def torch_threads_per_rank(ranks_on_node: int, cores: int | None = None) -> int:
    """Intra-op threads for one of `ranks_on_node` training processes sharing this node's cores.

    torch's default is every core in every process: with several ranks per node their OpenMP pools
    oversubscribe the cores and spin against each other (measured on the 2-core CPU demo: 1.7 s per
    step with 2 threads in each of 2 ranks, 0.27 s with 1). `cores` defaults to this process's CPU
    affinity set.
    """
    if ranks_on_node < 1:
        raise ValueError(f"ranks_on_node must be >= 1, got {ranks_on_node}")
    available = cores if cores is not None else len(os.sched_getaffinity(0))
    return max(1, available // ranks_on_node)


def release_cached_blocks(device: str) -> None:
    """Hand the caching allocator's free blocks back to the driver (cuda), so another allocator in
    this process — vLLM's sleep-mode pool waking its KV cache — can map them. No-op on CPU."""
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()
