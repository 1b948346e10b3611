"""`PromptDataset`: prompts from local parquet / JSONL files, tokenized once, with their reward spec.

Reading goes through pyarrow (`pyarrow.parquet`, `pyarrow.json`). A row is a dict; the columns used:

* ``prompt_key`` (default ``prompt``): a text prompt, or a list of chat messages
  ``[{"role": ..., "content": ...}]`` (verl's format). ``apply_chat_template``: None (the default) formats
  chat messages with the tokenizer's chat template, as verl does, and keeps text prompts as they are;
  True also sends a text prompt as one user message; False refuses chat messages.
* ``reward_key`` (default ``reward_model``): the reward spec, e.g. ``{"ground_truth": "42", "style": "rule"}``
  or a bare ground truth. ``ground_truth`` is taken from it (the dict's ``ground_truth`` entry, else
  the value itself).
* ``data_source`` (optional): which scorer family the row belongs to; ``extra_info`` (optional): any
  per-row dict, carried through untouched.

Every row keeps ``index``: its position in the concatenation of the files (before any filtering), so
metrics and logs point back to the source row.

Over-long prompts (more than ``max_prompt_length`` tokens after the template): dropped and counted when
``filter_overlong_prompts`` (the log says "filtered 3 of 100 prompts longer than 512 tokens"),
otherwise cut by ``truncation``: ``left`` keeps the last tokens (the end of a prompt is where the
question and the generation cue are), ``right`` keeps the first, ``middle`` (verl's) the first and last
halves, ``error`` raises.

Malformed rows (prompt missing, null, empty, of the wrong type, messages without role/content; with
``require_ground_truth``, what a rule scorer reads, a row without a ground truth):
``on_malformed="error"`` (default) raises naming the file and the row; ``"skip"`` drops them and
counts them in `stats` with one warning.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

TRUNCATION_MODES = ("error", "left", "right", "middle")
MALFORMED_MODES = ("error", "skip")
PARQUET_SUFFIXES = (".parquet", ".pq")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
# verl's multimodal columns (its data.image_key and data.video_key defaults): hybridrl trains text-only models, so a
# row's images would never reach the model while its prompt trained as if they had
MULTIMODAL_COLUMNS = ("images", "videos")


class DatasetError(ValueError):
    """A data file or row that cannot be used; the message names the file (and row)."""


@dataclass(frozen=True)
class PromptItem:
    """One usable prompt: its token ids plus everything the reward needs later."""

    input_ids: tuple[int, ...]
    prompt_text: str  # the text that was tokenized (after the chat template)
    raw_prompt: str | list[dict[str, str]]  # the row's prompt as stored
    reward_spec: Any  # the row's ``reward_key`` value, untouched
    ground_truth: Any
    data_source: str
    index: int  # position in the concatenated files, before filtering
    extra_info: Any = None
    source_file: str = ""
    truncated: bool = False


@dataclass
class DatasetStats:
    """What happened to the rows of the files while building the dataset."""

    total_rows: int = 0
    kept: int = 0
    filtered_overlong: int = 0
    truncated: int = 0
    skipped_malformed: int = 0
    max_prompt_length: int = 0
    malformed_examples: list[str] = field(default_factory=list)  # first few reasons, for the warning

    def summary(self) -> str:
        parts = [f"kept {self.kept} of {self.total_rows} prompts"]
        if self.filtered_overlong:
            parts.append(
                f"filtered {self.filtered_overlong} of {self.total_rows} prompts longer than "
                f"{self.max_prompt_length} tokens"
            )
        if self.truncated:
            parts.append(f"truncated {self.truncated} prompts to {self.max_prompt_length} tokens")
        if self.skipped_malformed:
            parts.append(f"skipped {self.skipped_malformed} malformed rows")
        return "; ".join(parts)


# Stands in for a JSON line that pyarrow could not parse.
_UNPARSEABLE = "__hybridrl_unparseable_row__"


def _strings_for_timestamps(arrow_type: Any) -> Any:
    """`arrow_type` with every timestamp (also nested) replaced by string."""
    import pyarrow as pa

    if pa.types.is_timestamp(arrow_type) or pa.types.is_date(arrow_type) or pa.types.is_time(arrow_type):
        return pa.string()
    if pa.types.is_struct(arrow_type):
        return pa.struct([field.with_type(_strings_for_timestamps(field.type)) for field in arrow_type])
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
        return pa.list_(_strings_for_timestamps(arrow_type.value_type))
    return arrow_type


def _read_json_table(source: Any) -> list[dict[str, Any]]:
    """pyarrow's JSON reader, but text that looks like a date stays text.

    pyarrow infers ISO-8601 strings ("2024-01-01") as timestamps, which would turn a prompt or a
    ground truth into a datetime. When the inferred schema has any, the data is parsed again with
    those fields declared as strings.
    """
    import io

    import pyarrow as pa
    import pyarrow.json as pj

    data = source if isinstance(source, bytes) else Path(source).read_bytes()
    table = pj.read_json(io.BytesIO(data))
    schema = pa.schema([field.with_type(_strings_for_timestamps(field.type)) for field in table.schema])
    if schema != table.schema:
        table = pj.read_json(io.BytesIO(data), parse_options=pj.ParseOptions(explicit_schema=schema))
    return table.to_pylist()


def _read_jsonl_lines(path: Path) -> list[dict[str, Any]]:
    """Each non-blank line parsed on its own by pyarrow: a bad line cannot spoil its neighbours.

    A line pyarrow cannot type is still JSON when its arrays mix kinds (verl's extra_info often holds
    ``[1, {"k": 2}]`` or ``[1, "a"]``: one arrow list has one value type): the standard library parses it.
    """
    import json

    rows: list[dict[str, Any]] = []
    for line in path.read_bytes().splitlines():
        if not line.strip():
            continue
        try:
            parsed = _read_json_table(line)
        except Exception as error:
            try:
                parsed = [json.loads(line)]
            except ValueError:
                # pyarrow parsed the line as a table of its own: its " in row 0" is that table's row, not the file's
                rows.append({_UNPARSEABLE: re.sub(r"\s+in row \d+$", "", str(error).strip())})
                continue
            if not isinstance(parsed[0], dict):
                parsed = []
        rows.extend(parsed if parsed else [{_UNPARSEABLE: "not a JSON object"}])
    return rows


def _unusable_path(path: Path) -> DatasetError:
    """Why `path` is not a data file hybridrl reads (missing, a folder, a pattern, a format it does not read), naming
    what to do instead."""
    if not path.exists():
        if any(character in str(path) for character in "*?["):
            return DatasetError(f"data file {str(path)!r} does not exist: patterns are not expanded; list the files")
        return DatasetError(f"data file {str(path)!r} does not exist")
    if path.is_dir():
        if (path / "dataset_info.json").is_file() or (path / "state.json").is_file():
            return DatasetError(f"{str(path)!r} is a folder: a Hugging Face dataset saved with save_to_disk; write it "
                                f"as parquet first: datasets.load_from_disk({str(path)!r}).to_parquet('train.parquet')")
        return DatasetError(f"{str(path)!r} is a folder, not a file; list its parquet or JSON-lines files")
    if not path.is_file():
        return DatasetError(f"{str(path)!r} is not a file")
    if path.suffix.lower() in (".gz", ".bz2", ".xz", ".zst", ".zip"):
        hint = "; it is compressed: decompress it first and name the file inside"
    elif path.suffix.lower() == ".arrow":
        hint = (f"; an Arrow file (what datasets' save_to_disk writes): write it as parquet first: "
                f"datasets.Dataset.from_file({str(path)!r}).to_parquet('train.parquet')")
    else:
        hint = ""
    return DatasetError(
        f"{path}: unsupported file type {path.suffix.lower()!r}; use parquet ({', '.join(PARQUET_SUFFIXES)}) "
        f"or JSON lines ({', '.join(JSONL_SUFFIXES)}){hint}"
    )


def read_rows(path: str | Path, columns: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """All rows of one parquet or JSONL file as dicts (pyarrow does the parsing); `columns`: of a parquet file, only
    those of them it has (a JSONL line is parsed whole anyway).

    pyarrow reads a JSONL file as one table with one type per column, so a file that mixes text and
    chat-message prompts, or has one bad line, fails as a whole. Such a file is re-read line by line
    (each line parsed by pyarrow on its own, or by the standard library where its arrays mix kinds); lines that
    still fail come back as rows that `PromptDataset` reports as malformed, with their row number.
    """
    path = Path(path)
    if not path.is_file():
        raise _unusable_path(path)
    suffix = path.suffix.lower()
    if suffix in PARQUET_SUFFIXES:
        import pyarrow.parquet as pq

        try:
            if columns is not None:
                names = pq.ParquetFile(path).schema_arrow.names
                columns = [name for name in columns if name in names]
            return pq.read_table(path, columns=columns).to_pylist()
        except Exception as error:
            raise DatasetError(f"{path}: cannot read as parquet: {error}") from error
    if suffix in JSONL_SUFFIXES:
        head = path.read_bytes()[:4096].lstrip()
        if not head:
            return []
        if head.startswith(b"["):
            raise DatasetError(
                f"{path}: the file is one JSON array; hybridrl reads JSON lines (one object per line)"
            )
        try:
            return _read_json_table(path)
        except Exception:
            return _read_jsonl_lines(path)
    raise _unusable_path(path)


@dataclass(frozen=True)
class FilePreview:
    """What a data file holds, read cheaply (parquet's footer; a JSONL file's line count and first lines):
    what the plan checks before any process starts."""

    path: str
    rows: int
    columns: tuple[str, ...]
    prompt_kind: str | None  # "text", "messages", or None (the prompt column is absent or unrecognised)
    # the data_source values seen: every row's for parquet (that one column read), the previewed lines' for JSONL
    data_sources: frozenset[str] = frozenset()
    # MULTIMODAL_COLUMNS present: parquet's schema, the previewed JSONL lines' non-empty values
    multimodal_columns: tuple[str, ...] = ()
    # verl's agent_name values (its agent loop per row): every row's for parquet, the previewed lines' for JSONL
    agent_names: frozenset[str] = frozenset()
    # `check_file`: whether every row was read and checked as `PromptDataset` checks it (`row_problem`); then
    # `data_sources` is every row's (a row without one: "unknown", as train reads it), each with its first row here
    whole: bool = False
    malformed: tuple[tuple[int, str], ...] = ()  # (row in the file, why), the first MALFORMED_SHOWN
    malformed_rows: int = 0
    data_source_rows: Mapping[str, int] = field(default_factory=dict)


_PREVIEW_LINES = 64  # JSONL lines parsed for the columns and the prompt's kind
# Files of at most this many rows are read whole by the plan (`check_file`): GSM8K's 7,473 rows cost 0.05 s (parquet)
# and 0.1 s (JSONL) of CPU on a 2-core machine, 50,000 about 0.5 s and 0.9 s (bench/plan_data_read.py)
WHOLE_READ_ROWS = 50_000
MALFORMED_SHOWN = 3


def preview_file(path: str | Path, prompt_key: str) -> FilePreview:
    """Rows, columns and the kind of prompt of one data file, without reading it whole.

    Raises `DatasetError` for what `read_rows` would refuse (missing, unreadable, unsupported suffix,
    a JSON array). Parquet: the footer's row count and schema. JSONL: its non-blank lines counted, the
    first ones parsed (stdlib json: a preview, not the reader; pyarrow reads the file for training).
    """
    path = Path(path)
    if not path.is_file():
        raise _unusable_path(path)
    suffix = path.suffix.lower()
    if suffix in PARQUET_SUFFIXES:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            parquet = pq.ParquetFile(path)
        except Exception as error:
            raise DatasetError(f"{path}: cannot read as parquet: {error}") from error
        schema = parquet.schema_arrow
        kind = None
        if prompt_key in schema.names:
            prompt_type = schema.field(prompt_key).type
            if pa.types.is_string(prompt_type) or pa.types.is_large_string(prompt_type):
                kind = "text"
            elif pa.types.is_list(prompt_type) or pa.types.is_large_list(prompt_type):
                kind = "messages"
        sources: frozenset[str] = frozenset()
        if "data_source" in schema.names:
            column = parquet.read(columns=["data_source"]).column("data_source")
            sources = frozenset(str(v) for v in column.unique().to_pylist() if v is not None)
        agents: frozenset[str] = frozenset()
        if "agent_name" in schema.names:
            column = parquet.read(columns=["agent_name"]).column("agent_name")
            agents = frozenset(str(v) for v in column.unique().to_pylist() if v is not None)
        return FilePreview(str(path), parquet.metadata.num_rows, tuple(schema.names), kind, sources,
                           tuple(name for name in MULTIMODAL_COLUMNS if name in schema.names), agents)
    if suffix in JSONL_SUFFIXES:
        import json

        try:
            data = path.read_bytes()
        except OSError as error:
            raise DatasetError(f"{path}: cannot read: {error}") from error
        if data.lstrip().startswith(b"["):
            raise DatasetError(f"{path}: the file is one JSON array; hybridrl reads JSON lines (one object per line)")
        lines = [line for line in data.splitlines() if line.strip()]
        columns: dict[str, None] = {}
        seen: set[str] = set()
        multimodal: dict[str, None] = {}
        agent_names: set[str] = set()
        kind = None
        for line in lines[:_PREVIEW_LINES]:
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a bad line is the reader's to report (on_malformed), with its row number
            if not isinstance(row, dict):
                continue
            columns.update(dict.fromkeys(row))
            multimodal.update(dict.fromkeys(name for name in MULTIMODAL_COLUMNS if multimodal_problem(row, name)))
            if row.get("data_source") is not None:
                seen.add(str(row["data_source"]))
            if row.get("agent_name") is not None:
                agent_names.add(str(row["agent_name"]))
            if kind is None and row.get(prompt_key) is not None:
                prompt = row[prompt_key]
                kind = "text" if isinstance(prompt, str) else "messages" if isinstance(prompt, list) else None
        return FilePreview(str(path), len(lines), tuple(columns), kind, frozenset(seen), tuple(multimodal),
                           frozenset(agent_names))
    raise _unusable_path(path)


def row_problem(row: Mapping[str, Any], prompt_key: str, reward_key: str, require_ground_truth: bool) -> str | None:
    """Why `PromptDataset` cannot use a row (its prompt malformed; with `require_ground_truth`, what a rule scorer
    reads, no ground truth), or None: the one verdict `train`'s read and the plan's (`check_file`) give."""
    reason = _malformed_reason(row, prompt_key)
    if reason is None and require_ground_truth:
        reason = _missing_ground_truth(row, reward_key)
    return reason


def malformed_row(where: str, reason: str, others: int = 0) -> str:
    """A malformed row (`where`: "<file>, row N", or "row N" where the file is named already) as `train` and the plan
    refuse it under data.on_malformed=error, with the number of `others` like it."""
    more = f"{others} more malformed row{'s' if others > 1 else ''} in the file; " if others else ""
    return f"{where}: {reason} ({more}set data.on_malformed=skip to drop such rows)"


def check_file(path: str | Path, prompt_key: str, reward_key: str = "reward_model",
               require_ground_truth: bool = False, whole_rows: int = WHOLE_READ_ROWS) -> FilePreview:
    """`preview_file`, and for a file of at most `whole_rows` rows every row read and checked as `PromptDataset`
    checks it (`row_problem`, `multimodal_problem`; a parquet file's other columns are not read): the problems
    only reading every row shows, found before any process starts. A larger file's preview alone (`whole` False)."""
    preview = preview_file(path, prompt_key)
    if preview.rows > whole_rows:
        return preview
    wanted = [prompt_key, reward_key, "data_source", "agent_name", *MULTIMODAL_COLUMNS]
    rows = read_rows(path, columns=wanted)
    malformed: list[tuple[int, str]] = []
    count = 0
    sources: dict[str, int] = {}
    multimodal: dict[str, None] = {}
    agents: set[str] = set()
    for number, row in enumerate(rows):
        reason = row_problem(row, prompt_key, reward_key, require_ground_truth)
        if reason is not None:  # refused, or skipped unscored (data.on_malformed)
            count += 1
            if len(malformed) < MALFORMED_SHOWN:
                malformed.append((number, reason))
        else:
            source = row.get("data_source")
            sources.setdefault("unknown" if source is None else str(source), number)
        multimodal.update(dict.fromkeys(name for name in MULTIMODAL_COLUMNS if multimodal_problem(row, name)))
        if row.get("agent_name") is not None:
            agents.add(str(row["agent_name"]))
    columns = (dict.fromkeys(preview.columns) if Path(path).suffix.lower() in PARQUET_SUFFIXES
               else dict.fromkeys(key for row in rows for key in row if key != _UNPARSEABLE))
    return dataclasses.replace(preview, rows=len(rows), columns=tuple(columns), data_sources=frozenset(sources),
                               multimodal_columns=tuple(multimodal), agent_names=frozenset(agents), whole=True,
                               malformed=tuple(malformed), malformed_rows=count, data_source_rows=sources)


def _check_messages(prompt: Sequence[Any]) -> str | None:
    """Why a chat-message list is malformed, or None when it is fine."""
    if not prompt:
        return "the message list is empty"
    for i, message in enumerate(prompt):
        if not isinstance(message, Mapping):
            return f"message {i} is a {type(message).__name__}, not a dict with role and content"
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            return f"message {i} has no string 'role'"
        if isinstance(content, (list, tuple)):
            return (f"message {i}'s content is a list of parts (multimodal: text, image, ...); hybridrl trains "
                    "text-only models: give each message its text as a string")
        if not isinstance(content, str):
            return f"message {i} has no string 'content'"
    return None


def _malformed_reason(row: Mapping[str, Any], prompt_key: str) -> str | None:
    if _UNPARSEABLE in row:
        return f"unreadable JSON line: {row[_UNPARSEABLE]}"
    if prompt_key not in row or row[prompt_key] is None:
        present = sorted(k for k, v in row.items() if v is not None)
        return f"no {prompt_key!r} value (columns with values: {present})"
    prompt = row[prompt_key]
    if isinstance(prompt, str):
        return "the prompt is an empty string" if not prompt.strip() else None
    if isinstance(prompt, (list, tuple)):
        return _check_messages(prompt)
    return f"the prompt is a {type(prompt).__name__}; expected a string or a list of chat messages"


def _missing_ground_truth(row: Mapping[str, Any], reward_key: str) -> str | None:
    """Why a row has no ground truth for a rule scorer to compare with (its reward column absent or null, or a
    ``ground_truth`` entry that is null), or None when it has one."""
    what = f"data.reward_key={reward_key}"
    if _is_missing(row.get(reward_key)):
        return f"no ground truth: its {what} value is null, NaN or absent, and the rule scorer compares every " \
               "response with one"
    spec = row[reward_key]
    if isinstance(spec, Mapping) and "style" in spec and "ground_truth" not in spec:
        # verl's reward spec ({"style": ..., "ground_truth": ...}) without its ground truth: not a ground truth
        # itself (the dict would be compared as one; verl's reward fails on the missing key)
        return (f"no ground truth: its {what} value {dict(spec)!r} is verl's reward spec without a 'ground_truth' "
                "entry, and the rule scorer compares every response with one")
    if _is_missing(_ground_truth(spec)):
        return (f"no ground truth: its {what} value's 'ground_truth' is null or NaN, and the rule scorer compares "
                "every response with one")
    return None


def _is_missing(value: Any) -> bool:
    """None, or a float NaN: pandas writes a missing number as NaN, which a scorer would compare as the text 'nan'."""
    return value is None or (isinstance(value, float) and math.isnan(value))


# verl's per-row `agent_name` column picks the row's agent loop; hybridrl's loop is the job's
# (actor_rollout_ref.rollout.multi_turn.enable): the name each setting runs
AGENT_LOOPS = {True: "tool_agent", False: "single_turn_agent"}


def agent_name_problem(value: Any, multi_turn: bool) -> str | None:
    """Why a row's `agent_name` (verl's choice of agent loop for the row) is not the loop this job runs, or None
    (no name, or the job's)."""
    if _is_missing(value) or value == AGENT_LOOPS[multi_turn]:
        return None
    flag = "actor_rollout_ref.rollout.multi_turn.enable"
    if multi_turn:
        return (f"has agent_name={value!r} (verl's agent loop for the row), but with {flag}=true hybridrl runs every "
                "row through its tool-calling loop (verl's 'tool_agent'), its tools offered; give these rows a job "
                "of their own without multi_turn, or set their agent_name to 'tool_agent' (or drop the column)")
    if value == AGENT_LOOPS[True]:
        return (f"has agent_name='tool_agent' (verl's tool-calling loop for the row), but {flag}=false: every row "
                f"would be answered in one turn without tools; set {flag}=true with its tools, or drop the column")
    return (f"has agent_name={value!r}, an agent loop hybridrl does not have (it runs 'single_turn_agent' rows, or "
            f"'tool_agent' rows with {flag}=true); drop the column or set it to one of those")


def multimodal_problem(row: Mapping[str, Any], *names: str) -> str | None:
    """Why a row's multimodal inputs cannot be trained on (a non-empty value of `names`, by default every
    MULTIMODAL_COLUMNS), or None."""
    for name in names or MULTIMODAL_COLUMNS:
        value = row.get(name)
        if value is not None and not (hasattr(value, "__len__") and len(value) == 0):
            return (f"has {name!r} (verl's multimodal inputs): hybridrl trains text-only models, and the prompt would "
                    f"train without its {name}; drop the {name!r} column to train on the text alone")
    return None


def _ground_truth(reward_spec: Any) -> Any:
    if isinstance(reward_spec, Mapping) and "ground_truth" in reward_spec:
        return reward_spec["ground_truth"]
    return reward_spec


def truncated_ids(ids: Sequence[int], length: int, truncation: str) -> list[int]:
    """`length` of `ids`: left keeps the last, right the first, middle (verl's) the first length // 2 and the last
    length - length // 2 (a prompt's instructions and its question with the generation cue)."""
    if truncation == "left":
        return list(ids[-length:])
    if truncation == "right":
        return list(ids[:length])
    if truncation == "middle":
        head = length // 2
        return list(ids[:head]) + list(ids[len(ids) - (length - head):])
    raise ValueError(f"truncation must be one of {TRUNCATION_MODES[1:]} to cut, got {truncation!r}")


def _strip_nulls(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    # pyarrow unifies message structs across rows: keys a message lacks come back as None, and a
    # chat template would render them ("name": None). Drop them.
    return [{k: v for k, v in message.items() if v is not None} for message in messages]


class PromptDataset(Sequence[PromptItem]):
    """Tokenized prompts from local files. See the module docstring for the row format."""

    def __init__(
        self,
        files: str | Path | Sequence[str | Path],
        tokenizer: Any,
        *,
        prompt_key: str = "prompt",
        reward_key: str = "reward_model",
        max_prompt_length: int = 512,
        filter_overlong_prompts: bool = True,
        truncation: str = "error",
        apply_chat_template: bool | None = None,
        on_malformed: str = "error",
        tools: Sequence[Mapping[str, Any]] | None = None,
        require_ground_truth: bool = False,
    ) -> None:
        if isinstance(files, (str, Path)):
            files = [files]
        self.files = [str(f) for f in files]
        if not self.files:
            raise DatasetError("no data files given (data.train_files / data.val_files is empty)")
        if truncation not in TRUNCATION_MODES:
            raise ValueError(f"truncation must be one of {TRUNCATION_MODES}, got {truncation!r}")
        if on_malformed not in MALFORMED_MODES:
            raise ValueError(f"on_malformed must be one of {MALFORMED_MODES}, got {on_malformed!r}")
        if max_prompt_length <= 0:
            raise ValueError(f"max_prompt_length must be positive, got {max_prompt_length}")
        if apply_chat_template and not getattr(tokenizer, "chat_template", None):
            raise DatasetError(
                "data.apply_chat_template is true but the tokenizer has no chat template; "
                "set one on the tokenizer or use text prompts with apply_chat_template=false"
            )
        self.tokenizer = tokenizer
        self.prompt_key = prompt_key
        self.reward_key = reward_key
        self.max_prompt_length = max_prompt_length
        self.filter_overlong_prompts = filter_overlong_prompts
        self.truncation = truncation
        self.apply_chat_template = apply_chat_template
        self.on_malformed = on_malformed
        self.tools = list(tools) if tools else None  # tool schemas for the chat template (multi-turn)
        # a rule scorer reads every row's ground truth: a row without one is malformed (it could not be scored)
        self.require_ground_truth = require_ground_truth
        self.stats = DatasetStats(max_prompt_length=max_prompt_length)
        self.items: list[PromptItem] = self._build()

    # ------------------------------------------------------------------------------ building
    def _prompt_text(self, prompt: str | Sequence[Mapping[str, Any]], where: str) -> tuple[str, bool]:
        """The text to tokenize and whether the tokenizer should add its own special tokens."""
        if self.apply_chat_template or (self.apply_chat_template is None and not isinstance(prompt, str)):
            if not getattr(self.tokenizer, "chat_template", None):
                raise DatasetError(
                    f"{where}: the prompt is a list of chat messages but the tokenizer has no chat template; "
                    "give the tokenizer one (tokenizer_config.json's chat_template) or store text prompts")
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else _strip_nulls(prompt)
            # tokenize=False, then encode: transformers 5 returns a BatchEncoding from tokenize=True,
            # 4.x a list; the text is also what we keep for logs.
            options = {"tools": self.tools} if self.tools else {}
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **options)
            return text, False  # the template already placed any BOS it wants
        if not isinstance(prompt, str):
            raise DatasetError(
                f"{where}: the prompt is a list of chat messages but data.apply_chat_template is false; "
                "unset it or set it true (the tokenizer's chat template formats the messages), or store text prompts"
            )
        return prompt, True

    def _build(self) -> list[PromptItem]:
        pending: list[tuple[dict[str, Any], str, int, int]] = []  # row, file, row in file, global index
        global_index = 0
        for file in self.files:
            rows = read_rows(file)
            for row_in_file, row in enumerate(rows):
                pending.append((row, file, row_in_file, global_index))
                global_index += 1
        self.stats.total_rows = global_index
        if global_index == 0:
            raise DatasetError(f"no rows in the data files {self.files}")
        for row, file, row_in_file, _ in pending:  # the whole file's problem, not a row to skip under on_malformed
            problem = multimodal_problem(row) or agent_name_problem(row.get("agent_name"), self.tools is not None)
            if problem is not None:
                raise DatasetError(f"{file}, row {row_in_file} {problem}")

        usable: list[tuple[dict[str, Any], str, int, int]] = []
        for row, file, row_in_file, index in pending:
            reason = row_problem(row, self.prompt_key, self.reward_key, self.require_ground_truth)
            if reason is None:
                usable.append((row, file, row_in_file, index))
                continue
            where = f"{file}, row {row_in_file}"
            if self.on_malformed == "error":
                raise DatasetError(malformed_row(where, reason))
            self.stats.skipped_malformed += 1
            if len(self.stats.malformed_examples) < 3:
                self.stats.malformed_examples.append(f"{where}: {reason}")
        if self.stats.skipped_malformed:
            logger.warning(
                "skipped %d malformed rows of %d in %s, e.g. %s",
                self.stats.skipped_malformed, self.stats.total_rows, self.files,
                "; ".join(self.stats.malformed_examples),
            )

        texts: list[str] = []
        add_special: list[bool] = []
        for row, file, row_in_file, _ in usable:
            text, special = self._prompt_text(row[self.prompt_key], f"{file}, row {row_in_file}")
            texts.append(text)
            add_special.append(special)
        token_ids = self._tokenize(texts, add_special)

        items: list[PromptItem] = []
        for (row, file, row_in_file, index), text, ids in zip(usable, texts, token_ids):
            truncated = False
            if len(ids) > self.max_prompt_length:
                if self.filter_overlong_prompts:
                    self.stats.filtered_overlong += 1
                    continue
                if self.truncation == "error":
                    raise DatasetError(
                        f"{file}, row {row_in_file}: the prompt has {len(ids)} tokens, more than "
                        f"data.max_prompt_length={self.max_prompt_length}; set data.filter_overlong_prompts=true "
                        "or data.truncation=left|right|middle"
                    )
                ids = truncated_ids(ids, self.max_prompt_length, self.truncation)
                truncated = True
                self.stats.truncated += 1
            if not ids:
                raise DatasetError(f"{file}, row {row_in_file}: the prompt tokenizes to no tokens")
            reward_spec = row.get(self.reward_key)
            data_source = row.get("data_source")
            items.append(
                PromptItem(
                    input_ids=tuple(ids),
                    prompt_text=text,
                    raw_prompt=row[self.prompt_key],
                    reward_spec=reward_spec,
                    ground_truth=_ground_truth(reward_spec),
                    data_source=str(data_source) if data_source is not None else "unknown",
                    index=index,
                    extra_info=row.get("extra_info"),
                    source_file=file,
                    truncated=truncated,
                )
            )
        self.stats.kept = len(items)
        if self.stats.filtered_overlong:
            logger.info(
                "filtered %d of %d prompts longer than %d tokens",
                self.stats.filtered_overlong, self.stats.total_rows, self.max_prompt_length,
            )
        if self.stats.truncated:
            logger.info("truncated (%s) %d prompts to %d tokens", self.truncation, self.stats.truncated,
                        self.max_prompt_length)
        if not items:
            raise DatasetError(f"no usable prompts in {self.files}: {self.stats.summary()}")
        return items

    def _tokenize(self, texts: list[str], add_special: list[bool]) -> list[list[int]]:
        """Token ids per text; one batched tokenizer call per add_special_tokens value."""
        result: list[list[int]] = [[] for _ in texts]
        for flag in (True, False):
            positions = [i for i, special in enumerate(add_special) if special is flag]
            if not positions:
                continue
            encoded = self.tokenizer([texts[i] for i in positions], add_special_tokens=flag)["input_ids"]
            for i, ids in zip(positions, encoded):
                result[i] = list(ids)
        return result

    # ------------------------------------------------------------------------------ sequence
    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, position: int) -> PromptItem:  # type: ignore[override]
        return self.items[position]

    def __repr__(self) -> str:
        return f"PromptDataset({len(self)} prompts from {self.files}; {self.stats.summary()})"

    @classmethod
    def from_config(cls, data_config: Any, files: Sequence[str], tokenizer: Any, **overrides: Any) -> PromptDataset:
        """Build from a `DataConfig` (train or val files passed explicitly)."""
        options: dict[str, Any] = dict(
            prompt_key=data_config.prompt_key,
            reward_key=data_config.reward_key,
            max_prompt_length=data_config.max_prompt_length,
            filter_overlong_prompts=data_config.filter_overlong_prompts,
            truncation=data_config.truncation,
            apply_chat_template=data_config.apply_chat_template,
            on_malformed=getattr(data_config, "on_malformed", "error"),
        )
        options.update(overrides)
        return cls(files, tokenizer, **options)
