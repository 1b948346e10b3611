"""A rank's random streams, saved with a role checkpoint and restored on resume.

The streams are torch's, python's, numpy's, megatron's model-parallel tracker's and, on CUDA, the
device generator's. They are per rank and cannot be mapped across layouts: which saved rank's
streams a rank takes on another layout is `checkpointing._source_rank`'s choice.
"""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from hybridrl.parallel.device_policy import DevicePolicy


def rng_state(policy: DevicePolicy) -> dict[str, Any]:
    from megatron.core import tensor_parallel

    # legacy=True is numpy's default, spelled out: numpy's stubs type the bare call as the dict form
    legacy = np.random.get_state(legacy=True)
    if not isinstance(legacy, tuple):
        raise TypeError("numpy's global random state is not MT19937 (no legacy state tuple): it cannot be saved")
    kind, keys, pos, has_gauss, cached = legacy
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
        "tracker": {k: v.clone() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()},
    }
    if policy.device_rng:
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def load_rng_state(state: dict[str, Any], policy: DevicePolicy) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if policy.device_rng and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
