"""`hybridrl plan` and `hybridrl train` refuse what `train` could not read, before any process starts.

Each mistake a new user makes with their own model, data and reward (issue 39's list) is run through the
real command line, as a user runs it: exit 2, the field and value named, no traceback, nothing started.
The demo's model folder and data (tools/demo_assets.py, what `make demo` builds) are the valid job
each mistake is made on.
"""
from __future__ import annotations

import inspect
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hybridrl.config.errors import ConfigError
from hybridrl.config.inputs import has_chat_template, looks_like_hub_id, unscored_data_source
from hybridrl.data.dataset import preview_file
from hybridrl.data.io import write_rows
from hybridrl.rewards.custom import adapt_reward_function, call_problem
from tools.demo_assets import demo_overrides

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs/examples/cpu_tiny_grpo.yaml")
MESSAGES = [{"role": "system", "content": "answer briefly"}, {"role": "user", "content": "repeat: aaa"}]


def _hybridrl(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hybridrl.cli", *argv], capture_output=True, text=True, cwd=ROOT,
                          timeout=120, env={**os.environ, **(env or {})})


def _copy_model(assets: Path, out: Path, *, without: tuple[str, ...]) -> Path:
    shutil.copytree(assets / "model", out, ignore=shutil.ignore_patterns(*without))
    return out


def _big_tokenizer(folder: Path, size: int) -> Path:
    """A tokenizer.json of `size` word-level tokens (a stand-in for a larger model family's tokenizer)."""
    from tokenizers import Tokenizer, models

    folder.mkdir()
    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, size)}}
    Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>")).save(str(folder / "tokenizer.json"))
    return folder


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


def _rows(n: int, prompt=lambda i: f"repeat: {'a' * (i % 4 + 1)}") -> list[dict]:
    return [{"prompt": prompt(i), "reward_model": {"ground_truth": "a"}, "data_source": "hybridrl/repeat_letter"}
            for i in range(n)]


