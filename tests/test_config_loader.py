"""YAML loading, dotted overrides with type checking, unknown keys, and the `hybridrl plan` CLI."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybridrl.config import ConfigError, config_from_dict, config_to_dict, load_config

ROOT = Path(__file__).resolve().parents[1]
SEED = ROOT / "configs/examples/seed_6gpu_grpo.yaml"


def test_yaml_values_and_defaults():
    cfg = load_config(SEED)
    assert cfg.actor_rollout_ref.rollout.n == 12
    assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(1e-6)
    assert cfg.trainer.n_gpus_per_node == 6
    assert cfg.critic.cliprange_value == 0.5  # untouched default


def test_overrides_are_typed():
    cfg = load_config(SEED, [
        "actor_rollout_ref.rollout.n=16", "actor_rollout_ref.actor.optim.lr=3e-6",
        "trainer.logger=[console,jsonl]", "data.train_files=/data/a.parquet",
        "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=null",
        "trainer.experiment_name=007", "actor_rollout_ref.actor.use_kl_loss=false",
    ])
    assert cfg.actor_rollout_ref.rollout.n == 16
    assert isinstance(cfg.actor_rollout_ref.actor.optim.lr, float) and cfg.actor_rollout_ref.actor.optim.lr == 3e-6
    assert cfg.trainer.logger == ["console", "jsonl"]
    assert cfg.data.train_files == ["/data/a.parquet"]  # one path for a list field
    assert cfg.trainer.experiment_name == "007"  # the user's text, not int 7
    assert cfg.actor_rollout_ref.actor.use_kl_loss is False


def test_override_type_errors_name_field_and_type():
    with pytest.raises(ConfigError) as info:
        load_config(SEED, ["actor_rollout_ref.rollout.n=many", "trainer.val_before_train=yes please",
                           "actor_rollout_ref.rollout.temperature=[1]"])
    fields = {i.field: str(i) for i in info.value.issues}
    assert "must be int" in fields["actor_rollout_ref.rollout.n"]
    assert "must be bool" in fields["trainer.val_before_train"]
    assert "must be float" in fields["actor_rollout_ref.rollout.temperature"]
    assert len(fields) == 3  # all at once


def test_int_field_rejects_bool_and_fraction():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["data.train_batch_size=true", "actor_rollout_ref.rollout.n=2.5"])
    assert {i.field for i in info.value.issues} == {"data.train_batch_size", "actor_rollout_ref.rollout.n"}


def test_unknown_keys_suggest_the_nearest(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("data:\n  train_batch_sise: 8\nactor_rollout_ref:\n  rollout:\n    temprature: 0.7\nfoo: 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, ["algorithm.adv_estimater=grpo"])
    msgs = {i.field: str(i) for i in info.value.issues}
    assert "did you mean 'train_batch_size'" in msgs["data.train_batch_sise"]
    assert "did you mean 'temperature'" in msgs["actor_rollout_ref.rollout.temprature"]
    assert "did you mean 'adv_estimator'" in msgs["algorithm.adv_estimater"]
    assert "valid keys: data, actor_rollout_ref" in msgs["foo"]


def test_megatron_fields_accepted_on_the_role():
    cfg = load_config(None, ["actor_rollout_ref.actor.tensor_model_parallel_size=2",
                             "critic.pipeline_model_parallel_size=4"])
    assert cfg.actor_rollout_ref.actor.megatron.tensor_model_parallel_size == 2
    assert cfg.critic.megatron.pipeline_model_parallel_size == 4


def test_malformed_override_and_missing_file():
    with pytest.raises(ConfigError) as info:
        load_config(ROOT / "nope.yaml", ["data.train_batch_size", "=3", "data..x=1"])
    text = str(info.value)
    assert "file not found" in text and text.count("expected the form section.field=value") == 3


def test_value_where_section_expected():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["trainer=3"])
    assert info.value.issues[0].field == "trainer" and "section" in info.value.issues[0].rule


def test_dict_round_trip():
    cfg = load_config(SEED)
    assert config_from_dict(json.loads(json.dumps(config_to_dict(cfg)))) == cfg


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "hybridrl.cli", "plan", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)


def test_cli_plan_text_and_json_round_trip():
    text = _cli(str(SEED))
    assert text.returncode == 0, text.stderr
    assert "[[0,1], [2,3], [4,5]]" in text.stdout and "720" in text.stdout
    js = _cli(str(SEED), "actor_rollout_ref.rollout.n=4", "--format", "json")
    assert js.returncode == 0
    data = json.loads(js.stdout)
    assert data["sequences_per_step"] == 240
    from hybridrl.config import Plan

    assert Plan.from_dict(data).to_dict() == data


def test_cli_plan_reports_all_errors_and_exits_2():
    res = _cli(str(SEED), "actor_rollout_ref.rollout.tensor_model_parallel_size=4", "algorithm.gamma=3",
               "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=7")
    assert res.returncode == 2 and res.stdout == ""
    assert "4 config error(s)" in res.stderr  # rollout TP=4 also misses the 14 heads
    expected = "actor_rollout_ref.rollout.tensor_model_parallel_size=4 must divide the 6 GPUs; valid: 1, 2, 3, 6"
    assert expected in res.stderr
    res_json = _cli(str(SEED), "algorithm.gamma=3", "--format", "json")
    assert res_json.returncode == 2
    assert json.loads(res_json.stderr)["errors"][0]["field"] == "algorithm.gamma"


def test_cli_plan_stays_light():
    """`hybridrl plan` must not import torch, Ray or megatron (it answers before any of them loads)."""
    code = (f"import sys; from hybridrl.cli import main; rc = main(['plan', {str(SEED)!r}]); "
            "heavy = [m for m in ('torch', 'ray', 'megatron', 'vllm') if m in sys.modules]; "
            "print(rc, heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.stdout.strip().splitlines()[-1] == "0 []", out.stdout[-500:] + out.stderr[-2000:]
