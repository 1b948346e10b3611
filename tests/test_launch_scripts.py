"""The cluster launch scripts: shellcheck-clean, and they refuse bad input before touching Ray."""
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "launch").glob("*.sh")) + sorted((ROOT / "launch").glob("*.sbatch"))


def test_scripts_exist_and_are_executable():
    names = {p.name for p in SCRIPTS}
    assert {"train_grpo.sh", "train_ppo.sh", "ray_head.sh", "ray_worker.sh", "slurm_grpo.sbatch"} <= names
    assert all(p.stat().st_mode & 0o111 for p in SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck_clean(script):
    shellcheck = shutil.which("shellcheck") or str(Path(__import__("sys").executable).parent / "shellcheck")
    result = subprocess.run([shellcheck, "-x", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_train_script_refuses_a_bad_config_before_training(tmp_path):
    env = {"PATH": f"{Path(__import__('sys').executable).parent}:/usr/bin:/bin", "RUN_DIR": str(tmp_path / "run")}
    result = subprocess.run(
        ["bash", str(ROOT / "launch/train_grpo.sh"), str(ROOT / "configs/examples/seed_6gpu_grpo.yaml"),
         "actor_rollout_ref.rollout.tensor_model_parallel_size=4"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120,
    )
    assert result.returncode == 2
    assert "must divide the 6 GPUs" in result.stderr
    assert not (tmp_path / "run" / "train.log").exists()


def test_worker_script_needs_the_head_address():
    result = subprocess.run(["bash", str(ROOT / "launch/ray_worker.sh")], capture_output=True, text=True)
    assert result.returncode == 2 and "usage" in result.stderr
