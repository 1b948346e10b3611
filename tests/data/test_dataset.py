"""PromptDataset: parquet and JSONL through pyarrow, chat templates, over-long prompts, bad rows."""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridrl.data.dataset import DatasetError, PromptDataset
from hybridrl.data.tokenizer import CHAR_CHAT_TEMPLATE, char_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def rows_with_lengths(lengths: list[int]) -> list[dict]:
    return [
        {"prompt": "x" * n, "reward_model": {"ground_truth": str(i)}, "data_source": "toy", "extra_info": {"i": i}}
        for i, n in enumerate(lengths)
    ]


@pytest.mark.parametrize("writer", [write_jsonl, write_parquet], ids=["jsonl", "parquet"])
def test_reads_text_prompts_with_metadata(tmp_path: Path, tokenizer, writer) -> None:
    rows = rows_with_lengths([3, 5])
    file = writer(tmp_path / ("data.jsonl" if writer is write_jsonl else "data.parquet"), rows)
    dataset = PromptDataset(file, tokenizer, max_prompt_length=16)
    assert len(dataset) == 2
    first = dataset[0]
    assert first.input_ids == tuple(tokenizer("xxx")["input_ids"])
    assert tokenizer.decode(list(first.input_ids)) == "xxx"
    assert first.ground_truth == "0"
    assert first.reward_spec == {"ground_truth": "0"}
    assert first.data_source == "toy"
    assert first.extra_info == {"i": 0}
    assert [item.index for item in dataset] == [0, 1]


def test_several_files_keep_a_global_index(tmp_path: Path, tokenizer) -> None:
    a = write_jsonl(tmp_path / "a.jsonl", rows_with_lengths([1, 2]))
    b = write_parquet(tmp_path / "b.parquet", rows_with_lengths([3]))
    dataset = PromptDataset([a, b], tokenizer, max_prompt_length=8)
    assert [item.index for item in dataset] == [0, 1, 2]
    assert [item.source_file for item in dataset] == [str(a), str(a), str(b)]


def test_bare_ground_truth_and_missing_data_source(tmp_path: Path, tokenizer) -> None:
    file = write_jsonl(tmp_path / "d.jsonl", [{"question": "hi", "answer": 42}])
    dataset = PromptDataset(file, tokenizer, prompt_key="question", reward_key="answer")
    assert dataset[0].ground_truth == 42
    assert dataset[0].data_source == "unknown"


def test_chat_template_for_messages_and_text(tmp_path: Path, tokenizer) -> None:
    rows = [
        {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]},
        {"prompt": "hello"},
    ]
    # JSONL and parquet both hand pyarrow's unified structs back; the template must not see None keys.
    for file in (write_jsonl(tmp_path / "c.jsonl", rows), write_parquet(tmp_path / "c.parquet", rows[:1])):
        dataset = PromptDataset(file, tokenizer, apply_chat_template=True)
        assert dataset[0].prompt_text == "system: be brief\nuser: 2+2?\nassistant: "
        assert tokenizer.decode(list(dataset[0].input_ids)) == dataset[0].prompt_text
    assert dataset_text(tmp_path, tokenizer, rows) == "user: hello\nassistant: "


CHAT_WITH_TOOLS = ("{% if tools %}tools: {% for t in tools %}{{ t['function']['name'] }} {% endfor %}. {% endif %}"
                   + CHAR_CHAT_TEMPLATE)


def test_tool_schemas_reach_the_chat_template(tmp_path: Path) -> None:
    """rollout.multi_turn: the trainer hands the tools' schemas to the template, which shows them."""
    tok = char_tokenizer(chat_template=CHAT_WITH_TOOLS)
    schema = {"type": "function", "function": {"name": "calculator", "description": "d", "parameters": {}}}
    file = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "2+2?"}])
    with_tools = PromptDataset(file, tok, apply_chat_template=True, tools=[schema])
    assert with_tools[0].prompt_text == "tools: calculator . user: 2+2?\nassistant: "
    assert PromptDataset(file, tok, apply_chat_template=True)[0].prompt_text == "user: 2+2?\nassistant: "


def dataset_text(tmp_path: Path, tokenizer, rows: list[dict]) -> str:
    dataset = PromptDataset(write_jsonl(tmp_path / "t.jsonl", rows), tokenizer, apply_chat_template=True)
    return dataset[1].prompt_text