def _mistakes(assets: Path, tmp: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (overrides on the valid demo job, what the refusal must say: the field=value and the rule)."""
    small = write_rows(_rows(4), tmp / "small.jsonl")
    chat = write_rows(_rows(16, prompt=lambda i: MESSAGES), tmp / "chat.parquet")
    (tmp / "other_name.py").write_text("def score(response, ground_truth, extra):\n    return 1.0\n")
    (tmp / "one_arg.py").write_text("def compute_score(response):\n    return 1.0\n")
    # verl's form with the response parameter renamed: called positionally it took the response as its data_source
    (tmp / "verl_misnamed.py").write_text(
        "def compute_score(data_source, solution, ground_truth, extra_info=None):\n    return float(solution == 'a')\n")
    images = write_rows([{**row, "images": [{"image": "file:///photo.png"}]} for row in _rows(16)],
                        tmp / "images.parquet")
    tool_agent = write_rows([{**row, "agent_name": "tool_agent"} for row in _rows(16)], tmp / "tool_agent.parquet")
    (tmp / "raises.py").write_text("import no_such_module_anywhere\n")
    no_weights = _copy_model(assets, tmp / "noweights", without=("*.safetensors",))
    no_tokenizer = _copy_model(assets, tmp / "notok", without=("tokenizer*",))
    bad_tokenizer = _copy_model(assets, tmp / "badtok", without=())
    (bad_tokenizer / "tokenizer.json").write_text("garbage\n")
    big_tokenizer = _big_tokenizer(tmp / "bigtok", 200)  # the demo model's vocabulary is 96
    small_critic = _copy_model(assets, tmp / "smallcritic", without=())
    _edit_config(small_critic, vocab_size=64)
    weights = (assets / "model" / "model.safetensors").read_bytes()
    truncated = _copy_model(assets, tmp / "truncated", without=())
    (truncated / "model.safetensors").write_bytes(weights[:100_000])
    empty_weights = _copy_model(assets, tmp / "emptyweights", without=())
    (empty_weights / "model.safetensors").write_bytes(b"")
    more_layers = _copy_model(assets, tmp / "morelayers", without=())
    _edit_config(more_layers, num_hidden_layers=6)  # the weights hold 4
    list_config = _copy_model(assets, tmp / "listconfig", without=())
    (list_config / "config.json").write_text("[1, 2]")
    cut_config = _copy_model(assets, tmp / "cutconfig", without=())
    gemma_reward = _copy_model(assets, tmp / "gemmareward", without=())
    _edit_config(gemma_reward, architectures=["Gemma2ForSequenceClassification"])
    (cut_config / "config.json").write_text('{"architectures": [')
    return {
        "missing data file": ([f"data.train_files=[{tmp / 'nope.jsonl'}]"],
                              f"data.train_files={tmp / 'nope.jsonl'} does not exist"),
        "hub dataset id": (["data.val_files=[openai/gsm8k]"],
                           "data.val_files=openai/gsm8k does not exist; hub datasets are never downloaded"),
        "misspelled scorer": (["algorithm.reward_fn=repeat_leter"],
                              "algorithm.reward_fn=repeat_leter is not a known scorer. Did you mean 'repeat_letter'?"),
        "missing model folder": ([f"actor_rollout_ref.model.path={tmp / 'no-model'}"],
                                 f"actor_rollout_ref.model.path={tmp / 'no-model'} does not exist; name a local"),
        "hub id not in the cache": (["actor_rollout_ref.model.path=acme/not-cached-7B"],
                                    "as a hub id it is not in the local Hugging Face cache; hybridrl never downloads: "
                                    "fetch it first (`hf download acme/not-cached-7B"),
        "model without weights": ([f"actor_rollout_ref.model.path={no_weights}"],
                                  "holds no weights: expected model.safetensors or model.safetensors.index.json"),
        "model without tokenizer": ([f"actor_rollout_ref.model.path={no_tokenizer}"],
                                    "holds no tokenizer"),
        # train: `Exception: expected value at line 1 column 1`, naming neither the field nor the file
        "corrupt tokenizer.json": ([f"actor_rollout_ref.model.path={bad_tokenizer}"],
                                   f"actor_rollout_ref.model.path={bad_tokenizer} holds a tokenizer that does not "
                                   f"load: {bad_tokenizer / 'tokenizer.json'} is not a tokenizer the tokenizers "
                                   "library reads (expected value at line 1 column 1)"),
        # train: `IndexError: index out of range in self` at the first generation
        "tokenizer larger than the model's vocabulary": (
            [f"actor_rollout_ref.model.tokenizer_path={big_tokenizer}"],
            f"actor_rollout_ref.model.tokenizer_path={big_tokenizer} holds a tokenizer of 200 tokens (ids 0..199), "
            "more than the 96 of the model's vocabulary"),
        # train: an unnamed SafetensorError at worker setup
        "truncated weights": ([f"actor_rollout_ref.model.path={truncated}"],
                              f"actor_rollout_ref.model.path={truncated} holds weights that do not load: "
                              f"{truncated / 'model.safetensors'} is 100,000 bytes where its header declares "
                              f"{len(weights):,}"),
        "empty weights file": ([f"actor_rollout_ref.model.path={empty_weights}"],
                               f"{empty_weights / 'model.safetensors'} is empty (0 bytes)"),
        # train: a CheckpointError at worker setup, after Ray started
        "config.json not the weights'": ([f"actor_rollout_ref.model.path={more_layers}"],
                                         f"actor_rollout_ref.model.path={more_layers} holds weights that do not match "
                                         "its config.json (num_hidden_layers=6, vocab_size=96): missing tensors (18): "
                                         "model.layers.4.input_layernorm.weight"),
        "critic vocabulary smaller than the policy's tokenizer": (
            ["algorithm.adv_estimator=gae", f"critic.model.path={small_critic}"],
            f"critic.model.path={small_critic} has a vocabulary of 64 (vocab_size in its config.json), fewer than "
            "the 96 tokens of the policy's tokenizer"),
        "model config.json a JSON list": ([f"actor_rollout_ref.model.path={list_config}"],
                                          f"actor_rollout_ref.model.path={list_config} {list_config / 'config.json'} "
                                          "holds a JSON array, not an object"),
        "model config.json cut short": ([f"actor_rollout_ref.model.path={cut_config}"],
                                        f"actor_rollout_ref.model.path={cut_config} {cut_config / 'config.json'} "
                                        "is not valid JSON"),
        # plan sized the actor's model in the critic's place; train died building the critic
        "critic config.json a JSON list": (["algorithm.adv_estimator=gae", f"critic.model.path={list_config}"],
                                           f"critic.model.path={list_config} config.json holds a JSON array, not an "
                                           "object"),
        "reward model of an unsupported family": (
            ["reward_model.enable=true", f"reward_model.model.path={gemma_reward}"],
            f"reward_model.model.path={gemma_reward} unsupported architectures=['Gemma2ForCausalLM'] in config.json; "
            "supported: LlamaForCausalLM"),
        "fewer rows than a batch": ([f"data.train_files=[{small}]"],
                                    "data.train_batch_size=8 is more than the 4 rows of data.train_files"),
        "chat messages, template off": ([f"data.train_files=[{chat}]", "data.apply_chat_template=false"],
                                        f"data.apply_chat_template=False but the prompts of {chat} are chat messages"),
        "prompt column misnamed": (["data.prompt_key=promt"],
                                   "data.prompt_key=promt is not a column of"),
        "reward column misnamed": (["data.reward_key=reward"],
                                   "data.reward_key=reward is not a column of"),
        "missing custom reward file": ([f"algorithm.custom_reward_function.path={tmp / 'missing.py'}"],
                                       f"algorithm.custom_reward_function.path={tmp / 'missing.py'} does not exist"),
        "custom reward function misnamed": ([f"algorithm.custom_reward_function.path={tmp / 'other_name.py'}"],
                                            "algorithm.custom_reward_function.name=compute_score custom reward file"),
        "custom reward with a wrong signature": ([f"algorithm.custom_reward_function.path={tmp / 'one_arg.py'}"],
                                                 "algorithm.custom_reward_function.name=compute_score cannot take the "
                                                 "reward call"),
        "verl-style reward with the response parameter renamed": (
            [f"algorithm.custom_reward_function.path={tmp / 'verl_misnamed.py'}"],
            "algorithm.custom_reward_function.name=compute_score cannot take the reward call (verl's convention, "
            "called as fn(solution_str=..., ground_truth=..., data_source=..., extra_info=...): the response is "
            "passed as solution_str): missing a required argument: 'solution'"),
        # train: the images were dropped silently, each prompt trained as if it had none
        "multimodal images column": ([f"data.train_files=[{images}]"],
                                     f"data.train_files={images} has the column 'images' (verl's multimodal inputs): "
                                     "hybridrl trains text-only models"),
        # train: verl's tool-agent rows answered in one turn without tools, the column dropped silently
        "verl tool-agent rows in a single-turn job": (
            [f"data.train_files=[{tool_agent}]"],
            f"data.train_files={tool_agent} has agent_name='tool_agent' (verl's tool-calling loop for the row), but "
            "actor_rollout_ref.rollout.multi_turn.enable=false"),
        "custom reward file that fails to import": ([f"algorithm.custom_reward_function.path={tmp / 'raises.py'}"],
                                                    "No module named 'no_such_module_anywhere'"),
        # train died ~13 s in, when it started its metric sinks; wandb is not in this environment (checked below)
        "logger whose package is missing": (["trainer.logger=['console','wandb']"],
                                            "trainer.logger=['console', 'wandb'] has 'wandb', but its package does "
                                            "not import here (ModuleNotFoundError: No module named 'wandb'): `pip "
                                            "install wandb`"),
    }


MISTAKES = ["missing data file", "hub dataset id", "misspelled scorer", "missing model folder",
            "hub id not in the cache", "model without weights", "model without tokenizer", "corrupt tokenizer.json",
            "tokenizer larger than the model's vocabulary", "critic vocabulary smaller than the policy's tokenizer",
            "truncated weights", "empty weights file", "config.json not the weights'",
            "model config.json a JSON list", "model config.json cut short", "critic config.json a JSON list",
            "reward model of an unsupported family", "fewer rows than a batch",
            "chat messages, template off", "prompt column misnamed", "reward column misnamed",
            "missing custom reward file", "custom reward function misnamed", "custom reward with a wrong signature",
            "verl-style reward with the response parameter renamed", "multimodal images column",
            "verl tool-agent rows in a single-turn job",
            "custom reward file that fails to import", "logger whose package is missing"]


def test_wandb_is_not_in_this_environment():
    """The missing-logger mistake is made with wandb, which the tested stack does not install."""
    import importlib.util

    assert importlib.util.find_spec("wandb") is None


@pytest.fixture(scope="module")
def mistakes(demo_assets, tmp_path_factory) -> dict[str, tuple[list[str], str]]:
    return _mistakes(demo_assets, tmp_path_factory.mktemp("mistakes"))


def test_the_demo_job_passes_every_check(demo_assets, tmp_path):
    """The valid job the mistakes are made on: it plans, files checked (else every refusal below proves nothing)."""
    result = _hybridrl("plan", CONFIG, *demo_overrides(demo_assets, tmp_path))
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("command", ["plan", "train"])
@pytest.mark.parametrize("name", MISTAKES)
def test_each_mistake_is_refused_before_anything_starts(name, command, mistakes, demo_assets, tmp_path):
    overrides, expected = mistakes[name]
    result = _hybridrl(command, CONFIG, *demo_overrides(demo_assets, tmp_path), *overrides,
                       env={"HF_HUB_CACHE": str(tmp_path / "empty-hub-cache")})
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    assert expected in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert "stack: python=" not in result.stderr  # train stopped at its plan: not even the stack was looked at
    assert not (tmp_path / "ckpt").exists()


def test_json_report_names_the_input_problems(demo_assets, tmp_path):
    result = _hybridrl("plan", CONFIG, "--format", "json", *demo_overrides(demo_assets, tmp_path),
                       f"data.train_files=[{tmp_path / 'nope.jsonl'}]", "algorithm.reward_fn=gsm8kk")
    assert result.returncode == 2
    report = json.loads(result.stderr)
    assert [e["field"] for e in report["errors"]] == ["data.train_files", "algorithm.reward_fn"]
    assert "--layout-only" in report["hint"]  # a file is absent: planning the layout alone is the way out


def test_layout_only_plans_a_shape_only_folder(tmp_path):
    """The GPU examples name folders holding a config.json only: the full check refuses them (no weights, no
    tokenizer, no data here) and says how to size the layout anyway; --layout-only does."""
    example = str(ROOT / "configs/examples/qwen2.5_7b_grpo_8gpu.yaml")
    refused = _hybridrl("plan", example)
    assert refused.returncode == 2 and "holds no weights" in refused.stderr
    assert refused.stderr.rstrip().endswith("run `hybridrl plan --layout-only`")
    assert _hybridrl("plan", example, "--layout-only").returncode == 0


def test_a_hub_id_in_the_local_cache_is_its_snapshot_folder(demo_assets, tmp_path):
    """As `from_pretrained(local_files_only=True)` resolves it: the hub cache's refs/main names the snapshot
    (huggingface_hub's own layout and lookup, offline). The plan trains from that folder."""
    cache = tmp_path / "hub"
    snapshot = cache / "models--acme--tiny-demo" / "snapshots" / "0123456789abcdef"
    shutil.copytree(demo_assets / "model", snapshot)
    (cache / "models--acme--tiny-demo" / "refs").mkdir()
    (cache / "models--acme--tiny-demo" / "refs" / "main").write_text("0123456789abcdef")
    result = _hybridrl("plan", CONFIG, "--format", "json", *demo_overrides(demo_assets, tmp_path),
                       "actor_rollout_ref.model.path=acme/tiny-demo", env={"HF_HUB_CACHE": str(cache)})
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert Path(plan["config"]["actor_rollout_ref"]["model"]["path"]).resolve() == snapshot.resolve()
    assert any("acme/tiny-demo: a hub id, found in the local Hugging Face cache" in w for w in plan["warnings"])


@pytest.mark.parametrize("row,reason", [
    ({"prompt": None, "reward_model": {"ground_truth": "a"}}, "row 5: no 'prompt' value"),
    ({"prompt": [{"role": "user"}], "reward_model": {"ground_truth": "a"}}, "row 5: message 0 has no string 'content'"),
    # the rule scorer (repeat_letter) compares every response with the row's ground truth: scoring would fail
    ({"prompt": "repeat: a", "reward_model": None}, "row 5: no ground truth: its data.reward_key=reward_model value "
                                                    "is null, NaN or absent"),
    ({"prompt": "repeat: a", "reward_model": {"ground_truth": None}}, "row 5: no ground truth: its "
                                                                      "data.reward_key=reward_model value's "
                                                                      "'ground_truth' is null"),
])
def test_plan_refuses_what_only_reading_every_row_shows(row, reason, demo_assets, tmp_path):
    """A malformed row (past the lines the plan once previewed, and of parquet, whose footer it read): the plan reads
    every row of a file as train reads it (`check_file`, `row_problem`), and refuses naming the file and the row
    (exit 2, no traceback) before any process starts; `train` plans first, so it refuses the same way."""
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [*_rows(70), row, *_rows(10)]))
    files = {data: 70}
    if not isinstance(row["prompt"], list):  # parquet holds one type a column: no messages beside text prompts
        files[write_rows([*_rows(5), row, *_rows(10)], tmp_path / "train.parquet")] = 5
    overrides = [*demo_overrides(demo_assets, tmp_path), f"data.train_files=[{','.join(map(str, files))}]"]
    # train plans first: it refuses the same way (once, for one of the rows: each CLI run costs seconds)
    for command in ("plan", "train") if "'prompt' value" in reason else ("plan",):
        result = _hybridrl(command, CONFIG, *overrides, *(["--no-progress"] if command == "train" else []))
        assert result.returncode == 2, result.stderr[-3000:]
        for index, (file, number) in enumerate(files.items()):
            where = f"data.train_files[{index}]" if len(files) > 1 else "data.train_files"
            assert f"{where}={file} row {number}: {reason.split(': ', 1)[1]}" in result.stderr, result.stderr
        assert "set data.on_malformed=skip to drop such rows" in result.stderr
        assert "Traceback" not in result.stderr and "Started a local Ray" not in result.stderr + result.stdout


