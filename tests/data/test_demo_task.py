"""The demo's character tokenizer, the repeat-letter task and its random baseline, and the data tools."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybridrl.data.dataset import PromptDataset, read_rows
from hybridrl.data.demo_task import (
    DATA_SOURCE,
    RepeatLetterTask,
    random_baseline,
    random_responses,
    repeat_letter_score,
)
from hybridrl.data.gsm8k import Gsm8kFormatError, convert_rows
from hybridrl.data.tokenizer import CHAR_VOCAB_SIZE, char_tokenizer, load_tokenizer, save_char_tokenizer
from hybridrl.rewards.registry import get_scorer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


# ------------------------------------------------------------------------------ tokenizer
def test_char_tokenizer_matches_the_tiny_model(tokenizer) -> None:
    config = json.loads((REPO / "configs/models/tiny-demo/config.json").read_text())
    assert len(tokenizer) == CHAR_VOCAB_SIZE == config["vocab_size"] == 96
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    text = "repeat: abc {x}\n\\frac{1}{2} #### -42"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token per character
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids + [tokenizer.eos_token_id, tokenizer.pad_token_id], skip_special_tokens=True) == text
    assert tokenizer("~", add_special_tokens=False)["input_ids"] == [tokenizer.unk_token_id]  # a dropped character


def test_load_tokenizer_from_file_folder_and_model_folder(tmp_path: Path, tokenizer) -> None:
    folder = tmp_path / "tok"
    tokenizer_file = save_char_tokenizer(folder)
    # next to a model config.json: AutoTokenizer would build the model's tokenizer class instead
    (folder / "config.json").write_text((REPO / "configs/models/tiny-demo/config.json").read_text())
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    for source in (folder, tokenizer_file, bare, bare / "tokenizer.json"):
        loaded = load_tokenizer(source)
        assert loaded("copy: ab", add_special_tokens=False)["input_ids"] == tokenizer("copy: ab")["input_ids"]
        assert (loaded.pad_token_id, loaded.eos_token_id) == (0, 2), source
    assert load_tokenizer(folder).chat_template == tokenizer.chat_template
    # a normal HF tokenizer folder (save_pretrained) goes through AutoTokenizer
    hf_folder = tmp_path / "hf"
    tokenizer.save_pretrained(hf_folder)
    from_hf = load_tokenizer(hf_folder)
    assert from_hf("copy: ab", add_special_tokens=False)["input_ids"] == tokenizer("copy: ab")["input_ids"]
    assert from_hf.eos_token_id == 2
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")


# ---------------------------------------------------------------------------------- task
def test_rows_are_seeded_and_well_formed() -> None:
    task = RepeatLetterTask()
    rows = task.make_rows(50, seed=3)
    assert rows == task.make_rows(50, seed=3)
    assert rows != task.make_rows(50, seed=4)
    assert rows != task.make_rows(50, seed=3, split="val")
    for row in rows:
        letter = row["reward_model"]["ground_truth"][0]
        assert row["prompt"].startswith("repeat: ") and set(row["prompt"][len("repeat: "):]) == {letter}
        assert row["reward_model"]["ground_truth"] == letter * task.min_length
        assert row["data_source"] == DATA_SOURCE
    assert {row["reward_model"]["ground_truth"][0] for row in rows} == set(task.alphabet)
    with pytest.raises(ValueError, match="distinct"):
        RepeatLetterTask(alphabet="aab")


@pytest.mark.parametrize(
    ("response", "score"),
    [("cccc", 1.0), ("cccccccc", 1.0), ("ccxc", 0.75), ("cc", 0.5), ("", 0.0), ("dddd", 0.0), ("ccccxxxx", 0.5),
     ("C", 0.0)],
)
def test_repeat_letter_score(response: str, score: float) -> None:
    result = repeat_letter_score(response, "cccc")
    assert result.score == pytest.approx(score)
    assert result.acc == (score == 1.0)
    assert get_scorer("repeat_letter") is get_scorer(DATA_SOURCE)


def test_random_baseline_is_far_below_the_demo_target(tokenizer) -> None:
    # A random-init model samples nearly uniformly from 96 tokens: its reward is ~1/96 per character.
    texts = random_responses(tokenizer, 500, max_length=16, seed=0)
    assert all(len(t) <= 16 for t in texts)
    assert any(len(t) < 12 for t in texts)  # some stop early at a sampled EOS
    baseline = random_baseline(tokenizer, num_samples=2000, max_length=16, seed=0)
    assert 0.003 < baseline < 0.03, baseline
    # The best answer ignoring the prompt (always the same letter) gets 1/len(alphabet).
    task = RepeatLetterTask()
    rows = task.make_rows(2000, seed=1)
    constant = sum(repeat_letter_score("aaaa", r["reward_model"]["ground_truth"]).score for r in rows) / len(rows)
    assert constant == pytest.approx(1 / len(task.alphabet), abs=0.03)


def run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_make_demo_data_tool_writes_loadable_files(tmp_path: Path, tokenizer) -> None:
    result = run_tool("tools/make_demo_data.py", "--out-dir", str(tmp_path), "--train-rows", "40",
                      "--val-rows", "8", "--seed", "5")
    assert result.returncode == 0, result.stderr
    train = PromptDataset(tmp_path / "train.jsonl", tokenizer, max_prompt_length=32)
    assert len(train) == 40 and train.stats.filtered_overlong == 0
    assert train[0].data_source == DATA_SOURCE
    assert read_rows(tmp_path / "train.jsonl") == RepeatLetterTask().make_rows(40, seed=5)
    assert len(read_rows(tmp_path / "val.jsonl")) == 8


# ---------------------------------------------------------------------------------- gsm8k
GSM8K_ROWS = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A car costs $12,000 less $500. Price?", "answer": "12000 - 500 = 11500\n#### 11,500"},
    {"question": "Temperature drops from 2 by 5?", "answer": "2 - 5 = -3\n#### -3"},
]


def test_gsm8k_conversion(tmp_path: Path, tokenizer) -> None:
    rows, report = convert_rows(GSM8K_ROWS, "train")
    assert report.converted == 3
    assert [row["reward_model"]["ground_truth"] for row in rows] == ["7", "11500", "-3"]
    first = rows[0]
    assert first["data_source"] == "openai/gsm8k"
    assert first["prompt"][0]["role"] == "user" and first["prompt"][0]["content"].startswith("Tom has 3 apples")
    assert first["extra_info"]["index"] == 0 and first["extra_info"]["split"] == "train"
    # the converted rows score with the gsm8k scorer found through their data_source
    assert get_scorer(first["data_source"])("... #### 11,500", rows[1]["reward_model"]["ground_truth"], {}).acc
    with pytest.raises(Gsm8kFormatError, match="row 1: the answer has no '#### <number>' line"):
        convert_rows([GSM8K_ROWS[0], {"question": "q", "answer": "no marker"}], "train")
    kept, report = convert_rows([GSM8K_ROWS[0], {"question": "q"}], "train", skip_bad=True)
    assert len(kept) == 1 and report.skipped == ["row 1: no 'answer' text"]


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_prepare_gsm8k_tool(tmp_path: Path, tokenizer, suffix: str) -> None:
    source = tmp_path / "gsm8k.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in GSM8K_ROWS))
    output = tmp_path / f"train.{suffix}"
    result = run_tool("tools/prepare_gsm8k.py", "--input", str(source), "--output", str(output))
    assert result.returncode == 0, result.stderr
    assert "wrote 3 rows" in result.stdout
    dataset = PromptDataset(output, tokenizer, apply_chat_template=True, max_prompt_length=512)
    assert [item.ground_truth for item in dataset] == ["7", "11500", "-3"]
    assert dataset[0].prompt_text.startswith("user: Tom has 3 apples")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "none"}) + "\n")
    result = run_tool("tools/prepare_gsm8k.py", "--input", str(bad), "--output", str(tmp_path / "x.jsonl"))
    assert result.returncode == 1 and "row 0" in result.stderr
