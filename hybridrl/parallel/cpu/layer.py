"""The CPU layer: what it takes to run real megatron-core 0.16 on CPU (gloo), in one module.

megatron-core is written for CUDA. Its models, schedules, DDP and optimizers run unchanged on CPU
tensors once a handful of CUDA assumptions are bridged. Each bridge below is a `_Patch` with a name,
the megatron functions it serves and why it is needed; `apply_cpu_layer()` installs all of them
(idempotent), `cpu_layer_active()` tells whether they are in place, `remove_cpu_layer()` undoes
them (tests use it, together with `skip=`, to show what breaks without a given patch).

The patches (names as in `PATCHES`):

- ``cuda_current_device``: megatron allocates with ``device=torch.cuda.current_device()`` (tensor
  parallel layers and mappings, rotary embedding, attention, GPT model, p2p communication,
  distributed optimizer buffers). On a CPU-only torch that call asserts "Torch not compiled with
  CUDA enabled". We make it return device index 0; ``cuda_to_cpu_mode`` turns that into cpu.
- ``cuda_to_cpu_mode``: a `TorchFunctionMode` that rewrites cuda devices (``"cuda"``, ``"cuda:N"``,
  ``torch.device("cuda")``, bare indices) to cpu in every torch call, and makes ``Tensor.cuda()`` a
  no-op, and drops ``pin_memory=True`` (page-locked host memory exists for CUDA copies only; a
  CPU-only torch raises on it: context parallelism's rotary table split,
  ``rope_utils.get_pos_emb_on_this_cp_rank``, builds its index that way). Covers the hard-coded
  ``device="cuda"`` of the default causal mask (``transformer.utils.get_default_causal_mask``), the
  token counters of the pipeline schedules (``pipeline_parallel.schedules``), the optimizer's
  ``found_inf``/scale tensors (``optimizer.optimizer``) and grad-norm/clipping buffers
  (``optimizer.clip_grads``), and the index-0 allocations above. ``torch.device(i)`` of a bare index
  (``YarnRotaryEmbedding.__init__`` enters ``torch.device(torch.cuda.current_device())``) gives the
  ``cuda:i`` descriptor it means on a GPU (a CPU-only torch raises "Cannot access accelerator device"
  resolving the index); what is then allocated on it is mapped as above. Two properties of torch function
  modes shape it: a mode is popped while its handler runs, so ``Tensor.backward``/
  ``torch.autograd.backward``/``grad`` are re-dispatched with the mode pushed again (megatron's
  custom backward functions allocate too, e.g. the sequence-parallel reduce-scatter buffer in
  ``mappings._reduce_scatter_along_first_dim``); and the mode stack is per thread, so a thread other
  than the one that applied the layer must call `apply_cpu_layer()` itself before running megatron
  code (`cpu_layer_active()` answers per thread).
- ``cpu_rng_tracker``: megatron keeps its model-parallel RNG streams in ``CudaRNGStatesTracker``,
  which stores and swaps the *CUDA* generator state (``torch.cuda.get_rng_state``); attention
  dropout and weight init fork it (``get_cuda_rng_tracker().fork()``). We substitute a subclass that
  keeps the same named streams on the CPU default generator, so
  ``tensor_parallel.model_parallel_cuda_manual_seed`` itself works on CPU and gives TP ranks the
  distinct streams (seed + 2718 + tp_rank) and DP ranks the shared one megatron intends. Activation
  recomputation saves/restores RNG through ``random._get_cuda_rng_state``/``_set_cuda_rng_state``;
  those are pointed at the CPU generator too.
- ``cuda_type_names``: megatron checks tensor types by their CUDA names:
  ``clip_grads.clip_grad_by_total_norm_fp32`` asserts ``grad.type() == 'torch.cuda.FloatTensor'``;
  ``DistributedOptimizer.__init__`` (via ``_build_model_and_main_param_groups``) and
  ``Float16OptimizerWithFloat16Params.__init__`` raise TypeError unless params are
  ``torch.cuda.{Float,Half,BFloat16}Tensor``. While those three functions run (and only then),
  ``Tensor.type()`` reports the CUDA name of a CPU tensor's dtype.
- ``cuda_synchronize``: with ``variable_seq_lengths=True`` (micro-batches of different shapes),
  pipeline stages first exchange activation shapes, and ``p2p_communication._communicate_shapes``
  calls ``torch.cuda.synchronize()`` unconditionally (``batch_p2p_sync`` does not cover it). On CPU
  there is no stream to wait for (the gloo requests were already waited on): a no-op.
- ``moe_alltoall_streams``: the MoE alltoall token dispatcher (``MoEAlltoAllTokenDispatcher``)
  creates a ``torch.cuda.Stream()`` in its ``__init__`` and copies its all-to-all split sizes to
  the host on it (``_maybe_dtoh_and_synchronize``). On CPU the stream is never made and only the
  split sizes' conversion to numpy (what the GPU path hands the all-to-all) is kept.
- ``uneven_gather_scatter``: with an expert TP group whose ranks route different tokens (expert TP
  other than TP, or sequence parallelism), that dispatcher all-gathers its tokens over the expert TP
  group and reduce-scatters the outputs back with per-rank split sizes
  (``tensor_parallel.mappings._gather_along_first_dim`` / ``_reduce_scatter_along_first_dim`` with
  ``output_split_sizes`` / ``input_split_sizes``: ``torch.distributed.all_gather`` of a list of
  unequal tensors and ``reduce_scatter`` of one). NCCL serves unequal sizes; gloo refuses them
  ("ProcessGroupGloo::allgather: invalid tensor size"). With split sizes, each rank's part is padded
  to the largest with zeros and the equal-size collective runs instead; the padding is cut off again
  (a gather copies, a reduce-scatter sums zeros there), so the results are the same numbers.

Not patches: the CPU stand-ins for TE kernels are their own modules, installed by the bridge where
it builds models (`hybridrl.parallel.cpu.rope`: fused RoPE; `hybridrl.parallel.cpu.attention`: core
attention that also serves packed THD sequences, which megatron's local attention refuses).

Not a patch, but required on CPU (`check_config_for_cpu` enforces it, `CPU_CONFIG_OVERRIDES` holds
the values): ``batch_p2p_sync=False`` (p2p communication calls ``torch.cuda.synchronize()`` after
batched send/recv), ``gradient_accumulation_fusion=False`` (needs Apex CUDA kernels, unless
`hybridrl.parallel.cpu.wgrad` fills their slot, as the training backend does for trained roles),
``apply_rope_fusion=False`` (unless `hybridrl.parallel.cpu.rope` fills megatron's fused-RoPE
slot, as the bridge does)/``bias_activation_fusion``/``masked_softmax_fusion``/
``bias_dropout_fusion``/``persist_layer_norm`` off (TE/Apex kernels).

Written for megatron-core 0.16.x (checked on 0.16.1); `apply_cpu_layer` refuses other versions,
because each patch names private megatron functions whose behaviour is only known for that line.
Strict-device mode (`hybridrl.parallel.cpu.strict_device`, ``HYBRIDRL_STRICT_DEVICE=1``) replaces the
mapping mode with one that also remembers which tensors would live on the GPU and raises where
CUDA would (a CPU batch fed to a model on the device, a CPU tensor in an NCCL collective): the CPU
test suite's guard for the GPU path.
The mode adds Python dispatch to every torch call on the thread (measured ~1 us per op here, next to
~1.4 us for an 8x8 add: it matters only for tiny tensors): apply it only in processes that train on
CPU (`hybridrl.parallel.state.initialize_model_parallel(device='cpu')` does that).
"""
from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from hybridrl.parallel.cpu.rope import cpu_fused_rope_installed
from hybridrl.parallel.cpu.wgrad import cpu_wgrad_fusion_installed
from hybridrl.parallel.device_policy import CPU_LAYER_TRANSFORMER_SETTINGS

