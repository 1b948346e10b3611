"""Python's garbage collector over a process that imported torch, megatron-core and vLLM (~660k objects).

A full collection walks every tracked object (0.4 s here over that heap), and vLLM's engine build runs three. What a
process imported and built to serve its rank lives as long as the process: frozen (`gc.freeze`), every later
collection skips it. Used by the rollout engine (before vLLM's build), the workers' bring-up calls
(`controller.base_worker`) and the test session's rank server (`tests/support/frozen_heap.py`).
"""
from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


def freeze_heap() -> None:
    """Collect, then freeze what is alive: the garbage first, because a frozen cycle is never freed (and may hold
    device memory)."""
    gc.collect()
    gc.freeze()


@contextmanager
def built_without_collections() -> Iterator[None]:
    """Python's automatic garbage collection paused while a worker builds its parts, then `freeze_heap`.

    A bring-up imports megatron-core and vLLM and builds the model and the engine; the collector walked the growing
    heap again and again meanwhile: measured in a fresh process as a worker runs it (the worker module imported
    first, as Ray does), those imports and a tiny model's engine took 9.3-12.0 CPU-s with it and 8.0-9.1 without.
    What is alive once the worker is built lives as long as the worker (vLLM's engine build ends with the same
    freeze). Explicit `gc.collect()` calls (vLLM's) still run while paused. Nested (a `setup` calling
    `init_model`) or with collection already off, nothing changes."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        freeze_heap()
        gc.enable()
