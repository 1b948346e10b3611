"""A whole verl config file plans: verl 0.9.1's own generated trainer YAMLs, read out of verl's wheel from PyPI
(`make verl-wheel`; the fixture fetches it when missing), with a user's model and data on the command line.

What makes it plan, each tested on its own first: Hydra's `_target_` entries (metadata at verl's classes, a user's
class refused), interpolations resolved as verl's Hydra resolves them (`config/verl_interpolation.py`), and verl's
keys without a hybridrl field taken at verl's defaults (`config/verl_defaults.py`), refused by name at any other.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hybridrl.config.errors import ConfigError
from hybridrl.config.loader import load_config_collecting
from hybridrl.config.plan import Plan, plan_from_sources
from hybridrl.config.report import render_plan
from tools.demo_assets import build_demo_assets
from tools.fetch_verl_wheel import FSDP_YAML, MEGATRON_YAML, ensure_verl_wheel, read_member

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs/examples/cpu_tiny_grpo.yaml"


@pytest.fixture(scope="module")
def wheel() -> Path:
    """verl's wheel (never skips: a wheel that cannot be fetched fails the tests, as the real model does)."""
    return ensure_verl_wheel(quiet=True)


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # rows for one of verl's default batches (data.train_batch_size: 1024)
    return build_demo_assets(tmp_path_factory.mktemp("verl-file"), train_rows=1024, val_rows=16)


def _user(assets: Path, *extra: str) -> list[str]:
    """What a verl user gives beside verl's file: the model and data (the tiny model holds 512 positions, so shorter
    sequences than verl's 512 + 512), and rollout.name, which verl's file leaves `???` for the user to give.
    trainer.logger: verl's default names wandb, which is not installed here (a refusal of its own)."""
    model, data = assets / "model", assets / "data"
    return [f"actor_rollout_ref.model.path={model}", f"critic.model.path={model}",
            f"data.train_files=[{data / 'train.jsonl'}]", f"data.val_files=[{data / 'val.jsonl'}]",
            "data.max_prompt_length=256", "data.max_response_length=256", "actor_rollout_ref.rollout.name=vllm",
            "trainer.logger=[console]", *extra]