# lazy: hybridrl.parallel.cpu.strict_device imports this module at its top (it subclasses CudaToCpuMode),
# so the two imports of strict_device below stay inside their functions.

SUPPORTED_MEGATRON_PREFIX = "0.16."

# ModelParallelConfig/TransformerConfig values that must hold on CPU (see module docstring).
CPU_CONFIG_OVERRIDES: dict[str, Any] = dict(CPU_LAYER_TRANSFORMER_SETTINGS)


class UnsupportedMegatronVersion(RuntimeError):
    """The installed megatron-core is not the line this CPU layer was written for."""


def check_megatron_version(version: str | None = None) -> str:
    """Return megatron-core's version, or raise if it is not 0.16.x (the version patched here)."""
    if version is None:
        import megatron.core

        version = str(getattr(megatron.core, "__version__", "unknown"))
    if not version.startswith(SUPPORTED_MEGATRON_PREFIX):
        raise UnsupportedMegatronVersion(
            f"hybridrl's CPU layer was written for megatron-core {SUPPORTED_MEGATRON_PREFIX}x "
            f"(checked on 0.16.1) but megatron-core {version} is installed. Its patches target "
            "private megatron functions (RNG tracker, clip_grads, DistributedOptimizer); install "
            "megatron-core==0.16.1 or revisit hybridrl/parallel/cpu/layer.py for this version."
        )
    return version