def test_verl_reward_specs_without_a_ground_truth_are_refused(demo_assets, tmp_path):
    """Every row's reward spec verl's form without its ground truth ({"style": "rule"}: a file whose rows mix it with
    full specs reads the missing entry as null, refused above): the plan refuses naming the file and the first row,
    where it passed and train scored the dict itself as the ground truth, stopping at the first reward call after
    every worker had started."""
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({**r, "reward_model": {"style": "rule"}}) + "\n" for r in _rows(12)))
    for path in (data, write_rows([{**r, "reward_model": {"style": "rule"}} for r in _rows(12)],
                                  tmp_path / "train.parquet")):
        result = _hybridrl("plan", CONFIG, *demo_overrides(demo_assets, tmp_path), f"data.train_files=[{path}]")
        assert result.returncode == 2, result.stderr[-3000:]
        expected = (f"data.train_files={path} row 0: no ground truth: its data.reward_key=reward_model value "
                    "{'style': 'rule'} is verl's reward spec without a 'ground_truth' entry")
        assert expected in result.stderr, result.stderr


def test_a_data_source_without_a_scorer_past_the_preview_is_refused_naming_its_row(demo_assets, tmp_path):
    """algorithm.reward_fn=auto scores each row by its data_source; the plan reads every row of the file (it read a
    JSONL file's first lines only), so a source further down (or a row without one) is refused naming its first row
    before any process starts (it stopped the run at the step that sampled it). `train`'s own refusal, of a file
    too large for the plan to read whole, names the prompt."""
    from hybridrl.data.dataset import _PREVIEW_LINES

    rows = _rows(_PREVIEW_LINES + 10)
    rows[_PREVIEW_LINES + 3] = {**rows[0], "data_source": "my/own_source"}
    rows[_PREVIEW_LINES + 5] = {key: value for key, value in rows[0].items() if key != "data_source"}
    data = write_rows(rows, tmp_path / "train.jsonl")
    overrides = [*demo_overrides(demo_assets, tmp_path), f"data.train_files=[{data}]", "algorithm.reward_fn=auto"]
    result = _hybridrl("plan", CONFIG, *overrides)
    assert result.returncode == 2, result.stderr[-3000:]
    assert (f"algorithm.reward_fn=auto finds no scorer for data_source 'my/own_source' of {data} (row "
            f"{_PREVIEW_LINES + 3})") in result.stderr, result.stderr
    assert (f"finds no scorer for data_source 'unknown' (a row without one reads as 'unknown') of {data} (row "
            f"{_PREVIEW_LINES + 5})") in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    # a custom function, or a scorer named for every row, scores them all: the data_source is not read
    from hybridrl.config.loader import load_config
    from hybridrl.data.dataset import PromptDataset
    from hybridrl.data.tokenizer import char_tokenizer

    prompts = PromptDataset(data, char_tokenizer())
    (tmp_path / "mine.py").write_text("def compute_score(response, ground_truth, extra):\n    return 0.0\n")
    for scored_otherwise in (f"algorithm.custom_reward_function.path={tmp_path / 'mine.py'}",
                             "algorithm.reward_fn=repeat_letter"):
        config = load_config(CONFIG, [*overrides, scored_otherwise])
        assert unscored_data_source(config, "data.train_files", prompts) is None
    unscored = unscored_data_source(load_config(CONFIG, overrides), "data.train_files", prompts)
    assert unscored is not None and f"(prompt index {_PREVIEW_LINES + 3}, in data.train_files)" in str(unscored)