def _write(tmp_path: Path, tree: dict, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return path


def _verl_tree(wheel: Path, member: str = MEGATRON_YAML) -> dict:
    return yaml.safe_load(read_member(wheel, member))


def _issues(path: Path, overrides: list[str]) -> list:
    with pytest.raises(ConfigError) as error:
        plan_from_sources(str(path), overrides, check_files=True)
    return error.value.issues


# Each fix on its own, on hybridrl's own example job -------------------------------------------------------------

def test_target_entries_at_verls_classes_are_metadata(tmp_path):
    tree = yaml.safe_load(TINY.read_text())
    tree["actor_rollout_ref"]["actor"]["_target_"] = "verl.workers.config.McoreActorConfig"
    tree["algorithm"]["_target_"] = "verl.trainer.config.AlgoConfig"
    from hybridrl.config.verl_defaults import VerlDefaults

    verl = VerlDefaults()
    config, issues = load_config_collecting(_write(tmp_path, tree), [], verl)
    assert issues == [] and sorted(verl.targets) == ["actor_rollout_ref.actor._target_", "algorithm._target_"]


def test_a_target_naming_another_class_is_refused_by_name(tmp_path):
    tree = yaml.safe_load(TINY.read_text())
    tree["actor_rollout_ref"]["actor"]["_target_"] = "my_pkg.CustomActorConfig"
    _, issues = load_config_collecting(_write(tmp_path, tree), [])
    (issue,) = issues
    assert issue.field == "actor_rollout_ref.actor._target_" and issue.value == "my_pkg.CustomActorConfig"
    assert "instantiates no user class" in issue.rule and "verl.workers.config.McoreActorConfig" in issue.rule


def test_interpolations_resolve_after_the_command_lines_overrides(tmp_path):
    tree = yaml.safe_load(TINY.read_text())
    tree["critic"] = {"ppo_epochs": "${oc.select:actor_rollout_ref.actor.ppo_epochs,1}",
                      "ppo_mini_batch_size": "${actor_rollout_ref.actor.ppo_mini_batch_size}"}
    tree["actor_rollout_ref"]["actor"]["ppo_epochs"] = 2
    config, issues = load_config_collecting(_write(tmp_path, tree), ["actor_rollout_ref.actor.ppo_mini_batch_size=4"])
    assert issues == []
    assert config.critic.ppo_epochs == 2 and config.critic.ppo_mini_batch_size == 4  # Hydra's order: the line first


def test_an_unresolvable_interpolation_is_refused_naming_the_key_and_expression(tmp_path):
    tree = yaml.safe_load(TINY.read_text())
    tree["critic"] = {"ppo_epochs": "${actor_rollout_ref.actor.no_such_key}"}
    _, issues = load_config_collecting(_write(tmp_path, tree), [])
    (issue,) = issues
    assert issue.field == "critic.ppo_epochs" and issue.value == "${actor_rollout_ref.actor.no_such_key}"
    assert "does not resolve" in issue.rule


def test_a_yaml_without_interpolations_is_read_without_omegaconf():
    code = ("import sys; from hybridrl.config.loader import load_config; "
            f"load_config({str(TINY)!r}); assert 'omegaconf' not in sys.modules, 'imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


def test_verl_keys_at_verls_defaults_are_taken_and_counted(tmp_path):
    tree = yaml.safe_load(TINY.read_text())
    tree["data"].update({"use_shm": False, "seed": None, "image_key": "images", "dataloader_num_workers": 8})
    tree["trainer"].update({"val_only": False, "resume_from_path": None, "critic_warmup": 0})
    tree["reward_model"] = {"reward_manager": None, "enable": None}  # verl's legacy section: nulls are "not set"
    from hybridrl.config.verl_defaults import VerlDefaults

    verl = VerlDefaults()
    config, issues = load_config_collecting(_write(tmp_path, tree), [], verl)
    assert issues == [] and config.reward_model.enable is False
    assert len(verl.taken) == 9 and "data.dataloader_num_workers" in verl.taken


# verl's own files ------------------------------------------------------------------------------------------------

def test_verls_generated_megatron_config_plans_whole(wheel, assets, tmp_path):
    path = tmp_path / "ppo_megatron_trainer.yaml"
    path.write_text(read_member(wheel, MEGATRON_YAML))
    # the actor's layout, given on the line, reaches the reference's and the critic's keys that follow it in verl
    # (rollout.n_gpus_per_node follows trainer.n_gpus_per_node in verl's file, read only for a rollout pool of its own:
    # verl's "not set" however the line changes the trainer's)
    plan = plan_from_sources(str(path), _user(assets, "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                                              "actor_rollout_ref.actor.ppo_mini_batch_size=128",
                                              "trainer.n_gpus_per_node=4"), check_files=True)
    assert len(plan.verl_defaults_taken) > 600 and len(plan.verl_targets_ignored) > 60
    lines = [line for line in render_plan(plan).splitlines() if "verl 0.9.1's defaults" in line]
    assert len(lines) == 1 and f"{len(plan.verl_defaults_taken)} key(s)" in lines[0]  # one line, never one each
    assert Plan.from_json(plan.to_json()).verl_defaults_taken == plan.verl_defaults_taken
    # the job a verl user expects: verl's file values where hybridrl's defaults differ
    cfg = plan.config
    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    assert (cfg.algorithm.adv_estimator, actor.optim.lr, cfg.critic.optim.lr, actor.clip_ratio) == ("gae", 1e-6, 1e-5,
                                                                                                   0.2)
    assert (cfg.data.train_batch_size, rollout.tensor_model_parallel_size, rollout.n) == (1024, 2, 1)
    assert (actor.megatron.dtype, rollout.dtype, cfg.trainer.val_before_train) == ("bf16", "bf16", True)
    assert cfg.actor_rollout_ref.ref.megatron.tensor_model_parallel_size == 2  # ${oc.select:...actor...}
    assert (cfg.critic.ppo_mini_batch_size, cfg.critic.megatron.tensor_model_parallel_size) == (128, 1)
    assert cfg.trainer.nccl_timeout_s == 600  # verl's actor_rollout_ref.nccl_timeout, not hybridrl's 1800
    assert cfg.actor_rollout_ref.model.lora.alpha == 32  # megatron's lora.alpha, not the FSDP spelling's 16
    assert (rollout.mode, rollout.n_gpus_per_node, cfg.trainer.n_gpus_per_node) == ("colocated", None, 4)


def test_a_saved_resolved_verl_config_plans_too(wheel, assets, tmp_path):
    """The config a verl run saves with every value written (its interpolations resolved, the run's own overrides
    in it): each key that followed another by verl's expression is compared with what that expression gives in this
    file, a section that followed one (rollout.mtp) key by key; the command line may change what they followed."""
    from hybridrl.config.verl_interpolation import InterpolatedConfig

    tree = _verl_tree(wheel)
    tree["actor_rollout_ref"]["rollout"].update({"n": 4, "name": "vllm"})
    tree["data"].update({"max_prompt_length": 256, "max_response_length": 256})
    saved = InterpolatedConfig(tree).resolved([])
    path = _write(tmp_path, saved, "config.yaml")
    assert "${" not in path.read_text()
    plan = plan_from_sources(str(path), _user(assets, "data.max_prompt_length=128"), check_files=True)
    assert {"actor_rollout_ref.actor.rollout_n", "actor_rollout_ref.rollout.prompt_length",
            "actor_rollout_ref.rollout.mtp.enable"} <= set(plan.verl_defaults_taken)
    assert "actor_rollout_ref.rollout.mtp._target_" in plan.verl_targets_ignored
    assert (plan.config.actor_rollout_ref.rollout.n, plan.config.data.max_prompt_length) == (4, 128)


def test_verls_fsdp_config_is_refused_by_its_strategy(wheel, assets, tmp_path):
    path = tmp_path / "ppo_trainer.yaml"
    path.write_text(read_member(wheel, FSDP_YAML))
    issues = _issues(path, _user(assets))
    assert {issue.field for issue in issues} == {"actor_rollout_ref.ref.strategy", "critic.strategy"}
    assert all(issue.value == "fsdp" and "trains every role with megatron-core" in issue.rule for issue in issues)
    # the same file with every role set to megatron on the line (as the refusal says) plans
    plan = plan_from_sources(str(path), _user(assets, "actor_rollout_ref.actor.strategy=megatron",
                                              "critic.strategy=megatron"), check_files=True)
    assert plan.config.actor_rollout_ref.actor.optim.optimizer == "adam"  # verl's AdamW: megatron's adam


@pytest.mark.parametrize("path,value,says", [
    # a verl-only key at another value than verl's: the user's setting, never dropped
    (("actor_rollout_ref", "actor", "use_prefix_grouper"), True, "taken only at verl 0.9.1's default False"),
    # verl's custom reward manager (a class of the user's, loaded by path)
    (("reward", "reward_manager", "module", "path"), "my_manager.py", "taken only at verl 0.9.1's default null"),
    (("actor_rollout_ref", "actor", "policy_loss", "_target_"), "my_pkg.MyLoss", "instantiates no user class"),
    # a verl_keys entry keeps its own reason
    (("trainer", "critic_warmup"), 3, "critic warm-up is not built yet"),
])
def test_a_verl_key_changed_from_its_default_is_refused_naming_it(wheel, assets, tmp_path, path, value, says):
    tree = _verl_tree(wheel)
    node = tree
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    (issue,) = _issues(_write(tmp_path, tree), _user(assets))
    assert issue.field == ".".join(path) and issue.value == value and says in issue.rule


def test_an_unresolvable_interpolation_in_verls_file_is_refused_naming_the_key(wheel, assets, tmp_path):
    tree = _verl_tree(wheel)
    tree["critic"]["ppo_epochs"] = "${oc.select:actor_rollout_ref.actor.ppo_epochs,1}+${no.such.key}"
    (issue,) = _issues(_write(tmp_path, tree), _user(assets))
    assert issue.field == "critic.ppo_epochs" and "${no.such.key}" in issue.value and "does not resolve" in issue.rule


def test_verls_mandatory_value_left_unset_is_named(wheel, assets, tmp_path):
    path = _write(tmp_path, _verl_tree(wheel))
    (issue,) = _issues(path, [o for o in _user(assets) if not o.startswith("actor_rollout_ref.rollout.name=")])
    assert issue.field == "actor_rollout_ref.rollout.name" and issue.value == "???"


def test_the_defaults_table_is_verls(wheel):
    """hybridrl/config/verl_default_values.py is what tools/verl_defaults.py writes from this wheel and hybridrl's
    schema (a key that gains a hybridrl field leaves the table: regenerate)."""
    from tools.verl_defaults import OUT, nulls, render, table

    assert render(table(wheel), nulls(wheel)) == OUT.read_text()


def test_verls_example_scripts_on_verls_file_are_refused_no_more_than_alone(wheel, tmp_path):
    """Each of verl's Megatron example scripts (tests/support/verl_megatron_examples.json) run on verl's whole file, as
    verl runs it: the file adds no problem to what the script's overrides alone get (tests/config/test_verl.py)."""
    import json

    path = tmp_path / "ppo_megatron_trainer.yaml"
    path.write_text(read_member(wheel, MEGATRON_YAML))
    scripts = json.loads((ROOT / "tests/support/verl_megatron_examples.json").read_text())["scripts"]
    added = {}
    for script, overrides in scripts.items():
        on_file = {issue.field for issue in load_config_collecting(path, overrides)[1]}
        alone = {issue.field for issue in load_config_collecting(None, overrides)[1]}
        if on_file - alone:
            added[script] = sorted(on_file - alone)
    assert len(scripts) >= 20 and added == {}