# --------------------------------------------------------------------------------------------------
# cuda -> cpu device mapping
# --------------------------------------------------------------------------------------------------
_CPU = torch.device("cpu")


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":", 1)[0].strip() == "cuda"
    # A bare index means a CUDA ordinal to torch (`torch.empty(3, device=0)`); bool is not a device.
    return isinstance(device, int) and not isinstance(device, bool)


def _map_device(device: Any) -> Any:
    return _CPU if _is_cuda_device(device) else device


def cuda_ordinal_device(func: Any, args: tuple, kwargs: dict | None) -> torch.device | None:
    """`torch.device(i)` for a bare index (megatron's `torch.device(torch.cuda.current_device())`, e.g. the context
    manager around `YarnRotaryEmbedding.__init__`): the CUDA device descriptor it names on a GPU, where a CPU-only
    torch raises "Cannot access accelerator device" while resolving the index. A descriptor allocates nothing: the
    tensors then asked for on it are mapped as any cuda device is. None: not such a call."""
    if func is torch.device and not kwargs and len(args) == 1 and isinstance(args[0], int) \
            and not isinstance(args[0], bool):
        return torch.device("cuda", args[0])
    return None


# Functions that run arbitrary Python (custom autograd backward, hooks) under their dispatch. A mode
# is popped while its handler runs, so without re-entry the whole backward pass would run without
# the mapping and megatron's backward allocations (e.g. the reduce-scatter buffer in
# `mappings._reduce_scatter_along_first_dim`) would hit CUDA.
_REENTRANT = frozenset({torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad})


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites cuda devices to cpu in every torch call made while the mode is on the stack."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _REENTRANT:
            with self:
                return torch.overrides.redispatch_function(func, types, args, kwargs)
        if func is torch.Tensor.cuda:
            # `t.cuda()` on CPU means "stay here": return the tensor itself, as CUDA does for a
            # tensor already on the current device.
            return args[0]
        if (ordinal := cuda_ordinal_device(func, args, kwargs)) is not None:
            return ordinal
        if kwargs and "device" in kwargs:
            kwargs = dict(kwargs)
            kwargs["device"] = _map_device(kwargs["device"])
        if kwargs and kwargs.get("pin_memory"):
            kwargs = dict(kwargs)
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **(kwargs or {}))


def _mode_in_this_thread() -> bool:
    from torch.overrides import _get_current_function_mode_stack

    return any(isinstance(m, CudaToCpuMode) for m in _get_current_function_mode_stack())


# --------------------------------------------------------------------------------------------------
# CUDA type names for type checks
# --------------------------------------------------------------------------------------------------
_CUDA_TYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


