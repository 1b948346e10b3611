"""The CPU stand-ins: what lets real megatron-core run on a CPU where a CUDA, TransformerEngine or Apex kernel
cannot exist (the CPU layer and its fused-kernel slots: attention, RoPE, norm, weight-gradient accumulation, fp32
matmuls through oneDNN) and strict-device mode, the CPU suite's guard for the GPU path.

Nothing on the CUDA path imports this package: the modules that serve both devices import it inside the branch
the device policy sends CPU jobs down (`tests/test_import_layers.py` checks both the source and a fresh process).
"""
