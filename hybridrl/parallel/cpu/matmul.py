"""fp32 matmuls through oneDNN on CPU, where that keeps fp32 arithmetic (verified, not assumed).

torch sends fp32 matmuls to MKL. On non-Intel CPUs MKL takes a generic path: on this project's AMD
machines one core reaches ~105 GFLOP/s in fp32, while oneDNN (which torch already uses for bf16,
and vLLM for fp32 too) reaches ~230 on the same shapes. torch routes fp32 matmuls to oneDNN only
when `torch.backends.mkldnn.matmul.fp32_precision` permits bf16 arithmetic ("bf32"); oneDNN has
bf32 kernels only for CPUs with AMX, and computes in plain fp32 elsewhere. So the route is taken
only after a probe shows fp32 results on this machine: sums of 1 + 2^-10, which bf16 rounds to 1.
On a CPU where oneDNN would use bf16 math the probe fails and matmuls stay on MKL.

Numerics: fp32 either way; only the summation order inside a GEMM differs (results move by a few
fp32 ulps). The megatron workers on CPU enable it (`hybridrl.parallel.state.initialize_model_parallel`).

The setting (`torch.backends.mkldnn.matmul.fp32_precision`) exists from torch 2.9 on; with an older
torch (the GPU stack pins whatever vLLM pins) there is nothing to route or preserve, and fp32
matmuls stay on MKL: read it through `onednn_matmul_setting()`.
"""
from __future__ import annotations

from typing import Any

import torch

_EXACT_BIT = 2.0**-10  # exact in fp32; a bf16 mantissa (7 bits) rounds 1 + 2^-10 to 1


def probe_products(input_dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, float]]:
    """The matmul forms training uses (linear forward, input grad, weight grad, batched) at small
    and GEMM-sized shapes, each with the exact fp32 value every output element must have.
    `input_dtype` rounds the inputs first (bf16 shows what the probe catches)."""
    exact = 1.0 + _EXACT_BIT
    one_plus = float(torch.tensor(exact).to(input_dtype))
    out = []
    for rows in (1, 64, 300):
        for depth in (64, 512):
            x = torch.full((rows, depth), one_plus)
            w = torch.ones(48, depth)
            out.append((torch.nn.functional.linear(x, w), depth * exact))       # x @ w.T
            out.append((x.t().matmul(torch.ones(rows, 40)), rows * exact))      # weight grad: x.T @ g
            out.append((torch.ones(40, rows).matmul(x), rows * exact))          # input grad: g @ w
    batched = torch.full((4, 70, 64), one_plus)
    out.append((torch.bmm(batched, torch.ones(4, 64, 70)), 64 * exact))
    return out


def all_exact(products: list[tuple[torch.Tensor, float]]) -> bool:
    return all(bool((result == expected).all()) for result, expected in products)


def onednn_matmul_setting() -> Any | None:
    """`torch.backends.mkldnn.matmul` (its `fp32_precision` chooses the oneDNN route), None on a torch
    without it (before 2.9)."""
    setting = getattr(torch.backends.mkldnn, "matmul", None)
    return setting if setting is not None and hasattr(setting, "fp32_precision") else None


def onednn_fp32_is_exact() -> bool:
    """Whether fp32 matmuls keep fp32 arithmetic with the oneDNN route enabled (restores the setting);
    False where torch has no such route."""
    setting = onednn_matmul_setting()
    if setting is None:
        return False
    previous = setting.fp32_precision
    try:
        setting.fp32_precision = "bf16"
        return all_exact(probe_products())
    finally:
        setting.fp32_precision = previous


def route_fp32_matmul_to_onednn() -> bool:
    """Send this process's fp32 matmuls to oneDNN when the probe shows it keeps fp32 arithmetic.

    Returns whether the route is on. Process-wide (torch's global context); a no-op without mkldnn
    or on a torch without the setting (fp32 matmuls then stay on MKL: correct, slower).
    """
    setting = onednn_matmul_setting()
    if setting is None or not torch.backends.mkldnn.is_available() or not onednn_fp32_is_exact():
        return False
    setting.fp32_precision = "bf16"
    return True