class CudaTypeNamesMode(TorchFunctionMode):
    """`Tensor.type()` (no arguments) answers the CUDA type name of a CPU float tensor."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            tensor = args[0]
            if tensor.device.type == "cpu" and tensor.dtype in _CUDA_TYPE_NAMES:
                return _CUDA_TYPE_NAMES[tensor.dtype]
        return func(*args, **kwargs)


def _with_cuda_type_names(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with CudaTypeNamesMode():
            return fn(*args, **kwargs)

    wrapper.__hybridrl_cpu_layer_wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


# --------------------------------------------------------------------------------------------------
# RNG tracker on the CPU generator
# --------------------------------------------------------------------------------------------------
def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """Stand-in for megatron's `random._get_cuda_rng_state`: the CPU default generator's state."""
    return torch.default_generator.get_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    """Stand-in for megatron's `random._set_cuda_rng_state`, on the CPU default generator."""
    torch.default_generator.set_state(new_state)


def _make_cpu_tracker_class() -> type:
    from megatron.core.tensor_parallel import random as mrandom

    base = getattr(mrandom.CudaRNGStatesTracker, "__hybridrl_cpu_base__", mrandom.CudaRNGStatesTracker)

    class CpuRNGStatesTracker(base):  # type: ignore[misc, valid-type]
        """megatron's named RNG streams, kept as states of the CPU default generator.

        `add(name, seed)` records the state the CPU generator has after `manual_seed(seed)`;
        `fork(name)` swaps that state in for the block and stores where it ended, exactly as the
        CUDA tracker does with the CUDA generator. Nested forks restore the outer stream.
        """

        __hybridrl_cpu_base__ = base

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            generator = torch.Generator(device="cpu")
            generator.manual_seed(seed)
            self.states_[name] = generator.get_state()

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer_name = self._current_state_name
            outer_state = torch.default_generator.get_state()
            if outer_name != "default-rng":
                self.states_[outer_name] = outer_state
            torch.default_generator.set_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                if self._current_state_name != name:
                    raise Exception(
                        f"rng state {self._current_state_name} is current, expected {name}"
                    )
                self.states_[name] = torch.default_generator.get_state()
                if outer_name != "default-rng":
                    outer_state = self.states_[outer_name]
                torch.default_generator.set_state(outer_state)
                self._current_state_name = outer_name

    return CpuRNGStatesTracker


# --------------------------------------------------------------------------------------------------
# Patch registry
# --------------------------------------------------------------------------------------------------
@dataclass
class _Patch:
    name: str
    why: str
    apply: Callable[[], None]
    revert: Callable[[], None]
    active: bool = False


@dataclass
class _LayerState:
    patches: dict[str, _Patch] = field(default_factory=dict)
    saved: dict[str, Any] = field(default_factory=dict)


_state = _LayerState()
_thread_modes = threading.local()  # the CudaToCpuMode this thread pushed, if any


def _apply_cuda_current_device() -> None:
    _state.saved["torch.cuda.current_device"] = torch.cuda.current_device
    torch.cuda.current_device = lambda: 0  # type: ignore[assignment]


def _revert_cuda_current_device() -> None:
    torch.cuda.current_device = _state.saved.pop("torch.cuda.current_device")  # type: ignore[assignment]


def _apply_cuda_to_cpu_mode() -> None:
    _push_mode_in_this_thread()


def _push_mode_in_this_thread() -> None:
    # Torch function modes live on a per-thread stack: each thread that runs megatron code needs its
    # own push (apply_cpu_layer() does it for the calling thread).
    if not _mode_in_this_thread():
        from hybridrl.parallel.cpu.strict_device import mode_class

        mode = mode_class()()
        mode.__enter__()
        _thread_modes.mode = mode


@contextlib.contextmanager
def cuda_to_cpu_mode_suspended() -> Iterator[None]:
    """Run code that never calls megatron (vLLM's CPU engine) without the mode's per-op dispatch.

    The mode costs ~1 us of Python per torch call; a decode step of vLLM makes hundreds of small
    calls, so on small models generation pays for a translation it never needs. Suspends only when
    this thread's mode is the innermost one (else leaves the stack alone).
    """
    from torch.overrides import _get_current_function_mode_stack

    mode = getattr(_thread_modes, "mode", None)
    stack = _get_current_function_mode_stack()
    if mode is None or not stack or stack[-1] is not mode:
        yield
        return
    _revert_cuda_to_cpu_mode()
    try:
        yield
    finally:
        _push_mode_in_this_thread()