def test_a_file_past_the_whole_read_is_previewed_and_the_plan_says_so(demo_assets, tmp_path, monkeypatch):
    """A file of more rows than the plan reads whole (`WHOLE_READ_ROWS`, 50,000) keeps the preview, and the plan's
    warnings say what it checked and that train reads every row; under data.on_malformed=skip the rows train will
    skip are said with their numbers, and one batch is counted from the rows left."""
    import hybridrl.config.inputs as inputs
    from hybridrl.config import plan_from_sources

    rows = _rows(16)
    rows[9] = {"prompt": None, "reward_model": {"ground_truth": "a"}}
    rows[10] = {"prompt": "repeat: a", "reward_model": None}
    data = write_rows(rows, tmp_path / "train.jsonl")
    overrides = [*demo_overrides(demo_assets, tmp_path), f"data.train_files=[{data}]"]
    monkeypatch.setattr(inputs, "WHOLE_READ_ROWS", 15)
    plan = plan_from_sources(CONFIG, [*overrides, "data.train_batch_size=8"], check_files=True)
    assert (f"data.train_files: {data} holds 16 rows, more than the 15 the plan reads whole: it checked its first 64 "
            "lines; train reads and checks every row before any process starts") in plan.warnings
    monkeypatch.setattr(inputs, "WHOLE_READ_ROWS", 16)
    with pytest.raises(ConfigError, match=r"data.train_batch_size=16 is more than the 14 rows"):  # 16 - 2 skipped
        plan_from_sources(CONFIG, [*overrides, "data.on_malformed=skip", "data.train_batch_size=16"],
                          check_files=True)
    plan = plan_from_sources(CONFIG, [*overrides, "data.on_malformed=skip", "data.train_batch_size=8"],
                             check_files=True)
    assert any(w.startswith(f"data.train_files: 2 malformed rows of {data} are skipped (data.on_malformed=skip), e.g. "
                            "row 9: no 'prompt' value") and "; row 10: no ground truth" in w for w in plan.warnings)


