"""YAML loading, dotted overrides with type checking, unknown keys, and the `hybridrl plan` CLI."""
import dataclasses
import json
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml

from hybridrl.config import ConfigError, config_from_dict, config_to_dict, load_config, plan_from_sources
from hybridrl.config.loader import megatron_field_aliases
from hybridrl.config.schema import MegatronConfig, choices_of

ROOT = Path(__file__).resolve().parents[2]
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


def test_a_key_written_twice_is_refused_naming_both_lines(tmp_path):
    """PyYAML keeps the last of a repeated key: a second `data:` would replace the first section whole."""
    path = tmp_path / "job.yaml"
    path.write_text("data:\n  max_prompt_length: 32\n  max_prompt_length: 24\ntrainer:\n  seed: 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    (issue,) = info.value.issues
    assert issue.field == "<config file>" and "found the key 'max_prompt_length' a second time (first on line 2)" \
        in issue.rule and f'in "{path}", line 3' in issue.rule
    path.write_text("data:\n  max_prompt_length: 32\ntrainer:\n  seed: 1\ndata:\n  train_batch_size: 8\n")
    with pytest.raises(ConfigError, match="found the key 'data' a second time"):
        load_config(path)
    with pytest.raises(ConfigError, match="found the key 'n' a second time"):
        load_config(None, ["actor_rollout_ref.rollout={n: 2, n: 4}"])


def test_a_config_that_is_not_utf8_text_or_is_a_folder_is_named(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_bytes("# modèle\ndata:\n  max_prompt_length: 32\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"not UTF-8 text \(byte 0xe8 at offset 5\): save the file as UTF-8"):
        load_config(path)
    with pytest.raises(ConfigError, match="is a folder: give a YAML file"):
        load_config(tmp_path)


def test_an_override_mapping_cut_short_is_refused_not_applied_as_text():
    """Taken as a string it replaced the file's whole actor section (and its errors blamed settings the user never
    wrote)."""
    with pytest.raises(ConfigError) as info:
        load_config(SEED, ["actor_rollout_ref.actor={ppo_epochs: 2", "trainer.experiment_name=[abc"])
    assert sorted(i.field for i in info.value.issues) == ["actor_rollout_ref.actor", "trainer.experiment_name"]
    assert all("is not a valid YAML mapping or list" in i.rule for i in info.value.issues)
    assert load_config(SEED, ["trainer.experiment_name=a{b"]).trainer.experiment_name == "a{b"  # text stays text


def test_a_field_given_a_mapping_names_the_field_it_lacks():
    with pytest.raises(ConfigError, match=r"data.train_files.a names a field it does not have"):
        load_config(SEED, ["data.train_files={a: 1}"])


def test_value_where_section_expected():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["trainer=3"])
    assert info.value.issues[0].field == "trainer" and "section" in info.value.issues[0].rule


def test_dict_round_trip():
    cfg = load_config(SEED)
    assert config_from_dict(json.loads(json.dumps(config_to_dict(cfg)))) == cfg


def _cli(*args, layout_only=True):
    """`hybridrl plan` on the seed example, whose model folder holds a config.json only (shape only)."""
    flags = ["--layout-only"] if layout_only else []
    return subprocess.run([sys.executable, "-m", "hybridrl.cli", "plan", *args, *flags], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)


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


@pytest.mark.parametrize("job", ["layout", "inputs"])
def test_cli_plan_stays_light(job, request):
    """`hybridrl plan` must not import torch, Ray or megatron (it answers before any of them loads), neither
    sizing a layout nor checking the model folder, data files and reward code `train` reads."""
    if job == "layout":
        argv = ["plan", str(SEED), "--layout-only"]
    else:
        from tools.demo_assets import demo_overrides

        assets = request.getfixturevalue("demo_assets")
        argv = ["plan", str(ROOT / "configs/examples/cpu_tiny_grpo.yaml"), *demo_overrides(assets, ROOT / "runs")]
    code = (f"import sys; from hybridrl.cli import main; rc = main({argv!r}); "
            "heavy = [m for m in ('torch', 'ray', 'megatron', 'vllm', 'transformers') if m in sys.modules]; "
            "print(rc, heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.stdout.strip().splitlines()[-1] == "0 []", out.stdout[-500:] + out.stderr[-2000:]


# Two spellings of one field: a role's layout field on the role or under `megatron`.
# every role with a layout
ROLES = ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic", "reward_model", "teacher")
ALIASED = [(role, f.name) for role in ROLES for f in dataclasses.fields(MegatronConfig)]


def _two_values(name: str) -> tuple[Any, Any]:
    """Two different valid values of a MegatronConfig field, from its type."""
    hint = typing.get_type_hints(MegatronConfig)[name]
    if hint is bool:
        return True, False
    if hint is int or hint == (int | None):
        return 2, 3
    if hint is float or hint == (float | None):
        return 0.5, 0.25
    if typing.get_origin(hint) is dict:  # megatron's own settings (override_transformer_config)
        return {"recompute_num_layers": 2}, {"recompute_num_layers": 3}
    found = choices_of(hint)  # a closed vocabulary (dtype): two of its values
    assert found is not None, hint
    return typing.get_args(found[0])[:2]


def _said(spelling: str, value: Any) -> str:
    """How a problem quotes `spelling=value`: a mapping's conflict is named at its own leaf."""
    if isinstance(value, dict):
        ((key, leaf),) = value.items()
        return f"{spelling}.{key}={leaf}"
    return f"{spelling}={value}"


def _spelled(role: str, name: str, spelling: str) -> str:
    return f"{role}.megatron.{name}" if spelling == "megatron" else f"{role}.{name}"


def _nested(dotted: str, value: Any) -> dict[str, Any]:
    tree: Any = value
    for part in reversed(dotted.split(".")):
        tree = {part: tree}
    return tree


def _megatron_of(cfg: Any, role: str) -> Any:
    node = cfg
    for part in role.split("."):
        node = getattr(node, part)
    return node.megatron


def _write(tmp_path: Path, *dotted_values: tuple[str, Any]) -> Path:
    tree: dict[str, Any] = {}
    for dotted, value in dotted_values:
        node = tree
        parts = dotted.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def _yaml(value: Any) -> str:
    return yaml.safe_dump(value).removesuffix("\n...\n").strip()


def test_alias_table_is_every_layout_field_on_every_role():
    assert megatron_field_aliases() == {f"{role}.{name}": f"{role}.megatron.{name}" for role, name in ALIASED}


@pytest.mark.parametrize("file_spelling, cli_spelling", [("megatron", "role"), ("role", "megatron")])
@pytest.mark.parametrize("role, name", ALIASED)
def test_command_line_beats_the_file_whichever_spelling(tmp_path, role, name, file_spelling, cli_spelling):
    in_file, on_cli = _two_values(name)
    keep = ("seed", 77) if name != "seed" else ("param_offload", True)  # another field of the file's section
    path = _write(tmp_path, (_spelled(role, name, file_spelling), in_file),
                  (_spelled(role, keep[0], file_spelling), keep[1]))
    cfg = load_config(path, [f"{_spelled(role, name, cli_spelling)}={_yaml(on_cli)}"])
    assert getattr(_megatron_of(cfg, role), name) == on_cli
    assert getattr(_megatron_of(cfg, role), keep[0]) == keep[1]  # the override replaces one field, not the section
    assert getattr(_megatron_of(load_config(path), role), name) == in_file  # the file alone is read as written


@pytest.mark.parametrize("role, name", ALIASED)
def test_two_spellings_in_one_file_must_agree(tmp_path, role, name):
    first, second = _two_values(name)
    role_level, nested = _spelled(role, name, "role"), _spelled(role, name, "megatron")
    path = _write(tmp_path, (nested, first), (role_level, second))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    (issue,) = info.value.issues
    text = str(issue)
    assert _said(nested, first) in text and _said(role_level, second) in text and str(path) in text, text
    same = _write(tmp_path, (nested, first), (role_level, first))
    assert getattr(_megatron_of(load_config(same), role), name) == first


@pytest.mark.parametrize("role, name", ALIASED)
def test_two_spellings_on_one_command_line_must_agree(role, name):
    first, second = _two_values(name)
    role_level, nested = _spelled(role, name, "role"), _spelled(role, name, "megatron")
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"{role_level}={_yaml(first)}", f"{nested}={_yaml(second)}"])
    (issue,) = info.value.issues
    assert _said(role_level, first) in str(issue) and _said(nested, second) in str(issue)
    assert "the command line" in str(issue)
    cfg = load_config(None, [f"{role_level}={_yaml(first)}", f"{nested}={_yaml(first)}"])
    assert getattr(_megatron_of(cfg, role), name) == first
    # one spelling written twice is an ordinary re-override: the last one wins
    cfg = load_config(None, [f"{nested}={_yaml(first)}", f"{nested}={_yaml(second)}"])
    assert getattr(_megatron_of(cfg, role), name) == second


def test_the_reported_override_plans_the_users_tp():
    """The issue's reproduction: the file's `actor.megatron.tensor_model_parallel_size: 1` no longer
    wins over the command line's role-level spelling."""
    plan = plan_from_sources(SEED, ["actor_rollout_ref.actor.tensor_model_parallel_size=2",
                                    "actor_rollout_ref.actor.pipeline_model_parallel_size=3"])
    mesh = plan.layout("actor").mesh
    assert (mesh.tp, mesh.pp, mesh.dp) == (2, 3, 1)
    with pytest.raises(ConfigError) as info:  # TP 4 does not divide 6 GPUs: refused, not replaced by the file's 1
        plan_from_sources(SEED, ["actor_rollout_ref.actor.tensor_model_parallel_size=4"])
    assert any(str(i).startswith("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4 must divide")
               for i in info.value.issues)


def test_mapping_override_merges_into_the_files_section():
    cfg = load_config(SEED, ["actor_rollout_ref.actor={ppo_micro_batch_size_per_gpu: 4, "
                             "tensor_model_parallel_size: 2}"])
    actor = cfg.actor_rollout_ref.actor
    assert actor.ppo_micro_batch_size_per_gpu == 4 and actor.megatron.tensor_model_parallel_size == 2
    assert actor.ppo_mini_batch_size == 60 and actor.use_kl_loss is True  # the file's other settings stay


def test_null_layout_beside_its_fields_keeps_the_fields(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("actor_rollout_ref:\n  ref:\n    tensor_model_parallel_size: 2\n    megatron: null\n")
    assert load_config(path).actor_rollout_ref.ref.megatron.tensor_model_parallel_size == 2
    cfg = load_config(path, ["actor_rollout_ref.ref.megatron=null"])  # the command line's null: the actor's layout
    assert cfg.actor_rollout_ref.ref.megatron is None


def test_role_level_typo_suggests_the_layout_field():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["critic.tensor_model_paralel_size=2"])
    assert "did you mean 'tensor_model_parallel_size'" in str(info.value)


def test_cli_json_round_trip_of_a_role_level_override():
    js = _cli(str(SEED), "actor_rollout_ref.actor.tensor_model_parallel_size=2", "--format", "json")
    assert js.returncode == 0, js.stderr
    data = json.loads(js.stdout)
    assert data["config"]["actor_rollout_ref"]["actor"]["megatron"]["tensor_model_parallel_size"] == 2
    assert "tensor_model_parallel_size" not in data["config"]["actor_rollout_ref"]["actor"]
    assert data["layouts"][0]["mesh"]["tp"] == 2
    from hybridrl.config import Plan

    assert Plan.from_dict(data).to_dict() == data
