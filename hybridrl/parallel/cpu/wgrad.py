"""Megatron's gradient-accumulation fusion on CPU: a stand-in for Apex's `fused_weight_gradient_mlp_cuda`.

In a trained megatron model every linear layer's weight gradient ends in the DDP's fp32 `main_grad`.
Without the fusion, the layer's backward makes `grad_weight = grad_output^T @ input` (a new [out, in]
tensor), autograd hands it to DDP's hook, and the hook adds it into `main_grad` and drops it: per
weight and micro-batch an allocation, a GEMM writing it and an add pass reading it again. With
`gradient_accumulation_fusion=True` megatron's `LinearWithGradAccumulationAndAsyncCommunication`
calls Apex's CUDA kernel `wgrad_gemm_accum_fp32(input, grad_output, main_grad)` instead, a GEMM that
accumulates straight into `main_grad` (and marks the weight `grad_added_to_main_grad`, so the hook
adds nothing; a tied embedding on one stage is `zero_out_wgrad` and still gets its lookup's grad).

That kernel cannot exist here; the functions below are the same operation in torch
(`main_grad.addmm_(grad_output^T, input)`: one GEMM with beta = 1, no intermediate tensor). Measured at
SmolLM2-135M's shapes on one core (~290 tokens a micro-batch): a stage's weight gradients of one
micro-batch, GEMM and add, 508 -> 443 ms, most of it on the vocab head (165 -> 148 ms); the whole
update (`bench/update_profile.py`, shared prompts, A/B on one day) 16.05 -> 15.87 s at PP2 (18 + 12)
and 15.34 -> 14.97 s at DP2, CPU seconds 28.3 -> 27.2 and 29.5 -> 28.8. The sums are
rounded once instead of twice, so gradients differ from the unfused path's within fp32 rounding
(`tests/parallel/test_cpu_wgrad.py` checks both paths against plain torch).

`install_cpu_wgrad_fusion()` fills megatron's module slot where Apex is absent; the training backend
calls it and sets the flag for trained roles only (the fusion needs DDP's `main_grad`), where the
device policy says so (`DevicePolicy.wgrad_accumulation_fusion`).
"""
from __future__ import annotations

import types

import torch


def wgrad_gemm_accum(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """main_grad += grad_output^T @ total_input (2-D: [tokens, in], [tokens, out], [out, in]; Apex's
    argument order). Serves both of Apex's entry points. Where the activations' dtype is the main
    grad's (fp32 training) it is one accumulating GEMM; 16-bit activations into an fp32 main grad
    take the unfused path's product and add (torch's GEMM cannot mix the dtypes)."""
    if grad_output.dtype == total_input.dtype == main_grad.dtype:
        main_grad.addmm_(grad_output.t(), total_input)
    else:
        main_grad.add_(grad_output.t().matmul(total_input))


# The stand-in's module: megatron reads these two names from it.
CPU_WGRAD_MODULE = types.SimpleNamespace(
    __name__="hybridrl.parallel.cpu.wgrad (stand-in for fused_weight_gradient_mlp_cuda)",
    wgrad_gemm_accum_fp32=wgrad_gemm_accum,
    wgrad_gemm_accum_fp16=wgrad_gemm_accum,
)


def install_cpu_wgrad_fusion() -> bool:
    """Put the stand-in in megatron's `fused_weight_gradient_mlp_cuda` slot (idempotent); True when
    megatron's layers can then run with `gradient_accumulation_fusion=True`. Apex's own module, where
    installed, is left in place (and False returned: its CUDA kernel cannot run on CPU tensors)."""
    from megatron.core.tensor_parallel import layers

    if not layers._grad_accum_fusion_available:
        layers.fused_weight_gradient_mlp_cuda = CPU_WGRAD_MODULE
        layers._grad_accum_fusion_available = True
    return cpu_wgrad_fusion_installed()


def cpu_wgrad_fusion_installed() -> bool:
    from megatron.core.tensor_parallel import layers

    return getattr(layers, "fused_weight_gradient_mlp_cuda", None) is CPU_WGRAD_MODULE