def test_a_ground_truth_is_required_where_a_rule_scorer_reads_it(demo_assets, tmp_path):
    """Training rows need one unless a reward model scores them; validation rows always (the rule scores them);
    never under the format check, which reads none, or a user's function, which may not."""
    from hybridrl.config.inputs import ground_truth_required
    from hybridrl.config.loader import load_config

    def required(*overrides: str) -> tuple[bool, bool]:
        config = load_config(CONFIG, [*demo_overrides(demo_assets, tmp_path), *overrides])
        return ground_truth_required(config, "data.train_files"), ground_truth_required(config, "data.val_files")

    assert required() == (True, True)
    assert required("reward_model.enable=true", f"reward_model.model.path={demo_assets / 'model'}") == (False, True)
    assert required("algorithm.reward_fn=think_answer_format") == (False, False)  # the format check, by its alias
    assert required(f"algorithm.custom_reward_function.path={tmp_path / 'mine.py'}") == (False, False)


def test_train_refuses_a_batch_that_filtering_leaves_short(demo_assets, tmp_path):
    """Rows enough for the plan's count, but over-long prompts filtered away leave fewer than one batch."""
    data = write_rows(_rows(6) + _rows(6, prompt=lambda i: "repeat: " + "a" * 200), tmp_path / "long.jsonl")
    result = _hybridrl("train", CONFIG, *demo_overrides(demo_assets, tmp_path), f"data.train_files=[{data}]",
                       "--no-progress")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "data.train_batch_size=8 is more than the 6 usable prompts of data.train_files" in result.stderr
    assert "filtered 6 of 12 prompts longer than 32 tokens" in result.stderr and "Traceback" not in result.stderr