def _revert_cuda_to_cpu_mode() -> None:
    mode = getattr(_thread_modes, "mode", None)
    _thread_modes.mode = None
    if mode is not None:
        mode.__exit__(None, None, None)


def _apply_cpu_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    _state.saved["rng"] = (
        mrandom.CudaRNGStatesTracker, mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state,
    )
    # initialize_rng_tracker() and get_all_rng_states() look the class up by module global at call
    # time, so replacing the global is enough for megatron's own seeding code to build ours.
    mrandom.CudaRNGStatesTracker = _make_cpu_tracker_class()
    mrandom._get_cuda_rng_state = _cpu_get_rng_state
    mrandom._set_cuda_rng_state = _cpu_set_rng_state
    mrandom.initialize_rng_tracker(force_reset=True)


def _revert_cpu_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    cls, get_state, set_state = _state.saved.pop("rng")
    mrandom.CudaRNGStatesTracker = cls
    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state
    mrandom.initialize_rng_tracker(force_reset=True)


def _type_check_targets() -> list[tuple[Any, str]]:
    from megatron.core.optimizer import clip_grads, distrib_optimizer
    from megatron.core.optimizer import optimizer as moptimizer

    return [
        (clip_grads, "clip_grad_by_total_norm_fp32"),
        # optimizer.py imported the function by name: its global must be swapped as well.
        (moptimizer, "clip_grad_by_total_norm_fp32"),
        (distrib_optimizer.DistributedOptimizer, "__init__"),
        (moptimizer.Float16OptimizerWithFloat16Params, "__init__"),
    ]


def _apply_cuda_type_names() -> None:
    saved = []
    for owner, attr in _type_check_targets():
        original = getattr(owner, attr)
        saved.append((owner, attr, original))
        setattr(owner, attr, _with_cuda_type_names(original))
    _state.saved["type_names"] = saved


def _revert_cuda_type_names() -> None:
    for owner, attr, original in _state.saved.pop("type_names"):
        setattr(owner, attr, original)


def _apply_cuda_synchronize() -> None:
    _state.saved["torch.cuda.synchronize"] = torch.cuda.synchronize
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]


def _revert_cuda_synchronize() -> None:
    torch.cuda.synchronize = _state.saved.pop("torch.cuda.synchronize")  # type: ignore[assignment]


def _cpu_dtoh_and_synchronize(self: Any, point: str, tokens_per_expert: Any = None) -> Any:
    """`MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize` without CUDA streams.

    On GPU it copies the split sizes (as numpy arrays) and the token counts to the host on a side
    stream at `cuda_dtoh_point` and waits for that copy at `cuda_sync_point`. On CPU there is no
    stream to wait for: the same tensors move to the host (a copy under strict-device mode, which then
    sees them as host tensors, as they are on GPU), so the all-to-all and the permutation receive the
    same kind of values as on GPU.
    """
    if self.drop_and_pad or point != self.cuda_dtoh_point:
        return tokens_per_expert
    for attr in ("input_splits", "output_splits", "output_splits_tp"):
        value = getattr(self, attr)
        if torch.is_tensor(value):
            setattr(self, attr, value.to("cpu").numpy())
    moved = ["num_out_tokens"]
    if self.num_local_experts > 1 and not self.config.moe_permute_fusion:
        moved.append("num_global_tokens_per_local_expert")
    for attr in moved:
        value = getattr(self, attr, None)
        if torch.is_tensor(value):
            setattr(self, attr, value.to("cpu"))
    return tokens_per_expert.to("cpu") if torch.is_tensor(tokens_per_expert) else tokens_per_expert


def _apply_moe_alltoall_streams() -> None:
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as dispatcher

    _state.saved["moe_alltoall"] = (dispatcher.__dict__.get("cuda_dtoh_stream"),
                                    dispatcher._maybe_dtoh_and_synchronize)
    # Not None: the dispatcher's __init__ creates a torch.cuda.Stream() only while this is None.
    dispatcher.cuda_dtoh_stream = "cpu: no streams"
    dispatcher._maybe_dtoh_and_synchronize = _cpu_dtoh_and_synchronize


