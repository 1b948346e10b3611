"""The CPU stand-in for Apex's weight-gradient accumulation kernel (megatron's gradient_accumulation_fusion),
against plain torch. Its use inside a trained actor, gradients against transformers, is
tests/training/test_tied_pp2_update.py (one stage and PP2, tied embedding)."""
from types import SimpleNamespace

import pytest
import torch

from hybridrl.parallel.cpu import layer as cpu_layer
from hybridrl.parallel.cpu.wgrad import (
    CPU_WGRAD_MODULE,
    cpu_wgrad_fusion_installed,
    install_cpu_wgrad_fusion,
    wgrad_gemm_accum,
)


def test_accumulates_the_weight_gradient_into_main_grad():
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(37, 24, generator=gen) for _ in range(3)]
    grads = [torch.randn(37, 40, generator=gen) for _ in range(3)]
    main_grad = torch.randn(40, 24, generator=gen)
    expected = main_grad.double() + sum(g.double().t() @ x.double() for g, x in zip(grads, inputs))
    for x, g in zip(inputs, grads):  # three micro-batches
        wgrad_gemm_accum(x, g, main_grad)
    assert main_grad.dtype == torch.float32
    torch.testing.assert_close(main_grad.double(), expected, rtol=1e-6, atol=1e-5)
    # 16-bit activations into an fp32 main grad: the product in their dtype, added in fp32
    x16, g16 = inputs[0].bfloat16(), grads[0].bfloat16()
    fp32 = torch.zeros(40, 24)
    wgrad_gemm_accum(x16, g16, fp32)
    torch.testing.assert_close(fp32, (g16.t() @ x16).float(), rtol=0, atol=0)
    # a 16-bit main grad (megatron's wgrad_gemm_accum_fp16 entry point)
    bf16 = torch.zeros(40, 24, dtype=torch.bfloat16)
    wgrad_gemm_accum(x16, g16, bf16)
    torch.testing.assert_close(bf16.float(), (g16.float().t() @ x16.float()), rtol=2e-2, atol=5e-2)


def test_install_fills_megatrons_slot_and_lets_the_flag_pass_the_cpu_check(monkeypatch):
    from megatron.core.tensor_parallel import layers

    # megatron as imported without Apex: no module, the flag refused on CPU
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", False)
    monkeypatch.delattr(layers, "fused_weight_gradient_mlp_cuda", raising=False)
    fused = SimpleNamespace(**{**cpu_layer.CPU_CONFIG_OVERRIDES, "gradient_accumulation_fusion": True})
    assert not cpu_wgrad_fusion_installed()
    with pytest.raises(ValueError, match="gradient_accumulation_fusion=True"):
        cpu_layer.check_config_for_cpu(fused)
    assert install_cpu_wgrad_fusion() and install_cpu_wgrad_fusion()  # idempotent
    assert layers.fused_weight_gradient_mlp_cuda is CPU_WGRAD_MODULE and layers._grad_accum_fusion_available
    assert CPU_WGRAD_MODULE.wgrad_gemm_accum_fp32 is CPU_WGRAD_MODULE.wgrad_gemm_accum_fp16 is wgrad_gemm_accum
    cpu_layer.check_config_for_cpu(fused)
    # Apex's own module, where installed, stays (its CUDA kernel cannot take CPU tensors: not served)
    apex = SimpleNamespace()
    monkeypatch.setattr(layers, "fused_weight_gradient_mlp_cuda", apex)
    assert not install_cpu_wgrad_fusion() and layers.fused_weight_gradient_mlp_cuda is apex
