"""The device policy: every cuda/cpu difference as a named field, values written out by hand."""
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridrl.config import plan_from_sources
from hybridrl.config.plan import Plan
from hybridrl.parallel.device_policy import (
    CPU,
    CPU_WORKER_TORCH_LOGS,
    CPU_WORKER_WARNINGS,
    CUDA,
    DEVICE_POLICIES,
    DevicePolicy,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "configs" / "examples"

CUDA_FIELDS = {
    "name": "cuda", "dist_backend": "nccl", "default_train_dtype": "bf16", "default_rollout_dtype": "bf16",
    "ray_use_gpu": True, "ray_cpus_per_worker": 1.0, "ray_min_cluster_cpus": None,
    "megatron_cpu_layer": False, "transformer_engine_possible": True, "packed_attention": "transformer_engine",
    "shared_prefix_attention": False,
    "params_on_host": False,
    "synchronize_on_offload": True, "empty_cache_on_offload": True, "gpu_memory_budget_binding": True,
    "vllm_honours_enforce_eager": True, "vllm_repacks_weights": False, "vllm_kv_cache_from_plan": False,
    "vllm_sleep_mode": True,
    "vllm_chunked_prefill": True,
    "vllm_moe_backend": "triton",
    "vllm_top_k_keeps_ties": False,
    "vllm_attention_head_dims": None,
    "device_rng": True,
    "worker_env": (("CUDA_DEVICE_MAX_CONNECTIONS", "1"),),
    "flush_denormals": False, "reshard_keeps_buffers": False, "optimizer_state_at_setup": False,
    "wgrad_accumulation_fusion": None, "megatron_speed_defaults": True,
}
CPU_FIELDS = {
    "name": "cpu", "dist_backend": "gloo", "default_train_dtype": "fp32", "default_rollout_dtype": "fp32",
    "ray_use_gpu": False, "ray_cpus_per_worker": 0.5, "ray_min_cluster_cpus": 4,
    "megatron_cpu_layer": True, "transformer_engine_possible": False, "packed_attention": "cpu_stand_in",
    "shared_prefix_attention": True,
    "params_on_host": True,
    "synchronize_on_offload": False, "empty_cache_on_offload": False, "gpu_memory_budget_binding": False,
    "vllm_honours_enforce_eager": False, "vllm_repacks_weights": True, "vllm_kv_cache_from_plan": True,
    "vllm_sleep_mode": False,
    "vllm_chunked_prefill": False,
    "vllm_moe_backend": "auto",
    "vllm_top_k_keeps_ties": True,
    "vllm_attention_head_dims": (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512),
    "device_rng": False,
    "worker_env": (("MALLOC_MMAP_MAX_", "0"), ("MALLOC_TRIM_THRESHOLD_", str(1 << 40)),
                   ("PYTHONWARNINGS", CPU_WORKER_WARNINGS), ("TORCH_LOGS", CPU_WORKER_TORCH_LOGS)),
    "flush_denormals": True,
    "reshard_keeps_buffers": True, "optimizer_state_at_setup": True,
    "wgrad_accumulation_fusion": "cpu_stand_in", "megatron_speed_defaults": False,
}


@pytest.mark.parametrize("name, expected", [("cuda", CUDA_FIELDS), ("cpu", CPU_FIELDS)])
def test_each_field_of_each_device(name, expected):
    policy = DevicePolicy.for_device(name)
    # every field is listed above: a new field must be given its value here too
    assert dataclasses.asdict(policy) == expected
    assert policy is {"cuda": CUDA, "cpu": CPU}[name]


def test_ray_cluster_cpus():
    assert CUDA.ray_cluster_cpus(8) is None  # Ray counts the GPU node's CPUs
    assert CPU.ray_cluster_cpus(2) == 4
    assert CPU.ray_cluster_cpus(6) == 6


def test_unknown_device_names_the_valid_ones():
    assert tuple(DEVICE_POLICIES) == ("cuda", "cpu")
    for name in ("auto", "tpu", "cuda:0"):
        with pytest.raises(ValueError, match=r"device '.*'.*expected one of cuda, cpu"):
            DevicePolicy.for_device(name)


def test_policy_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        CPU.dist_backend = "nccl"


def test_cpu_head_dims_are_vllms():
    """The head sizes the plan accepts on cpu are those vLLM's CPU attention backend has kernels for (asked in a
    process of its own: importing vLLM's CPU modules changes torch.cuda in the importing process)."""
    code = ("from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend; "
            "print(CPUAttentionBackend.get_supported_head_sizes())")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert tuple(eval(out.strip().splitlines()[-1])) == CPU.vllm_attention_head_dims


def test_module_is_torch_free():
    code = ("import sys; import hybridrl.parallel.device_policy; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_plan_carries_the_policy_of_its_device():
    assert plan_from_sources(EXAMPLES / "seed_6gpu_grpo.yaml").device_policy is CUDA
    plan = plan_from_sources(EXAMPLES / "cpu_tiny_grpo.yaml")
    assert plan.resolved.device == "cpu" and plan.device_policy is CPU
    again = Plan.from_json(plan.to_json())
    assert again.device_policy == CPU
    data = plan.to_dict()
    data["device_policy"] = dataclasses.asdict(CUDA)
    with pytest.raises(ValueError, match="Plan.device_policy is the 'cuda' policy but resolved.device='cpu'"):
        Plan.from_dict(data)


def _import_warnings(env: dict[str, str]) -> str:
    """What a fresh process prints importing the megatron and vLLM modules whose import warns on CPU."""
    import os
    import subprocess
    import sys

    code = ("import megatron.core.optimizer, megatron.core.optimizer.clip_grads, "
            "megatron.core.models.gpt.gpt_layer_specs, vllm.triton_utils")
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    done = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def test_cpu_workers_log_no_triton_search_but_keep_torchs_other_warnings():
    """CPU_WORKER_TORCH_LOGS (a CPU worker's TORCH_LOGS) puts torch's Triton-search logger at ERROR: the line vLLM's
    CPU worker makes torch log at every engine build is printed without it (the control), not with it, and another
    torch logger's warning still is."""
    assert ("TORCH_LOGS", CPU_WORKER_TORCH_LOGS) in CPU.worker_env
    code = ("import logging, torch\n"
            "logging.getLogger('torch._library.triton').warning('Triton not available, find_triton_kernels = []')\n"
            "logging.getLogger('torch._library.custom_ops').warning('another torch warning')")
    clean = {k: v for k, v in os.environ.items() if k != "TORCH_LOGS"}
    plain, quiet = (subprocess.run([sys.executable, "-c", code], env={**clean, **extra}, capture_output=True,
                                   text=True, timeout=120).stderr
                    for extra in ({}, {"TORCH_LOGS": CPU_WORKER_TORCH_LOGS}))
    assert "Triton not available" in plain and "another torch warning" in plain, plain
    assert "Triton not available" not in quiet and "another torch warning" in quiet, quiet


MEGATRON_COLLECTIVES = """
import os, tempfile, torch, torch.distributed as dist
from megatron.core.tensor_parallel import mappings
from megatron.core.distributed import param_and_grad_buffer
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
out = torch.zeros(4)
mappings.dist_all_gather_func(out, torch.ones(4))
param_and_grad_buffer.dist_reduce_scatter_func(out, torch.ones(4))
from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce as linear
linear(torch.ones(2, 4), torch.ones(3, 4), None, False, True, False, tp_group=dist.group.WORLD)
dist.destroy_process_group()
"""


def test_cpu_workers_ignore_megatrons_deprecated_collective_names_and_cuda_stream_advice():
    """megatron-core's TP gathers and distributed optimizer call all_gather_into_tensor and reduce_scatter_tensor,
    which the CPU stack's torch deprecates, and its TP linear layers advise CUDA_DEVICE_MAX_CONNECTIONS: printed once
    per worker without CPU_WORKER_WARNINGS (the control), silenced with it."""
    starts = ("`torch.distributed.all_gather_into_tensor` is deprecated",
              "`torch.distributed.reduce_scatter_tensor` is deprecated",
              "When using async grad allreduce it is recommended to set the environment variable "
              "CUDA_DEVICE_MAX_CONNECTIONS")
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    for env, printed in (({}, True), ({"PYTHONWARNINGS": CPU_WORKER_WARNINGS}, False)):
        done = subprocess.run([sys.executable, "-c", MEGATRON_COLLECTIVES], env={**clean, **env},
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert all((start in done.stderr) == printed for start in starts), (env, done.stderr[-3000:])


def test_cpu_workers_ignore_the_import_warnings_of_the_gpu_libraries_they_run_without():
    """CPU_WORKER_WARNINGS (a CPU worker's PYTHONWARNINGS) silences exactly those import warnings: without it they
    are printed (the control), with it none of them is, and another warning still is."""
    starts = ("Transformer Engine and Apex are not installed", "Apex is not installed")
    printed = _import_warnings({})
    assert all(start in printed for start in starts), printed[-3000:]
    quiet = _import_warnings({"PYTHONWARNINGS": CPU_WORKER_WARNINGS})
    assert not any(start in quiet for start in starts), quiet[-3000:]
    import subprocess
    import sys

    other = subprocess.run([sys.executable, "-c", "import warnings; warnings.warn('Apex was found')"],
                           env={"PYTHONWARNINGS": CPU_WORKER_WARNINGS}, capture_output=True, text=True)
    assert "Apex was found" in other.stderr