def _revert_moe_alltoall_streams() -> None:
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as dispatcher

    stream, method = _state.saved.pop("moe_alltoall")
    dispatcher.cuda_dtoh_stream = stream
    dispatcher._maybe_dtoh_and_synchronize = method


def _cpu_gather_along_first_dim(input_: torch.Tensor, group: Any, output_split_sizes: Any = None,
                                use_global_buffer: bool = False) -> torch.Tensor:
    """`mappings._gather_along_first_dim` whose split sizes gloo can serve: every rank's part padded to
    the largest, gathered equally, the padding cut off."""
    from megatron.core.tensor_parallel import mappings

    original = _state.saved["uneven_gather"]
    if output_split_sizes is None or group.size() == 1:
        return original(input_, group, output_split_sizes, use_global_buffer)
    sizes = [int(n) for n in output_split_sizes]
    width = max(sizes)
    padded = input_.new_zeros((width, *input_.shape[1:]))
    padded[: input_.shape[0]] = input_
    gathered = torch.empty((width * group.size(), *input_.shape[1:]), dtype=input_.dtype, device=input_.device)
    mappings.dist_all_gather_func(gathered, padded, group=group)
    return torch.cat([gathered[r * width: r * width + n] for r, n in enumerate(sizes)])


def _cpu_reduce_scatter_along_first_dim(input_: torch.Tensor, group: Any, input_split_sizes: Any = None,
                                        use_global_buffer: bool = False) -> torch.Tensor:
    """`mappings._reduce_scatter_along_first_dim` whose split sizes gloo can serve: each destination's
    part padded to the largest, reduce-scattered equally, this rank's part cut to its size."""
    from megatron.core.tensor_parallel import mappings

    original = _state.saved["uneven_reduce_scatter"]
    if input_split_sizes is None or group.size() == 1:
        return original(input_, group, input_split_sizes, use_global_buffer)
    sizes = [int(n) for n in input_split_sizes]
    width = max(sizes)
    padded = input_.new_zeros((width * group.size(), *input_.shape[1:]))
    for r, part in enumerate(torch.split(input_, sizes, dim=0)):
        padded[r * width: r * width + part.shape[0]] = part
    out = torch.empty((width, *input_.shape[1:]), dtype=input_.dtype, device=input_.device)
    mappings.dist_reduce_scatter_func(out, padded, group=group)
    return out[: sizes[group.rank()]]


def _apply_uneven_gather_scatter() -> None:
    from megatron.core.tensor_parallel import mappings

    _state.saved["uneven_gather"] = mappings._gather_along_first_dim
    _state.saved["uneven_reduce_scatter"] = mappings._reduce_scatter_along_first_dim
    mappings._gather_along_first_dim = _cpu_gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = _cpu_reduce_scatter_along_first_dim


def _revert_uneven_gather_scatter() -> None:
    from megatron.core.tensor_parallel import mappings

    mappings._gather_along_first_dim = _state.saved.pop("uneven_gather")
    mappings._reduce_scatter_along_first_dim = _state.saved.pop("uneven_reduce_scatter")


def _build_patches() -> dict[str, _Patch]:
    specs = [
        ("cuda_current_device", "torch.cuda.current_device() asserts without CUDA; megatron allocates "
         "with it", _apply_cuda_current_device, _revert_cuda_current_device),
        ("cuda_to_cpu_mode", "hard-coded device='cuda' / device index allocations in megatron",
         _apply_cuda_to_cpu_mode, _revert_cuda_to_cpu_mode),
        ("cpu_rng_tracker", "megatron's model-parallel RNG tracker stores CUDA generator states",
         _apply_cpu_rng_tracker, _revert_cpu_rng_tracker),
        ("cuda_type_names", "clip_grads and the (distributed/fp16) optimizers check tensor.type() "
         "against torch.cuda.* names", _apply_cuda_type_names, _revert_cuda_type_names),
        ("cuda_synchronize", "the pipeline's shape exchange (variable_seq_lengths) calls torch.cuda.synchronize()",
         _apply_cuda_synchronize, _revert_cuda_synchronize),
        ("moe_alltoall_streams", "the MoE alltoall token dispatcher makes a torch.cuda.Stream and copies "
         "its split sizes to the host on it", _apply_moe_alltoall_streams, _revert_moe_alltoall_streams),
        ("uneven_gather_scatter", "the MoE alltoall dispatcher gathers and reduce-scatters unequal parts over the "
         "expert TP group, which gloo refuses", _apply_uneven_gather_scatter, _revert_uneven_gather_scatter),
    ]
    return {name: _Patch(name, why, apply, revert) for name, why, apply, revert in specs}