# ---------------------------------------------------------------------------------------------- the pieces
def test_tokenizer_size_counts_every_id_the_tokenizer_can_produce(demo_assets, tmp_path):
    """One more than the highest id: the vocabulary, added tokens, and tokenizer_config.json's added_tokens_decoder
    (transformers adds those); a file, or its folder."""
    from hybridrl.data.tokenizer import tokenizer_size

    assert tokenizer_size(demo_assets / "model") == tokenizer_size(demo_assets / "model" / "tokenizer.json") == 96
    folder = _big_tokenizer(tmp_path / "tok", 50)
    assert tokenizer_size(folder) == 50
    (folder / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {"120": {"content": "<x>"}}}))
    assert tokenizer_size(folder) == 121
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json is not JSON"):
        tokenizer_size(folder)


def test_preview_reads_rows_columns_and_prompt_kind(tmp_path):
    rows = _rows(3, prompt=lambda i: MESSAGES) + _rows(2, prompt=lambda i: MESSAGES)
    for suffix in (".parquet", ".jsonl"):
        preview = preview_file(write_rows(rows, tmp_path / f"d{suffix}"), "prompt")
        assert (preview.rows, preview.prompt_kind) == (5, "messages")
        assert set(preview.columns) == {"prompt", "reward_model", "data_source"}
        text = preview_file(write_rows(_rows(7), tmp_path / f"t{suffix}"), "prompt")
        assert (text.rows, text.prompt_kind) == (7, "text")
        assert preview_file(tmp_path / f"t{suffix}", "question").prompt_kind is None
        assert text.multimodal_columns == ()


def test_preview_finds_multimodal_columns_as_the_dataset_refuses_them(tmp_path):
    """The plan's preview sees verl's images / videos columns (parquet: in the schema; JSONL: a previewed line
    with a non-empty value, as PromptDataset refuses a row), so the plan refuses what train would."""
    rows = [{**row, "videos": [], "images": ["x.png"] if i == 1 else []} for i, row in enumerate(_rows(3))]
    assert preview_file(write_rows(rows, tmp_path / "mm.parquet"), "prompt").multimodal_columns == ("images", "videos")
    assert preview_file(write_rows(rows, tmp_path / "mm.jsonl"), "prompt").multimodal_columns == ("images",)
    empty = [{**row, "images": []} for row in _rows(3)]
    assert preview_file(write_rows(empty, tmp_path / "empty.jsonl"), "prompt").multimodal_columns == ()


def _verl_style(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str == ground_truth)


def _ours(response, ground_truth, extra):
    return float(response == ground_truth)


def _needs_more(response, ground_truth, extra, weight):
    return weight


def _too_few(response):
    return 1.0


def _verl_without_ground_truth(solution_str):
    return 1.0


def _keyword_only(response, ground_truth, extra, *, weight=1.0):
    return weight


def _verl_response_misnamed(data_source, solution, ground_truth, extra_info=None):
    return 1.0


def _only_kwargs(**kwargs):
    return 1.0


@pytest.mark.parametrize("function", [_verl_style, _ours, _needs_more, _too_few, _verl_without_ground_truth,
                                      _keyword_only, _verl_response_misnamed, _only_kwargs, lambda *args: 0.0])
def test_signature_verdict_matches_the_real_call(function):
    """The plan's verdict (binding the arguments, no call) agrees with calling the function as training does."""
    adapted = adapt_reward_function(function)
    try:
        adapted("a", "a", {"data_source": "x", "extra_info": None})
        called = True
    except TypeError:
        called = False
    assert (call_problem(function) is None) is called, inspect.signature(function)


def _verl_with_kwargs(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return kwargs["weight"]


def _verl_weight(data_source, solution_str, ground_truth, extra_info, weight):
    return weight


@pytest.mark.parametrize("function", [_needs_more, _keyword_only, _verl_with_kwargs, _verl_weight, _ours,
                                      _verl_style, _only_kwargs, lambda *args, **kwargs: 0.0])
@pytest.mark.parametrize("reward_kwargs", [{"weight": 2.0}, {"weight": 2.0, "other": 1}, {"solution_str": "x"}])
def test_reward_kwargs_verdict_matches_the_real_call(function, reward_kwargs):
    """custom_reward_function.reward_kwargs: the plan accepts a function taking them (a parameter of each name, or
    **kwargs) and refuses one that cannot, as the call with them would."""
    adapted = adapt_reward_function(function, reward_kwargs)
    try:
        adapted("a", "a", {"data_source": "x", "extra_info": None})
        called = True
    except TypeError:
        called = False
    problem = call_problem(function, reward_kwargs)
    assert (problem is None) is called, (inspect.signature(function), reward_kwargs, problem)
    if problem is not None and call_problem(function) is None:  # the call alone it takes: the kwargs' fault
        assert problem[0] == "reward_kwargs", problem


def test_a_function_that_cannot_take_reward_kwargs_is_refused_naming_the_field(demo_assets, tmp_path):
    (tmp_path / "verl_reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    (tmp_path / "weighted.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, weight=1.0):\n"
        "    return weight\n")
    base = [CONFIG, *demo_overrides(demo_assets, tmp_path), "algorithm.reward_fn=auto"]
    refused = _hybridrl("plan", *base, f"custom_reward_function.path={tmp_path / 'verl_reward.py'}",
                        "+custom_reward_function.reward_kwargs={weight: 2.0}")
    assert refused.returncode == 2, refused.stdout[-2000:]
    assert "algorithm.custom_reward_function.reward_kwargs={'weight': 2.0} cannot be passed" in refused.stderr
    assert "unexpected keyword argument 'weight'" in refused.stderr and "Traceback" not in refused.stderr
    taken = _hybridrl("plan", *base, f"custom_reward_function.path={tmp_path / 'weighted.py'}",
                      "+custom_reward_function.reward_kwargs={weight: 2.0}")
    assert taken.returncode == 0, taken.stderr


