"""Training state off the accelerator between phases (actor options `megatron.optimizer_offload`, `grad_offload`).

In the colocated placement the actor's optimizer states and gradient buffers are idle during generation,
log-prob passes and the weight sync, yet Adam's two moments alone are 8 bytes per parameter (fp32),
more than bf16 weights and KV cache need. Between phases they can leave the GPU:

  - optimizer states (`OptimizerStateOffload`): every tensor in the inner torch optimizers' `state`
    (Adam's exp_avg / exp_avg_sq, step counters) is replaced by a copy on the store device (CPU) after
    the update, and by a copy on its original device before the next `step()`. This is what
    megatron-core 0.16's own `MegatronOptimizer.offload_to_cpu` does to `state`; that method is not used
    because it also moves `param_groups` params with `p.data = p.data.cpu()`, which for the fp32
    optimizer are the model's own parameters (generation and log-probs would then run on CPU
    weights), and because it is CUDA-only (`.cuda()`), so it could never be exercised on CPU. The
    fp32 main params of the bf16 optimizers stay resident (4 bytes per parameter): in the distributed
    optimizer some are views into the model's parameters and must not move.
  - gradient buffers: megatron's `DistributedDataParallel.offload_grad_buffers` frees the contiguous
    grad buffer's storage (views stay valid) and `restore_grad_buffers` reallocates it zeroed;
    gradients are zeroed before every step anyway, so nothing is copied.

  - parameters of a trained role (`ParamStorageOffload`, `megatron.param_offload` on the colocated actor, verl's
    meaning): idle while vLLM generates, they are copied to host memory after the weight sync and each distinct
    storage (DDP's contiguous param buffer with the distributed optimizer, else each parameter's own) is
    resized to zero; every view (the Parameters, the distributed optimizer's shards) stays valid and sees the
    same bytes again after `reload`, which the worker calls before anything reads them. verl offloads the same
    way (the param buffer's storage resized to 0).
"""
from __future__ import annotations

from typing import Any

import torch

from hybridrl.parallel.device_policy import DevicePolicy


def inner_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a megatron optimizer (chained or single; stub parts skipped)."""
    parts = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    return [p.optimizer for p in parts
            if getattr(p, "optimizer", None) is not None and not getattr(p, "is_stub_optimizer", False)]


class OptimizerStateOffload:
    """Moves a megatron optimizer's state tensors to `store` and back to where each one lived."""

    def __init__(self, optimizer: Any, store: str | torch.device = "cpu") -> None:
        self.optimizer = optimizer
        self.store = torch.device(store)
        # (param, state key) -> the device the tensor lived on before offloading
        self._homes: dict[tuple[int, str], torch.device] = {}
        self.offloaded = False

    def _entries(self) -> list[tuple[torch.Tensor, dict[str, Any]]]:
        return [(param, state) for inner in inner_optimizers(self.optimizer) for param, state in inner.state.items()]

    def offload(self) -> int:
        """Copy every state tensor to the store device; returns the bytes moved. Idempotent."""
        if self.offloaded:
            return 0
        moved, pin = 0, False
        for param, state in self._entries():
            for key, value in state.items():
                if not isinstance(value, torch.Tensor):
                    continue
                self._homes[(id(param), key)] = value.device
                copy = value.to(self.store, copy=True)
                # pinned host memory makes the copy back an async DMA instead of a staged one
                if value.is_cuda and self.store.type == "cpu":
                    copy, pin = copy.pin_memory(), True
                state[key] = copy
                moved += value.numel() * value.element_size()
        if pin:
            torch.cuda.empty_cache()  # return the freed blocks so vLLM's wake-up can take them
        self.offloaded = True
        return moved

    def reload(self) -> int:
        """Copy every offloaded state tensor back to its own device; returns the bytes moved. Idempotent.

        Entries a checkpoint load replaced meanwhile (torch puts loaded state on the param's device) are
        left as they are."""
        if not self.offloaded:
            return 0
        moved = 0
        for param, state in self._entries():
            for key, value in state.items():
                home = self._homes.get((id(param), key))
                if home is None or not isinstance(value, torch.Tensor) or value.device != self.store:
                    continue
                state[key] = value.to(home, copy=True, non_blocking=value.is_pinned())
                moved += value.numel() * value.element_size()
        self._homes.clear()
        self.offloaded = False
        return moved


def offload_grad_buffers(models: list[Any], policy: DevicePolicy) -> None:
    """Free the DDP grad buffers' storage (megatron-core's API; device sync and cache release as the
    device policy says: on GPUs only)."""
    for model in models:
        model.offload_grad_buffers(synchronize=policy.synchronize_on_offload,
                                   empty_cache=policy.empty_cache_on_offload)


def restore_grad_buffers(models: list[Any], policy: DevicePolicy) -> None:
    """Reallocate the DDP grad buffers (zeroed), before the next backward pass."""
    for model in models:
        model.restore_grad_buffers(synchronize=policy.synchronize_on_offload)


class ParamStorageOffload:
    """Moves the storages under `params` to host memory and back, the tensors' identities untouched (module
    docstring). On a host device the copy saves nothing but keeps the path exercised: a reader that skipped
    `reload` sees zero-size storage and fails, not stale weights."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self._host: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] = []
        self.offloaded = False

    def offload(self) -> int:
        """Copy each distinct storage to host memory and free it; returns the bytes moved. Idempotent."""
        if self.offloaded:
            return 0
        storages: dict[int, torch.UntypedStorage] = {}
        for param in self.params:  # distinct by address, read before any is resized (then all are 0)
            storage = param.untyped_storage()
            if storage.nbytes():
                storages.setdefault(storage.data_ptr(), storage)
        moved = 0
        for storage in storages.values():
            host = torch.UntypedStorage(storage.nbytes(), device="cpu")
            if storage.device.type == "cuda":
                host = host.pin_memory()
            host.copy_(storage)
            self._host.append((storage, host))
            storage.resize_(0)
            moved += host.nbytes()
        if any(storage.device.type == "cuda" for storage, _ in self._host):
            torch.cuda.empty_cache()  # return the freed blocks so vLLM's wake-up can take them
        self.offloaded = True
        return moved

    def reload(self) -> int:
        """Reallocate each storage on its device and copy its bytes back; returns the bytes moved. Idempotent."""
        if not self.offloaded:
            return 0
        moved = 0
        for storage, host in self._host:
            storage.resize_(host.nbytes())
            storage.copy_(host, non_blocking=host.is_pinned())
            moved += host.nbytes()
        self._host.clear()
        self.offloaded = False
        return moved