PATCHES: tuple[str, ...] = (
    "cuda_current_device", "cuda_to_cpu_mode", "cpu_rng_tracker", "cuda_type_names", "cuda_synchronize",
    "moe_alltoall_streams", "uneven_gather_scatter",
)


def apply_cpu_layer(skip: Iterable[str] = ()) -> list[str]:
    """Install the CPU layer in this process (idempotent); return the names of active patches.

    `skip` leaves named patches out; it exists so tests can show what each patch is needed for.
    """
    skip = set(skip)
    unknown = skip - set(PATCHES)
    if unknown:
        raise ValueError(f"unknown CPU-layer patches {sorted(unknown)}; known: {list(PATCHES)}")
    check_megatron_version()
    from hybridrl.parallel.cpu.strict_device import enable_strict_device, strict_device_requested

    if strict_device_requested():
        enable_strict_device()  # before megatron creates its groups: they are classified at creation
    if not _state.patches:
        _state.patches = _build_patches()
    for name in PATCHES:
        patch = _state.patches[name]
        if name in skip or patch.active:
            continue
        patch.apply()
        patch.active = True
    if _state.patches["cuda_to_cpu_mode"].active:
        _push_mode_in_this_thread()  # a later call from another thread covers that thread
    return active_patches()


def remove_cpu_layer(names: Iterable[str] | None = None) -> None:
    """Undo the named active patches (default: all), in reverse order (tests; a training process
    keeps the layer)."""
    chosen = set(PATCHES if names is None else names)
    unknown = chosen - set(PATCHES)
    if unknown:
        raise ValueError(f"unknown CPU-layer patches {sorted(unknown)}; known: {list(PATCHES)}")
    for name in reversed(PATCHES):
        if name not in chosen:
            continue
        patch = _state.patches.get(name)
        if patch is not None and patch.active:
            patch.revert()
            patch.active = False


def active_patches() -> list[str]:
    """Names of the patches currently installed, in `PATCHES` order."""
    return [name for name in PATCHES if name in _state.patches and _state.patches[name].active]


def cpu_layer_active() -> bool:
    """True when every patch of the CPU layer is installed and the mode is on this thread's stack."""
    return active_patches() == list(PATCHES) and _mode_in_this_thread()


def describe_patches() -> dict[str, str]:
    """{patch name: why it exists}, for logs and docs."""
    patches = _state.patches or _build_patches()
    return {name: patches[name].why for name in PATCHES}


def check_config_for_cpu(config: Any) -> None:
    """Raise ValueError listing every megatron config flag that cannot work on CPU.

    `apply_rope_fusion=True` is fine once hybridrl's CPU RoPE fills megatron's fused slot
    (`hybridrl.parallel.cpu.rope.install_cpu_fused_rope`), `gradient_accumulation_fusion=True` once
    the weight-gradient stand-in fills Apex's (`hybridrl.parallel.cpu.wgrad.install_cpu_wgrad_fusion`)."""
    served = ({"apply_rope_fusion"} if cpu_fused_rope_installed() else set()) | (
        {"gradient_accumulation_fusion"} if cpu_wgrad_fusion_installed() else set())
    wrong = [
        f"{key}={getattr(config, key)!r} (needs {value!r})"
        for key, value in CPU_CONFIG_OVERRIDES.items()
        if hasattr(config, key) and getattr(config, key) != value and key not in served
    ]
    if wrong:
        raise ValueError(
            "megatron config is not CPU-compatible: " + ", ".join(wrong)
            + ". Use hybridrl.parallel.cpu.layer.CPU_CONFIG_OVERRIDES when building the config."
        )