def test_the_plan_says_how_the_reward_function_is_called_and_refuses_misplaced_names(demo_assets, tmp_path):
    """A function of meaningless parameter names is called by position: the plan's Reward line says which argument
    gets what, with its time limit and what a failure scores; one whose names stand in another's place is refused
    naming algorithm.custom_reward_function.name."""
    from hybridrl.config import plan_from_sources
    from hybridrl.config.report import render_plan

    (tmp_path / "mine.py").write_text("def score(a, b, c):\n    return float(a == b)\n\n"
                                      "def swapped(ground_truth, response, c):\n    return 0.0\n")
    base = [*demo_overrides(demo_assets, tmp_path), "algorithm.reward_fn=auto",
            f"algorithm.custom_reward_function.path={tmp_path / 'mine.py'}"]
    plan = plan_from_sources(CONFIG, [*base, "algorithm.custom_reward_function.name=score",
                                      "algorithm.custom_reward_function.fallback_score=-1"], check_files=True)
    (line,) = [line for line in render_plan(plan).splitlines() if line.startswith("Reward: ")]
    assert line == (f"Reward: score from {tmp_path / 'mine.py'}, called once per sample as score(a=<the response "
                    "text>, b=<the row's ground truth>, c=<the row's metadata (data_source, extra_info, index, prompt, "
                    "reward_spec)>), by position; each call may take 300 s, in a process of its own, one call after "
                    "another (algorithm.custom_reward_function.timeout_s, num_workers); a call that raises, returns no "
                    "number or times out "
                    "scores -1 (fallback_score)")
    with pytest.raises(ConfigError, match=r"algorithm\.custom_reward_function\.name=swapped has 'ground_truth' as its "
                                          r"parameter 1, where the call passes the response text"):
        plan_from_sources(CONFIG, [*base, "algorithm.custom_reward_function.name=swapped"], check_files=True)


def test_a_tokenizer_without_a_chat_template_is_refused_naming_the_field_it_comes_from(demo_assets, tmp_path):
    """Chat-message prompts, or data.apply_chat_template=true, need the tokenizer's chat template: the refusal names
    the field the tokenizer comes from (model.path when tokenizer_path is unset, not "tokenizer_path=None"), and
    apply_chat_template's once (it was said once per file list, naming neither)."""
    plain = _copy_model(demo_assets, tmp_path / "plain", without=())
    config = json.loads((plain / "tokenizer_config.json").read_text())
    assert config.pop("chat_template")
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    chat = write_rows(_rows(16, prompt=lambda i: MESSAGES), tmp_path / "chat.parquet")
    base = [CONFIG, *demo_overrides(demo_assets, tmp_path)]
    for overrides, expected in (
            ([f"actor_rollout_ref.model.path={plain}", f"data.train_files=[{chat}]"],
             f"actor_rollout_ref.model.path={plain} names a tokenizer without a chat template, but the prompts of "
             f"{chat} are chat messages"),
            ([f"actor_rollout_ref.model.tokenizer_path={plain}", f"data.train_files=[{chat}]"],
             f"actor_rollout_ref.model.tokenizer_path={plain} names a tokenizer without a chat template"),
            ([f"actor_rollout_ref.model.path={plain}", "data.apply_chat_template=true"],
             f"data.apply_chat_template=True but the tokenizer of actor_rollout_ref.model.path={plain} has no chat "
             "template")):
        result = _hybridrl("plan", *base, *overrides)
        assert result.returncode == 2 and result.stderr.count(expected) == 1, result.stderr
        assert "1 config error(s)" in result.stderr, result.stderr