def test_messages_are_templated_unless_the_template_is_turned_off(tmp_path: Path, tokenizer) -> None:
    """verl's data (chat messages) works unchanged: by default messages go through the chat template and text
    prompts stay as they are; apply_chat_template=false refuses messages, naming the setting."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    file = write_jsonl(tmp_path / "m.jsonl", [{"prompt": messages}, {"prompt": "plain text"}])
    by_default = PromptDataset(file, tokenizer)
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert by_default[0].prompt_text == expected == "system: be brief\nuser: hi\nassistant: "
    assert by_default[0].input_ids == tuple(tokenizer(expected, add_special_tokens=False)["input_ids"])
    assert by_default[1].prompt_text == "plain text"  # text prompts untouched (no template) by default
    with pytest.raises(DatasetError, match="apply_chat_template is false; unset it or set it true"):
        PromptDataset(file, tokenizer, apply_chat_template=False)
    bare = char_tokenizer(chat_template=None)
    with pytest.raises(DatasetError, match="row 0: the prompt is a list of chat messages but the tokenizer has no"):
        PromptDataset(file, bare)


def test_apply_chat_template_needs_a_template(tmp_path: Path) -> None:
    bare = char_tokenizer(chat_template=None)
    file = write_jsonl(tmp_path / "m.jsonl", [{"prompt": "hi"}])
    with pytest.raises(DatasetError, match="no chat template"):
        PromptDataset(file, bare, apply_chat_template=True)
    bare.chat_template = CHAR_CHAT_TEMPLATE
    assert PromptDataset(file, bare, apply_chat_template=True)[0].prompt_text.startswith("user: hi")


def test_overlong_prompts_are_filtered_and_counted(tmp_path: Path, tokenizer, caplog) -> None:
    lengths = [4, 9, 5, 12, 8, 6]  # 9 and 12 exceed 8
    file = write_jsonl(tmp_path / "f.jsonl", rows_with_lengths(lengths))
    with caplog.at_level(logging.INFO, logger="hybridrl.data.dataset"):
        dataset = PromptDataset(file, tokenizer, max_prompt_length=8)
    assert [len(item.input_ids) for item in dataset] == [4, 5, 8, 6]
    assert [item.index for item in dataset] == [0, 2, 4, 5]  # indices point back to the file rows
    assert dataset.stats.filtered_overlong == 2 and dataset.stats.kept == 4 and dataset.stats.total_rows == 6
    assert "filtered 2 of 6 prompts longer than 8 tokens" in caplog.text
    assert "filtered 2 of 6 prompts longer than 8 tokens" in dataset.stats.summary()


def test_truncation_modes(tmp_path: Path, tokenizer) -> None:
    file = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "abcdefgh"}, {"prompt": "abc"}])
    left = PromptDataset(file, tokenizer, max_prompt_length=5, filter_overlong_prompts=False, truncation="left")
    right = PromptDataset(file, tokenizer, max_prompt_length=5, filter_overlong_prompts=False, truncation="right")
    assert tokenizer.decode(list(left[0].input_ids)) == "defgh"
    assert tokenizer.decode(list(right[0].input_ids)) == "abcde"
    # verl's middle: the first 5 // 2 tokens and the last 5 - 5 // 2
    middle = PromptDataset(file, tokenizer, max_prompt_length=5, filter_overlong_prompts=False, truncation="middle")
    assert tokenizer.decode(list(middle[0].input_ids)) == "abfgh" and middle.stats.truncated == 1
    assert tokenizer.decode(list(middle[1].input_ids)) == "abc"
    assert left[0].truncated and not left[1].truncated
    assert left.stats.truncated == 1
    with pytest.raises(DatasetError, match=r"t\.jsonl, row 0: the prompt has 8 tokens"):
        PromptDataset(file, tokenizer, max_prompt_length=5, filter_overlong_prompts=False, truncation="error")


def test_all_prompts_filtered_is_an_error(tmp_path: Path, tokenizer) -> None:
    file = write_jsonl(tmp_path / "long.jsonl", rows_with_lengths([10, 11]))
    with pytest.raises(DatasetError, match="no usable prompts.*filtered 2 of 2"):
        PromptDataset(file, tokenizer, max_prompt_length=4)


@pytest.mark.parametrize(
    ("bad_row", "reason"),
    [
        ({"other": "x"}, "no 'prompt' value"),
        ({"prompt": None}, "no 'prompt' value"),
        ({"prompt": "   "}, "empty string"),
        ({"prompt": []}, "message list is empty"),
        ({"prompt": [{"role": "user"}]}, "no string 'content'"),
        # verl's multimodal messages: content parts, which a text-only model has no input for
        ({"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}]},
         r"message 0's content is a list of parts \(multimodal"),
    ],
)
def test_malformed_rows_error_names_file_and_row(tmp_path: Path, tokenizer, bad_row: dict, reason: str) -> None:
    """Train's read refuses the row naming it; the plan's whole read (`check_file`) finds the same row, same reason."""
    from hybridrl.data.dataset import check_file

    file = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok"}, {"prompt": "fine"}, bad_row])
    with pytest.raises(DatasetError, match=rf"bad\.jsonl, row 2: .*{reason}") as refused:
        PromptDataset(file, tokenizer, apply_chat_template=True)
    checked = check_file(file, "prompt")
    assert checked.whole and checked.malformed_rows == 1 and checked.malformed[0][0] == 2
    assert f"row 2: {checked.malformed[0][1]} (" in str(refused.value)


@pytest.mark.parametrize("writer", [write_jsonl, write_parquet], ids=["jsonl", "parquet"])
def test_rows_with_images_are_refused_not_trained_without_them(tmp_path: Path, tokenizer, writer) -> None:
    """verl's multimodal rows (an images or videos column): the text-only model would train on each prompt as if it
    had no image, so a row that has one stops the build (whatever on_malformed says: it is the file's kind, not a bad
    row); an empty or null images value is text alone."""
    rows = [{"prompt": "a", "images": []}, {"prompt": "b", "images": None},
            {"prompt": "c", "images": [{"image": "file:///photo.png"}]}]
    file = writer(tmp_path / ("mm.jsonl" if writer is write_jsonl else "mm.parquet"), rows)
    for on_malformed in ("error", "skip"):
        with pytest.raises(DatasetError, match=r"mm\.(jsonl|parquet), row 2 has 'images' \(verl's multimodal inputs\)"):
            PromptDataset(file, tokenizer, on_malformed=on_malformed)
    text_only = writer(tmp_path / ("text.jsonl" if writer is write_jsonl else "text.parquet"), rows[:2])
    assert [item.raw_prompt for item in PromptDataset(text_only, tokenizer)] == ["a", "b"]


def test_malformed_rows_can_be_skipped_with_a_count(tmp_path: Path, tokenizer, caplog) -> None:
    file = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok"}, {"q": "x"}, {"prompt": "fine"}, {"prompt": ""}])
    with caplog.at_level(logging.WARNING, logger="hybridrl.data.dataset"):
        dataset = PromptDataset(file, tokenizer, on_malformed="skip")
    assert [item.index for item in dataset] == [0, 2]
    assert dataset.stats.skipped_malformed == 2
    assert "skipped 2 malformed rows of 4" in caplog.text and "row 1" in caplog.text


def test_wrong_type_and_bad_lines_in_jsonl(tmp_path: Path, tokenizer) -> None:
    # pyarrow reads a JSONL file as one table: a number among text prompts fails the whole file,
    # which is then read line by line so the error can name the row.
    file = tmp_path / "typed.jsonl"
    file.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": 5}\nnot json\n{"prompt": "c"}\n')
    with pytest.raises(DatasetError, match=r"typed\.jsonl, row 2: the prompt is a int"):
        PromptDataset(file, tokenizer)
    file.write_text('{"prompt": "a"}\n\nnot json\n')
    with pytest.raises(DatasetError, match=r"typed\.jsonl, row 1: unreadable JSON line"):
        PromptDataset(file, tokenizer)
    file.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": 5}\nnot json\n{"prompt": "c"}\n')
    dataset = PromptDataset(file, tokenizer, on_malformed="skip")
    assert [tokenizer.decode(list(item.input_ids)) for item in dataset] == ["a", "b", "c"]
    assert dataset.stats.skipped_malformed == 2
    from hybridrl.data.dataset import check_file  # the plan's whole read: the rows train skips, by their numbers

    checked = check_file(file, "prompt")
    assert [row for row, _ in checked.malformed] == [2, 3] and checked.malformed_rows == 2 and checked.rows == 5
    assert checked.malformed[0][1] == "the prompt is a int; expected a string or a list of chat messages"
    assert checked.malformed[1][1].startswith("unreadable JSON line")


def test_json_lines_whose_arrays_mix_kinds_are_read_as_written(tmp_path: Path, tokenizer) -> None:
    """JSON arrays may mix kinds (verl's extra_info, a list of mixed answers); an arrow list holds one value type, so
    pyarrow cannot read such a line even on its own. It is valid JSON: each row is what json.loads makes of its line,
    not an "unreadable JSON line"."""
    rows = [{"prompt": "a", "reward_model": {"ground_truth": [1, "one"]}, "extra_info": {"tools": [1, {"k": "é😀"}]}},
            {"prompt": "b", "reward_model": {"ground_truth": "2"}, "extra_info": {"tools": []}},
            {"prompt": "c", "reward_model": {"ground_truth": [[1, 2], "x", None]}, "extra_info": None}]
    file = write_jsonl(tmp_path / "mixed.jsonl", rows)
    dataset = PromptDataset(file, tokenizer, require_ground_truth=True)
    expected = [json.loads(line) for line in file.read_text().splitlines()]
    assert [item.ground_truth for item in dataset] == [row["reward_model"]["ground_truth"] for row in expected]
    assert [item.extra_info for item in dataset] == [row["extra_info"] for row in expected]
    assert dataset.stats.kept == 3 and dataset.stats.skipped_malformed == 0


def test_a_bad_json_line_names_one_row_and_the_config_field(tmp_path: Path, tokenizer) -> None:
    """pyarrow parses each line of a file it cannot read whole as a table of its own, so its message ends in that
    one-line table's " in row 0": the error says the file's row alone, and names the setting as the config does."""
    file = tmp_path / "bad.jsonl"
    lines = [json.dumps({"prompt": f"p{i}"}) for i in range(30)]
    lines[20] = '{"prompt": broken'
    file.write_text("\n".join(lines) + "\n")
    with pytest.raises(DatasetError) as info:
        PromptDataset(file, tokenizer)
    message = str(info.value)
    assert f"{file}, row 20: unreadable JSON line: " in message
    assert "in row" not in message and message.count("row ") == 1, message
    assert "data.on_malformed=skip" in message


def test_a_row_without_a_ground_truth_is_malformed_where_one_is_required(tmp_path: Path, tokenizer) -> None:
    """A rule scorer compares each response with its row's ground truth: with require_ground_truth a row whose
    reward column is null (or whose ground_truth entry is) is refused naming the file, row and data.reward_key, or
    skipped and counted; a bare ground truth (a value, or a dict without a ground_truth entry: countdown's) is one."""
    rows = [{"prompt": "a", "answer": {"ground_truth": "1"}}, {"prompt": "b", "answer": "2"},
            {"prompt": "c", "answer": None}, {"prompt": "d", "answer": {"ground_truth": None}}]
    file = write_jsonl(tmp_path / "gt.jsonl", rows)
    bare = write_jsonl(tmp_path / "countdown.jsonl", [{"prompt": "e", "answer": {"target": 3, "numbers": [1, 2]}}])
    assert len(PromptDataset(bare, tokenizer, reward_key="answer", require_ground_truth=True)) == 1
    assert len(PromptDataset(file, tokenizer, reward_key="answer")) == 4  # not required: the user's function decides
    with pytest.raises(DatasetError, match=r"gt\.jsonl, row 2: no ground truth: its data\.reward_key=answer value is "
                                           r"null, NaN or absent"):
        PromptDataset(file, tokenizer, reward_key="answer", require_ground_truth=True)
    dataset = PromptDataset(file, tokenizer, reward_key="answer", require_ground_truth=True, on_malformed="skip")
    assert [item.index for item in dataset] == [0, 1] and dataset.stats.skipped_malformed == 2
    assert "row 3: no ground truth: its data.reward_key=answer value's 'ground_truth' is null" in \
        "; ".join(dataset.stats.malformed_examples)


def test_a_nan_ground_truth_is_missing_where_one_is_required(tmp_path: Path, tokenizer) -> None:
    """pandas writes a missing number as NaN: a rule scorer would compare the response with the text 'nan' and score
    the row 0 every time, so a NaN ground truth (bare, or the dict's entry) is a missing one, refused or counted."""
    bare = write_parquet(tmp_path / "bare.parquet",
                         [{"prompt": "a", "answer": 3.0}, {"prompt": "b", "answer": math.nan}])
    with pytest.raises(DatasetError, match=r"bare\.parquet, row 1: no ground truth: .* null, NaN or absent"):
        PromptDataset(bare, tokenizer, reward_key="answer", require_ground_truth=True)
    rows = [{"prompt": "a", "reward_model": {"ground_truth": 3.0}},
            {"prompt": "b", "reward_model": {"ground_truth": math.nan}}]
    nested = write_parquet(tmp_path / "nested.parquet", rows)
    dataset = PromptDataset(nested, tokenizer, require_ground_truth=True, on_malformed="skip")
    assert [item.ground_truth for item in dataset] == [3.0] and dataset.stats.skipped_malformed == 1
    assert "row 1: no ground truth: its data.reward_key=reward_model value's 'ground_truth' is null or NaN" in \
        dataset.stats.malformed_examples[0]
    assert len(PromptDataset(nested, tokenizer)) == 2  # not required: a user's function decides what NaN means


def test_date_like_text_stays_text(tmp_path: Path, tokenizer) -> None:
    # pyarrow would infer these as timestamps; a prompt or ground truth must stay the written string.
    rows = [
        {"prompt": "2024-01-01", "reward_model": {"ground_truth": "2023-10-05 10:00:00"}},
        {"prompt": "when?", "reward_model": {"ground_truth": "1999-12-31"}},
    ]
    dataset = PromptDataset(write_jsonl(tmp_path / "dates.jsonl", rows), tokenizer)
    assert dataset[0].raw_prompt == "2024-01-01"
    assert [item.ground_truth for item in dataset] == ["2023-10-05 10:00:00", "1999-12-31"]
    # the same through the line-by-line path (a type conflict elsewhere in the file)
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [*rows, {"prompt": "x", "reward_model": {"ground_truth": 5}}])
    assert PromptDataset(mixed, tokenizer)[1].ground_truth == "1999-12-31"


def test_json_array_file_is_explained(tmp_path: Path, tokenizer) -> None:
    file = tmp_path / "array.json"
    file.write_text(json.dumps([{"prompt": "a"}]))
    with pytest.raises(DatasetError, match="one JSON array; hybridrl reads JSON lines"):
        PromptDataset(file, tokenizer)


def test_wrong_type_in_parquet_row(tmp_path: Path, tokenizer) -> None:
    file = write_parquet(tmp_path / "p.parquet", [{"prompt": "a", "n": 1}, {"prompt": None, "n": 2}])
    with pytest.raises(DatasetError, match=r"p\.parquet, row 1: no 'prompt' value"):
        PromptDataset(file, tokenizer)


def test_empty_and_missing_files(tmp_path: Path, tokenizer) -> None:
    empty_jsonl = tmp_path / "empty.jsonl"
    empty_jsonl.write_text("")
    empty_parquet = write_parquet(tmp_path / "empty.parquet", [])  # no rows, no columns
    with pytest.raises(DatasetError, match=r"no rows in the data files .*empty\.jsonl.*empty\.parquet"):
        PromptDataset([empty_jsonl, empty_parquet], tokenizer)
    with pytest.raises(DatasetError, match="does not exist"):
        PromptDataset(tmp_path / "missing.jsonl", tokenizer)
    with pytest.raises(DatasetError, match="no data files"):
        PromptDataset([], tokenizer)
    csv = tmp_path / "data.csv"
    csv.write_text("prompt\nhi\n")
    with pytest.raises(DatasetError, match="unsupported file type '.csv'"):
        PromptDataset(csv, tokenizer)


@pytest.mark.parametrize("reader", ["plan", "train"])
def test_files_it_cannot_read_say_what_to_do(tmp_path: Path, tokenizer, reader) -> None:
    """What users name as data besides parquet and JSON lines (a save_to_disk folder, its .arrow file, a folder of
    files, a glob, a gzip'd JSONL): each refused saying what to do, by the plan's preview and train's reader alike."""
    import gzip

    from hybridrl.data.dataset import preview_file

    saved = tmp_path / "saved"  # what datasets' save_to_disk writes
    saved.mkdir()
    table = pa.Table.from_pylist(rows_with_lengths([3, 4]))
    with pa.ipc.new_stream(saved / "data-00000-of-00001.arrow", table.schema) as stream:
        stream.write_table(table)
    (saved / "dataset_info.json").write_text("{}")
    (saved / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    parts = tmp_path / "parts"
    parts.mkdir()
    write_jsonl(parts / "part0.jsonl", rows_with_lengths([3]))
    packed = tmp_path / "train.jsonl.gz"
    packed.write_bytes(gzip.compress(b'{"prompt": "hi"}\n'))
    expected = {
        saved: r"is a folder: a Hugging Face dataset saved with save_to_disk; write it as parquet first: "
               r"datasets\.load_from_disk\('.*saved'\)\.to_parquet\('train\.parquet'\)",
        saved / "data-00000-of-00001.arrow": r"unsupported file type '\.arrow'.*datasets\.Dataset\.from_file\(",
        parts: r"is a folder, not a file; list its parquet or JSON-lines files",
        parts / "*.jsonl": r"does not exist: patterns are not expanded; list the files",
        packed: r"unsupported file type '\.gz'.*it is compressed: decompress it first",
    }
    for path, message in expected.items():
        with pytest.raises(DatasetError, match=message):
            preview_file(path, "prompt") if reader == "plan" else PromptDataset(path, tokenizer)


def test_from_config(tmp_path: Path, tokenizer) -> None:
    from hybridrl.config.schema import DataConfig

    file = write_jsonl(tmp_path / "c.jsonl", rows_with_lengths([3, 30]))
    config = DataConfig(train_files=[str(file)], max_prompt_length=10)
    dataset = PromptDataset.from_config(config, config.train_files, tokenizer)
    assert len(dataset) == 1 and dataset.stats.filtered_overlong == 1


@pytest.mark.parametrize("writer", [write_jsonl, write_parquet], ids=["jsonl", "parquet"])
def test_verls_agent_name_must_be_the_loop_the_job_runs(tmp_path: Path, writer) -> None:
    """verl's rows name their agent loop (agent_name); hybridrl's is the job's (rollout.multi_turn.enable): a row
    naming another loop is refused, naming the row and the value, never run in a loop it did not ask for."""
    tok = char_tokenizer(chat_template=CHAT_WITH_TOOLS)
    tools = [{"type": "function", "function": {"name": "calculator", "description": "d", "parameters": {}}}]
    rows = [{"prompt": "a", "agent_name": "tool_agent"}, {"prompt": "b", "agent_name": None},
            {"prompt": "c", "agent_name": "single_turn_agent"}]
    suffix = ".jsonl" if writer is write_jsonl else ".parquet"
    file = writer(tmp_path / f"mixed{suffix}", rows)
    with pytest.raises(DatasetError, match=r"row 2 has agent_name='single_turn_agent' \(verl's agent loop for the "
                                           r"row\), but with actor_rollout_ref.rollout.multi_turn.enable=true"):
        PromptDataset(file, tok, apply_chat_template=True, tools=tools)
    with pytest.raises(DatasetError, match=r"row 0 has agent_name='tool_agent' \(verl's tool-calling loop for the "
                                           r"row\), but actor_rollout_ref.rollout.multi_turn.enable=false"):
        PromptDataset(file, tok, apply_chat_template=True)
    tool_rows = writer(tmp_path / f"tool{suffix}", rows[:2])
    assert [i.raw_prompt for i in PromptDataset(tool_rows, tok, apply_chat_template=True, tools=tools)] == ["a", "b"]
    plain_rows = writer(tmp_path / f"plain{suffix}", rows[1:])
    assert [i.raw_prompt for i in PromptDataset(plain_rows, tok, apply_chat_template=True)] == ["b", "c"]
    custom = writer(tmp_path / f"custom{suffix}", [{"prompt": "d", "agent_name": "react_agent"}])
    with pytest.raises(DatasetError, match="has agent_name='react_agent', an agent loop hybridrl does not have"):
        PromptDataset(custom, tok, apply_chat_template=True)