def test_hub_id_and_chat_template_detection(tmp_path):
    assert looks_like_hub_id("Qwen/Qwen2.5-7B-Instruct") and looks_like_hub_id("gpt2")
    assert not looks_like_hub_id(str(tmp_path)) and not looks_like_hub_id("./models/x")
    assert not looks_like_hub_id("models/a/b") and not looks_like_hub_id("")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    assert has_chat_template(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({}))
    assert not has_chat_template(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    assert has_chat_template(tmp_path)


def test_auto_scoring_plans_a_mixed_gsm8k_and_math_job_and_refuses_an_unknown_source(demo_assets, tmp_path):
    """verl's GSM8K + MATH parquet files under the default reward_fn=auto: every data_source is checked to name a
    scorer (parquet: that whole column is read), an unknown one refused naming the file."""
    def rows(source: str, count: int) -> list[dict]:
        return [{**row, "data_source": source} for row in _rows(count)]

    gsm8k = write_rows(rows("openai/gsm8k", 8), tmp_path / "gsm8k.parquet")
    math = write_rows([*rows("DigitalLearningGmbH/MATH-lighteval", 7), *rows("aime24", 1)], tmp_path / "math.parquet")
    base = [*demo_overrides(demo_assets, tmp_path), "algorithm.reward_fn=auto", f"data.val_files=[{gsm8k}]"]
    assert _hybridrl("plan", CONFIG, *base, f"data.train_files=[{gsm8k}]").returncode == 0
    refused = _hybridrl("plan", CONFIG, *base, f"data.train_files=[{gsm8k},{math}]")
    assert refused.returncode == 2
    assert f"algorithm.reward_fn=auto finds no scorer for data_source 'aime24' of {math}" in refused.stderr
    assert refused.stderr.count("finds no scorer") == 1  # the MATH and GSM8K sources are known
    bare = write_rows([{k: v for k, v in row.items() if k != "data_source"} for row in _rows(8)], tmp_path / "b.jsonl")
    no_column = _hybridrl("plan", CONFIG, *base, f"data.train_files=[{bare}]")
    assert no_column.returncode == 2 and "scores each row by its data_source column, which" in no_column.stderr


PYTHON_TOOL = ["actor_rollout_ref.rollout.multi_turn.enable=true",
               "actor_rollout_ref.rollout.multi_turn.tools=[python]"]
# A kernel that refuses user namespaces, for real: the command runs in a user namespace whose
# max_user_namespaces is 0, so nothing it starts can make another (what some container runtimes do).
NO_NAMESPACES = "echo 0 > /proc/sys/user/max_user_namespaces && exec \"$@\""


@pytest.mark.parametrize("command", ["plan", "train"])
def test_the_python_tool_is_refused_where_the_kernel_allows_no_sandbox(command, demo_assets, tmp_path):
    argv = [command, CONFIG, *demo_overrides(demo_assets, tmp_path, *PYTHON_TOOL)]
    assert _hybridrl("plan", *argv[1:]).returncode == 0  # the same job plans where namespaces work
    refused = subprocess.run(["unshare", "--user", "--map-root-user", "sh", "-c", NO_NAMESPACES, "sh",
                              sys.executable, "-m", "hybridrl.cli", *argv],
                             capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert refused.returncode == 2, refused.stderr
    assert ("actor_rollout_ref.rollout.multi_turn.sandbox.isolation=namespaces the python tool's sandbox cannot "
            "start on this machine: bubblewrap could not start a sandbox here (bwrap: Creating new namespace "
            "failed") in refused.stderr
    assert "sandbox.isolation=none" in refused.stderr and "Traceback" not in refused.stderr
    assert not (tmp_path / "ckpt").exists()
    opted_out = subprocess.run(["unshare", "--user", "--map-root-user", "sh", "-c", NO_NAMESPACES, "sh",
                                sys.executable, "-m", "hybridrl.cli", "plan", *argv[1:],
                                "actor_rollout_ref.rollout.multi_turn.sandbox.isolation=none"],
                               capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert opted_out.returncode == 0, opted_out.stderr
    assert "sandbox.isolation=none: the python tool runs model-written code as a plain subprocess" in (
        opted_out.stdout + opted_out.stderr)


def test_an_empty_training_file_list_is_one_problem(demo_assets, tmp_path):
    result = _hybridrl("plan", CONFIG, *demo_overrides(demo_assets, tmp_path), "data.train_files=[]")
    assert result.returncode == 2
    problems = [line for line in result.stderr.splitlines() if line.startswith("  - ")]
    assert problems == ["  - data.train_files=[] is empty; name local parquet or JSONL files of prompts (the format: "
                        "docs/user-guide.md#data)"], result.stderr


def test_pickled_weights_are_refused_with_the_command_that_resaves_them(demo_assets, tmp_path):
    """A folder with pytorch_model.bin only (older hub checkpoints): refused, with a transformers command that
    re-saves the same weights as safetensors; run as given (DIR: the folder), the plan then accepts the folder
    and the weights are the .bin's, tensor for tensor."""
    import torch
    from safetensors.torch import load_file

    folder = _copy_model(demo_assets, tmp_path / "bin-only", without=("model.safetensors",))
    original = load_file(demo_assets / "model" / "model.safetensors")
    torch.save(original, folder / "pytorch_model.bin")
    overrides = [*demo_overrides(demo_assets, tmp_path), f"actor_rollout_ref.model.path={folder}"]
    refused = _hybridrl("plan", CONFIG, *overrides)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "found pytorch_model.bin: only safetensors are supported" in refused.stderr
    command = refused.stderr.split('python -c "', 1)[1].split('"', 1)[0].replace("DIR", str(folder))
    subprocess.run([sys.executable, "-c", command], check=True, capture_output=True, timeout=120)
    assert _hybridrl("plan", CONFIG, *overrides).returncode == 0
    resaved = load_file(folder / "model.safetensors")
    assert sorted(resaved) == sorted(original)
    assert all(torch.equal(resaved[name], original[name]) for name in original)


def test_preview_finds_verls_agent_names_as_the_dataset_reads_them(tmp_path):
    rows = [{**row, "agent_name": name} for row, name in zip(_rows(3), ("tool_agent", None, "single_turn_agent"))]
    for suffix in (".parquet", ".jsonl"):
        preview = preview_file(write_rows(rows, tmp_path / f"a{suffix}"), "prompt")
        assert preview.agent_names == {"tool_agent", "single_turn_agent"}
    assert preview_file(write_rows(_rows(3), tmp_path / "none.jsonl"), "prompt").agent_names == frozenset()
