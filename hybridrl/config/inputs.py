"""What `train` reads from disk, checked by the plan before any process starts.

`hybridrl plan` and `hybridrl train` both run these checks (`plan --layout-only` skips them, to size a
layout from a model's config.json alone), so a user's mistake is one message naming the field, not
a traceback minutes later:

* model folders (`actor_rollout_ref.model`, a critic's, reward model's or distillation teacher's own): the
  folder exists and holds a config.json and whole safetensors weights holding the tensors its config.json implies
  (their headers read, never the weights); the policy's holds a tokenizer that loads, whose ids fit the vocabulary
  of every model reading them (with a chat template when prompts need one); a teacher holds the policy's
  tokenizer. A hub id (``Qwen/Qwen2.5-7B-Instruct``) is looked up in the local Hugging Face cache, offline, as
  transformers does (`resolve_hub_ids`); hybridrl never downloads.
* data files: each exists and is readable parquet/JSONL with the prompt column (and the reward column
  the scorer reads), at least one batch of usable rows, and chat-message prompts only where a chat template
  formats them; every row of a file of at most `WHOLE_READ_ROWS` rows is read and checked as `train` checks it
  (`hybridrl.data.dataset.check_file`: a malformed row, a missing ground truth, a data_source without a scorer,
  named by its row), a larger file's footer or first lines only (the plan says so).
* reward code: the registry knows `algorithm.reward_fn`, or the custom reward file imports (it is
  trusted code, run as the trainer will run it) and defines the function with a usable signature.

Torch-free: pyarrow, the reward registry, the safetensors and tokenizers libraries and, for a hub id only,
huggingface_hub (a tokenizer folder without a tokenizer.json alone is loaded through transformers).
"""
from __future__ import annotations

import difflib
import importlib
import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from hybridrl.config.errors import ConfigIssue
from hybridrl.config.refusals import LORA
from hybridrl.config.resume import ResumePoint, check_resume
from hybridrl.config.schema import LOGGER_PACKAGES, DataConfig, JobConfig, ModelConfig
from hybridrl.data.dataset import (
    _PREVIEW_LINES,
    PARQUET_SUFFIXES,
    WHOLE_READ_ROWS,
    DatasetError,
    FilePreview,
    PromptItem,
    agent_name_problem,
    check_file,
    malformed_row,
)
from hybridrl.data.tokenizer import tokenizer_size
from hybridrl.models.arch import ModelShape, read_hf_config, value_model_hf_config
from hybridrl.models.layout import PICKLED_WEIGHTS_HINT, hf_tensor_problems
from hybridrl.models.lora_targets import (
    TARGETS,
    fused_a_groups,
    peft_config_mismatches,
    peft_tensor_shapes,
    peft_unbuilt_settings,
)
from hybridrl.persistence import METADATA_FILE
from hybridrl.rewards.custom import RewardFunctionError, call_form, call_problem, load_reward_function
from hybridrl.rewards.registry import (
    AUTO,
    UnknownScorerError,
    get_scorer,
    known_scorer_names,
    scorer_aliases,
    scorer_for_data_source,
)
from hybridrl.tool_calling.sandbox import ENABLE_NAMESPACES, sandbox_problem

# A Hugging Face hub id: "name" or "org/name" of letters, digits, - _ . (no path separators beyond one "/").
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
LAYOUT_ONLY_HINT = ("to size a layout from a model's config.json alone (no weights, data or reward code yet), "
                    "run `hybridrl plan --layout-only`")
GUIDE = "docs/user-guide.md"


def _model_sections(config: JobConfig, *, critic: bool) -> list[tuple[str, ModelConfig]]:
    """The model folders this job loads, by field prefix (the critic's and reward model's only when used)."""
    sections = [("actor_rollout_ref.model", config.actor_rollout_ref.model)]
    if critic and config.critic.model.path:
        sections.append(("critic.model", config.critic.model))
    if config.reward_model.enable:
        sections.append(("reward_model.model", config.reward_model.model))
    if config.algorithm.distillation.enable:
        sections.append(("teacher.model", config.teacher.model))
    return sections


def looks_like_hub_id(path: str) -> bool:
    """`org/name` (or a bare name) that is not a folder here: what users copy from a model card."""
    return bool(path) and not Path(path).exists() and bool(_HUB_ID.match(path)) and not path.startswith(".")


def resolve_hub_ids(config: JobConfig, warnings: list[str]) -> None:
    """Replace each model path that is a hub id found in the local Hugging Face cache by its snapshot folder
    (in place: the plan owns its config). Offline, as `from_pretrained(local_files_only=True)`; an id not
    in the cache is left for `check_inputs` to refuse with how to download it."""
    for prefix, model in _model_sections(config, critic=True):
        for attr in ("path", "tokenizer_path"):
            value = getattr(model, attr)
            if value and looks_like_hub_id(value):
                folder = cached_snapshot(value)
                if folder is not None:
                    setattr(model, attr, folder)
                    warnings.append(f"{prefix}.{attr}={value}: a hub id, found in the local Hugging Face cache at "
                                    f"{folder}")


def cached_snapshot(repo_id: str) -> str | None:
    """The local snapshot folder of `repo_id` in the Hugging Face cache (HF_HOME / HF_HUB_CACHE), or None."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    except ImportError:  # pragma: no cover - a dependency of transformers, always installed with it
        return None
    try:
        return snapshot_download(repo_id, local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        return None


def check_inputs(config: JobConfig, issues: list[ConfigIssue], *, critic: bool,
                 warnings: list[str] | None = None, actor_shape: ModelShape | None = None
                 ) -> tuple[bool, ResumePoint | None, str | None]:
    """Append a problem for every model folder, data file, reward function and checkpoint to resume from that
    `train` could not use; return whether any of them is absent (a folder without weights, a missing data file):
    what `--layout-only` skips, the checkpoint the job resumes from (`config/resume.py`; None: a fresh start), and
    how `train` calls the custom reward function (`call_form`; None: none, or it cannot).

    `critic`: whether the job runs a critic (its own folder is checked when it names one; a checkpoint must hold
    its state); `actor_shape`: the actor's model, which a checkpoint's actor must have been saved from. `warnings`:
    what the plan says beside them (a data file too large to read whole, rows skipped).
    """
    warnings = [] if warnings is None else warnings
    chat_template = None
    absent = False
    present: list[tuple[str, ModelConfig]] = []  # the folders that hold what the workers load: what it holds next
    for prefix, model in _model_sections(config, critic=critic):
        policy = prefix == "actor_rollout_ref.model"
        before = len(issues)
        if _check_model_folder(prefix, model, issues, tokenizer=policy):
            present.append((prefix, model))
            if policy:
                chat_template = has_chat_template(Path(model.tokenizer_path or model.path))
        if prefix == "teacher.model" and len(issues) == before:
            _check_teacher_tokenizer(config, issues)
        absent |= len(issues) > before and (Path(model.path) / "config.json").is_file()
    for prefix, model in present:
        _check_weights(prefix, model.path, issues)
    if chat_template is not None:  # the policy's folder and tokenizer are there: what they hold (not absent)
        _check_tokenizer_fits(config, issues, critic=critic)
    for files in (config.data.train_files, config.data.val_files):
        absent |= not files or any(not Path(file).exists() for file in files)
    train_rows = _check_data(config, issues, chat_template, warnings)
    reward_call = _check_reward(config, issues)
    _check_loggers(config, issues)
    _check_sandbox(config, issues)
    absent |= _check_adapter_folder(config, issues)
    return absent, check_resume(config, issues, critic=critic, train_rows=train_rows, model=actor_shape), reward_call


def _check_adapter_folder(config: JobConfig, issues: list[ConfigIssue]) -> bool:
    """`model.lora.adapter_path`: a PEFT adapter folder whose rank and alpha are the config's (else the adapters
    would be rescaled silently); whether it is absent."""
    lora = config.actor_rollout_ref.model.lora
    if not lora.adapter_path or not (isinstance(lora.rank, int) and lora.rank > 0):
        return False
    field, folder = "actor_rollout_ref.model.lora.adapter_path", Path(lora.adapter_path)
    missing = [name for name in ("adapter_config.json", "adapter_model.safetensors") if not (folder / name).is_file()]
    if missing:
        issues.append(ConfigIssue(field, lora.adapter_path,
                                  f"is not a PEFT adapter folder: it lacks {', '.join(missing)}"))
        return True
    try:
        saved = json.loads((folder / "adapter_config.json").read_text())
    except ValueError as exc:
        issues.append(ConfigIssue(field, lora.adapter_path, f"holds an adapter_config.json that is not JSON ({exc})"))
        return False
    for name, key, theirs in peft_config_mismatches(saved, lora.rank, lora.alpha):
        issues.append(ConfigIssue(f"actor_rollout_ref.model.lora.{name}", getattr(lora, name),
                                  f"differs from the adapter's {key}={theirs!r} ({folder}); set it to the adapter's",
                                  (theirs,)))
    for key, theirs, why in peft_unbuilt_settings(saved):
        issues.append(ConfigIssue(field, lora.adapter_path, f"is a PEFT adapter with {key}={theirs!r}: {why}, so it "
                                                            "would load as another adapter; not built"))
    _check_adapter_tensors(config, folder, issues)
    return False


def _check_adapter_tensors(config: JobConfig, folder: Path, issues: list[ConfigIssue]) -> None:
    """The adapter folder holds the tensors, with the shapes, that the config's adapters on this model load (each rank
    takes its slices of them, `models.lora.load_lora_state`), and nothing else: a missing one would stop the workers,
    one more (another target, DoRA's magnitudes, a bias) would be dropped silently. A fused (type lora) adapter's
    projections must share their A (peft's own adapters never do: each projection its own A, type canonical_lora)."""
    lora, field = config.actor_rollout_ref.model.lora, "actor_rollout_ref.model.lora.adapter_path"
    try:
        shape = ModelShape.from_hf_config(read_hf_config(config.actor_rollout_ref.model.path))
    except (OSError, ValueError, KeyError, TypeError):
        return  # said where the model's shape is read
    if not isinstance(lora.rank, int) or lora.type not in TARGETS or not set(lora.targets) <= set(TARGETS[lora.type]):
        return  # the LoRA rules refuse these
    file = folder / "adapter_model.safetensors"
    read = _safetensors_header(file)
    if read is None:
        issues.append(ConfigIssue(field, lora.adapter_path, f"holds {file.name}, which is not a readable safetensors "
                                                            "file"))
        return
    header = read[1]
    found = {name: tuple(entry["shape"]) for name, entry in header.items()}
    expected = peft_tensor_shapes(shape, lora.type, lora.targets, lora.rank)
    targets = f"{LORA}.type={lora.type} with target_modules {list(lora.targets)} on {shape.architecture}"
    missing, extra = [n for n in expected if n not in found], [n for n in found if n not in expected]
    if missing or extra:
        held = sorted({n.split(".")[-3] for n in found if n.endswith((".lora_A.weight", ".lora_B.weight"))})
        said = []
        if missing:
            said.append(f"lacks {len(missing)} tensor(s) that {targets} load ({_few(missing)})")
        if extra:
            said.append(f"holds {len(extra)} tensor(s) they do not load, which would be dropped ({_few(extra)})")
        issues.append(ConfigIssue(field, lora.adapter_path, f"{'; and '.join(said)}: the folder's adapters are on "
                                                            f"{', '.join(held) or 'nothing'}; set {LORA}.type and "
                                                            "target_modules to the folder's (canonical_lora names "
                                                            "each projection: linear_q, linear_k, linear_v, "
                                                            "linear_proj, linear_fc1_gate, linear_fc1_up, linear_fc2)",
                                  _targets_holding(held)))
        return
    wrong = [f"{n} {list(found[n])} (expected {list(want)})" for n, want in expected.items() if found[n] != want]
    if wrong:
        issues.append(ConfigIssue(field, lora.adapter_path, f"holds tensors of other shapes than rank {lora.rank} "
                                                            f"adapters on this model: {_few(wrong)}"))
        return
    if lora.type == "lora":
        for group in fused_a_groups(expected):
            if len({_tensor_bytes(file, header, name) for name in group}) > 1:
                issues.append(ConfigIssue(f"{LORA}.type", lora.type, (
                    f"one adapter per megatron layer shares one A among its projections, but {folder} holds an A "
                    f"per projection ({', '.join(n.split('.')[-3] for n in group)} differ in layer "
                    f"{group[0].split('.layers.')[1].split('.')[0]}; peft's own adapters always do): set "
                    f"{LORA}.type=canonical_lora with its target names"), ("canonical_lora",)))
                return


def _few(names: Sequence[str]) -> str:
    return ", ".join(names[:3]) + (f", ... ({len(names) - 3} more)" if len(names) > 3 else "")


def _targets_holding(projections: Sequence[str]) -> tuple[str, ...]:
    """canonical_lora's target_modules adapting exactly these Hugging Face projections (what to set)."""
    return tuple(t for t, hf in TARGETS["canonical_lora"].items() if set(hf) <= set(projections))


def _safetensors_header(path: Path) -> tuple[int, dict[str, dict]] | None:
    """A safetensors file's header: where its data starts (8-byte length, then the JSON header) and each tensor's
    dtype, shape and data_offsets (from the file's start); None when the header is unreadable."""
    try:
        with path.open("rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            if length <= 0 or length > 100 * 2**20:
                return None
            header = json.loads(handle.read(length))
        header.pop("__metadata__", None)
        start = 8 + length
        return start, {name: {"shape": list(entry["shape"]), "dtype": entry["dtype"],
                              "data_offsets": (start + entry["data_offsets"][0], start + entry["data_offsets"][1])}
                       for name, entry in header.items()}
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return None


def _tensor_bytes(path: Path, header: dict[str, dict], name: str) -> bytes:
    start, end = header[name]["data_offsets"]
    with path.open("rb") as handle:
        handle.seek(start)
        return handle.read(end - start)


def _check_loggers(config: JobConfig, issues: list[ConfigIssue]) -> None:
    """Each optional logger's package imports here, as train imports it when it starts its metric sinks (after the
    workers' set-up: a missing one would end the run there)."""
    for name in dict.fromkeys(config.trainer.logger):
        package = LOGGER_PACKAGES.get(str(name))
        if package is None:
            continue
        try:
            importlib.import_module(package)
        except Exception as error:  # noqa: BLE001 - any failure to import is train's failure to start the logger
            issues.append(ConfigIssue("trainer.logger", list(config.trainer.logger), (
                f"has {name!r}, but its package does not import here ({type(error).__name__}: {error}): "
                f"`pip install {package}`, or remove {name} from trainer.logger")))


def _check_sandbox(config: JobConfig, issues: list[ConfigIssue]) -> None:
    """The python tool's operating-system sandbox starts on this machine (the rollout workers check again
    where they run): never a silent fallback to a weaker one."""
    multi_turn = config.actor_rollout_ref.rollout.multi_turn
    if not (multi_turn.enable and "python" in multi_turn.tools and multi_turn.sandbox.isolation == "namespaces"):
        return
    problem = sandbox_problem()
    if problem is not None:
        issues.append(ConfigIssue(
            "actor_rollout_ref.rollout.multi_turn.sandbox.isolation", "namespaces",
            f"the python tool's sandbox cannot start on this machine: {problem}. Options: {ENABLE_NAMESPACES}; "
            "or opt out explicitly with sandbox.isolation=none (a plain subprocess with limits, not a boundary "
            "against hostile code; warned on every run)", ["namespaces", "none"]))


def _missing_folder_rule(path: str) -> str:
    if looks_like_hub_id(path):
        return (f"does not exist here, and as a hub id it is not in the local Hugging Face cache; hybridrl never "
                f"downloads: fetch it first (`hf download {path} --local-dir models/{path.split('/')[-1]}`) "
                "and name that folder")
    return "does not exist; name a local Hugging Face model folder (config.json, tokenizer, *.safetensors)"


def _adapter_folder_rule(prefix: str, folder: Path) -> str:
    """A model path naming a PEFT adapter folder (adapter_config.json, no config.json): what it is and what to name
    instead (the policy can start from it as its LoRA adapter; another role needs it merged into its base)."""
    try:
        base = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        base = None
    what = f"holds a PEFT adapter (adapter_config.json{f', its base {base}' if base else ''}), not a whole model"
    if prefix == "actor_rollout_ref.model":
        return (f"{what}: name the base model's folder here and this folder in "
                "actor_rollout_ref.model.lora.adapter_path (with lora.rank set) to train on from it")
    return (f"{what}: merge it into its base first (peft's PeftModel.from_pretrained(base, folder)"
            ".merge_and_unload().save_pretrained(out), with the base's tokenizer files) and name that folder")


def _check_model_folder(prefix: str, model: ModelConfig, issues: list[ConfigIssue], *, tokenizer: bool) -> bool:
    """Whether `model`'s folder holds what the workers load (and its tokenizer, for the policy)."""
    field, path = f"{prefix}.path", model.path
    if not path:
        issues.append(ConfigIssue(field, path, "is empty; name a local Hugging Face model folder (config.json, "
                                               f"tokenizer, *.safetensors; see {GUIDE})"))
        return False
    folder = Path(path)
    if not folder.is_dir():
        rule = _missing_folder_rule(path) if not folder.exists() else "is not a folder"
        issues.append(ConfigIssue(field, path, rule))
        return False
    ok = True
    if not (folder / "config.json").is_file() and (folder / "adapter_config.json").is_file():
        issues.append(ConfigIssue(field, path, _adapter_folder_rule(prefix, folder)))
        return False
    if not (folder / "config.json").is_file():
        issues.append(ConfigIssue(field, path, "holds no config.json: not a Hugging Face model folder"))
        ok = False
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        others = sorted(p.name for p in folder.glob("*.bin"))[:3]
        found = f" (found {', '.join(others)}: {PICKLED_WEIGHTS_HINT})" if others else ""
        issues.append(ConfigIssue(field, path, f"holds no weights: expected {' or '.join(WEIGHT_FILES)}{found}"))
        ok = False
    if tokenizer:
        source, where = (model.tokenizer_path, f"{prefix}.tokenizer_path") if model.tokenizer_path else (path, field)
        source_path = Path(source)
        if not source_path.exists():
            issues.append(ConfigIssue(where, source, _missing_folder_rule(source)))
            ok = False
        elif source_path.is_dir() and not any((source_path / name).is_file() for name in TOKENIZER_FILES):
            issues.append(ConfigIssue(where, source, f"holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                                                     "copy the tokenizer files there or set "
                                                     f"{prefix}.tokenizer_path"))
            ok = False
    return ok


def _safetensors_size(path: Path) -> int | None:
    """The bytes a safetensors file must have by its own header (8-byte length, JSON header, the data its last
    tensor ends at), or None when the header itself is unreadable."""
    read = _safetensors_header(path)
    if read is None:
        return None
    start, tensors = read
    return max((entry["data_offsets"][1] for entry in tensors.values()), default=start)


def _weight_tensors(folder: Path, field: str, issues: list[ConfigIssue]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor of the folder's safetensors files, by name: (shape, file name), from their headers only
    (`safe_open` reads the header and checks the file covers the data it declares, as the workers' open does).
    A file that is not so is one issue naming it; then {}."""
    from safetensors import safe_open

    index = folder / WEIGHT_FILES[1]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({folder / name for name in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            issues.append(ConfigIssue(field, str(folder), f"holds a {index.name} without a readable weight_map "
                                                          f"({error!r})"))
            return {}
        missing = [file.name for file in files if not file.is_file()]
        if missing:
            issues.append(ConfigIssue(field, str(folder), f"lacks weight files its {index.name} lists: "
                                                          f"{', '.join(missing[:5])}"))
            return {}
    else:
        files = [folder / WEIGHT_FILES[0]]
    found: dict[str, tuple[tuple[int, ...], str]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="numpy") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                    found[name] = (tuple(handle.get_slice(name).get_shape()), file.name)
        except Exception as error:  # noqa: BLE001 - OSError, or safetensors' own error for a bad header
            size, declared = file.stat().st_size, _safetensors_size(file)
            state = ("is empty (0 bytes)" if size == 0 else
                     f"is {size:,} bytes where its header declares {declared:,}" if declared not in (None, size) else
                     f"is not a readable safetensors file ({error})")
            issues.append(ConfigIssue(field, str(folder), f"holds weights that do not load: {file} {state}; a "
                                                          "copy or download cut short? fetch the file again"))
            return {}
    return found


def _check_weights(prefix: str, path: str, issues: list[ConfigIssue]) -> None:
    """The folder's safetensors files are whole, and hold the tensors, with the shapes, its config.json implies (the
    number of layers, the vocabulary, the widths): what the workers' loader checks after Ray started. A value model's
    (critic, reward model) backbone only: its head is the worker's own. Headers only, never the weights."""
    folder, field = Path(path), f"{prefix}.path"
    if (folder / METADATA_FILE).is_file():
        return  # a hybridrl megatron checkpoint: its own reader verifies it
    found = _weight_tensors(folder, field, issues)
    value_model = prefix in ("critic.model", "reward_model.model")
    try:
        hf_config = read_hf_config(folder)
        shape = ModelShape.from_hf_config(value_model_hf_config(hf_config) if value_model else hf_config)
    except (OSError, ValueError, KeyError, TypeError):
        return  # an unreadable or unsupported config.json is said where the shape is read
    problems = hf_tensor_problems(shape, found, head=not value_model) if found else []
    if problems:
        shown = "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
        issues.append(ConfigIssue(field, path, f"holds weights that do not match its config.json "
                                               f"(num_hidden_layers={shape.num_layers}, "
                                               f"vocab_size={shape.vocab_size}): {shown}; the config.json must be "
                                               "the one saved with these weights"))


def _config_vocab_size(folder: str) -> int | None:
    """vocab_size of a model folder's config.json as the bridge reads it, or None when that is unreadable (said
    elsewhere: `load_model_shape` for the policy)."""
    try:
        return ModelShape.from_hf_config(read_hf_config(folder)).vocab_size
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _check_tokenizer_fits(config: JobConfig, issues: list[ConfigIssue], *, critic: bool) -> None:
    """The policy's tokenizer loads as `train` loads it, and every id it can produce is a row of the vocabulary of
    each model that reads the policy's token ids (the policy's, a critic's or reward model's own; a padded vocabulary
    larger than the tokenizer is fine). An id past a model's vocab_size fails in vLLM's or megatron's embedding
    lookup (`IndexError: index out of range`) after the workers started. The teacher's is the distillation rules'
    (it holds the policy's tokenizer, and a vocabulary at least the student's)."""
    policy = config.actor_rollout_ref.model
    source = policy.tokenizer_path or policy.path
    where = "actor_rollout_ref.model." + ("tokenizer_path" if policy.tokenizer_path else "path")
    try:
        size = tokenizer_size(source, trust_remote_code=policy.trust_remote_code)
    except Exception as error:  # noqa: BLE001 - whatever loading the user's tokenizer raises is the config's error
        issues.append(ConfigIssue(where, source, f"holds a tokenizer that does not load: {error}; train loads it "
                                                 "first (fix or replace the file, e.g. copy it from the model's "
                                                 "original folder)"))
        return
    for prefix, model in _model_sections(config, critic=critic):
        if prefix == "teacher.model" or (prefix != "actor_rollout_ref.model" and model.path == policy.path):
            continue
        vocab = _config_vocab_size(model.path)
        if vocab is None or size <= vocab:
            continue
        if prefix == "actor_rollout_ref.model":
            issues.append(ConfigIssue(where, source, f"holds a tokenizer of {size} tokens (ids 0..{size - 1}), more "
                                                     f"than the {vocab} of the model's vocabulary (vocab_size in "
                                                     f"{Path(model.path) / 'config.json'}): an id past {vocab - 1} "
                                                     "indexes past its embedding; use the model's own tokenizer"))
        else:
            issues.append(ConfigIssue(f"{prefix}.path", model.path,
                                      f"has a vocabulary of {vocab} (vocab_size in its config.json), fewer than the "
                                      f"{size} tokens of the policy's tokenizer ({source}), whose token ids it reads: "
                                      "use a model of the policy's family (its vocabulary at least the tokenizer's)"))


def _check_teacher_tokenizer(config: JobConfig, issues: list[ConfigIssue]) -> None:
    """On-policy distillation scores the student's token ids with the teacher: both must read them as the same
    text, so the teacher's folder must hold the policy's tokenizer (the same vocabulary, merges and added tokens)."""
    policy = config.actor_rollout_ref.model
    student, teacher = Path(policy.tokenizer_path or policy.path), Path(config.teacher.model.path)
    difference = tokenizer_difference(student, teacher)
    if difference is not None:
        issues.append(ConfigIssue("teacher.model.path", str(teacher),
                                  f"does not share the policy's tokenizer ({student}): {difference}; distillation "
                                  "scores the student's token ids with the teacher, so both must use one tokenizer "
                                  "(a teacher and student of one model family)"))


def _tokenizer_identity(source: Path) -> dict[str, object] | None:
    """What decides how a tokenizer maps ids to text: tokenizer.json's model (vocabulary, merges) and added tokens,
    or the bytes of the slow tokenizer's vocabulary files; None when the folder holds none of them. A tokenizer.json
    is read as the `tokenizers` library writes it back: one tokenizer in the files of any of its versions (merges
    as "a b" strings before 0.20, as pairs since, fields at their defaults written or not) is one identity."""
    from tokenizers import Tokenizer

    folder = source if source.is_dir() else source.parent
    fast = source if source.is_file() else folder / "tokenizer.json"
    if fast.is_file():
        try:
            data = json.loads(Tokenizer.from_file(str(fast)).to_str())
        except Exception as error:  # noqa: BLE001 - the library raises a bare Exception for a file it cannot read
            raise ValueError(f"{fast} does not load: {error}") from error
        added = sorted((token["id"], token["content"]) for token in data.get("added_tokens") or [])
        return {"model": data.get("model"), "added_tokens": added}
    files = {name: (folder / name).read_bytes() for name in ("vocab.json", "merges.txt", "tokenizer.model")
             if (folder / name).is_file()}
    return {"files": files} if files else None


def tokenizer_difference(student: Path, teacher: Path) -> str | None:
    """How the teacher's tokenizer differs from the student's (None: the same)."""
    try:
        mine, theirs = _tokenizer_identity(student), _tokenizer_identity(teacher)
    except (OSError, ValueError) as exc:
        return f"its tokenizer is unreadable ({exc})"
    if theirs is None:
        return f"it holds no tokenizer to compare (none of tokenizer.json, {', '.join(TOKENIZER_FILES[1:3])})"
    if mine is None or mine.keys() != theirs.keys():
        return "one is a fast tokenizer (tokenizer.json), the other is not"
    if mine.get("model") != theirs.get("model") or mine.get("files") != theirs.get("files"):
        return "its vocabulary or merges differ"
    if mine.get("added_tokens") != theirs.get("added_tokens"):
        return "its added (special) tokens differ"
    return None


def has_chat_template(tokenizer_source: Path) -> bool:
    """Whether the tokenizer at `tokenizer_source` (a folder, or a tokenizer.json file) carries a chat template."""
    folder = tokenizer_source if tokenizer_source.is_dir() else tokenizer_source.parent
    if any((folder / name).is_file() for name in CHAT_TEMPLATE_FILES):
        return True
    config_file = folder / "tokenizer_config.json"
    try:
        return bool(config_file.is_file() and json.loads(config_file.read_text()).get("chat_template"))
    except (OSError, ValueError):
        return False


def ground_truth_required(config: JobConfig, field: str) -> bool:
    """Whether every row of `field`'s files (data.train_files or data.val_files) needs a ground truth in its
    reward column: a rule scorer scores them (training rows unless a reward model does, validation rows always)
    and reads one (the format check excepted). A user's function may not read it, so it is never required there.
    The plan checks the column, the trainer's row read every row's value (`PromptDataset`)."""
    algorithm = config.algorithm
    reads_it = scorer_aliases().get(algorithm.reward_fn, algorithm.reward_fn) != "format"
    return _rule_scored(config, field) and reads_it


def _rule_scored(config: JobConfig, field: str) -> bool:
    """Whether a built-in rule scorer scores the rows of `field`'s files: training rows unless a reward model does,
    validation rows always, and neither when a custom function scores every row."""
    by_model = field == "data.train_files" and config.reward_model.enable
    return not by_model and not config.algorithm.custom_reward_function.path


def _check_data(config: JobConfig, issues: list[ConfigIssue], chat_template: bool | None,
                warnings: list[str]) -> int | None:
    """Check the train and validation files; return the usable rows of data.train_files (None: unusable or none)."""
    data = config.data
    train_rows = None
    if data.apply_chat_template and chat_template is False:  # every prompt, text or messages, of every file
        field, value = tokenizer_field(config.actor_rollout_ref.model)
        issues.append(ConfigIssue("data.apply_chat_template", True,
                                  f"but the tokenizer of {field}={value} has no chat template; set it false or null, "
                                  "or use a tokenizer with one"))
    if not data.train_files:
        issues.append(ConfigIssue("data.train_files", [], "is empty; name local parquet or JSONL files of prompts "
                                                          f"(the format: {GUIDE}#data)"))
    for field, files, batch in (("data.train_files", data.train_files, data.train_batch_size),
                                ("data.val_files", data.val_files, None)):
        needs_reward = ground_truth_required(config, field)
        auto = scored_by_data_source(config, field)
        rows = _check_files(field, files, data, issues, warnings, chat_template, needs_reward, auto,
                            config.actor_rollout_ref.model, config.actor_rollout_ref.rollout.multi_turn.enable is True)
        if rows is None:
            continue
        if field == "data.train_files" and files:
            train_rows = rows
        if files and batch is not None and isinstance(batch, int) and rows < batch:  # no files: said above
            issues.append(ConfigIssue("data.train_batch_size", batch,
                                      f"is more than the {rows} rows of data.train_files: not one batch; lower it to "
                                      f"at most {rows}, or add data"))
    return train_rows


def scored_by_data_source(config: JobConfig, field: str) -> bool:
    """Whether the rows of `field`'s files (data.train_files or data.val_files) are scored by the rule scorer their
    data_source names (algorithm.reward_fn=auto; training rows unless a reward model scores them, and no custom
    function scores them)."""
    return _rule_scored(config, field) and config.algorithm.reward_fn == AUTO


def unscored_data_source(config: JobConfig, field: str, prompts: Iterable[PromptItem]) -> ConfigIssue | None:
    """Under algorithm.reward_fn=auto, the first prompt of every one `train` read whose data_source names no scorer
    (the plan saw a JSONL file's first lines only): refused before any process starts, not at the step that samples
    it. None when each has one, or the rows are not scored by their data_source."""
    if not scored_by_data_source(config, field):
        return None
    for prompt in prompts:
        if scorer_for_data_source(prompt.data_source) is None:
            unset = " (a row without one reads as 'unknown')" if prompt.data_source == "unknown" else ""
            return _no_scorer(prompt.data_source, f"{unset} of {prompt.source_file} (prompt index {prompt.index}, "
                                                  f"in {field})")
    return None


def _no_scorer(source: str, where: str) -> ConfigIssue:
    """algorithm.reward_fn=auto finds no scorer for `source` (of the row or file `where` says)."""
    return ConfigIssue("algorithm.reward_fn", AUTO, f"finds no scorer for data_source {source!r}{where}; name one "
                                                    "scorer for every row, or register one for it (known: "
                                                    f"{', '.join(known_scorer_names())})")


def _check_data_sources(file: str, preview: FilePreview, issues: list[ConfigIssue]) -> None:
    """algorithm.reward_fn=auto scores each row by its data_source: every value seen must name a scorer (read whole,
    each row's, named with the first row of it)."""
    if "data_source" not in preview.columns:
        issues.append(ConfigIssue("algorithm.reward_fn", AUTO, f"scores each row by its data_source column, which "
                                                                f"{file} lacks; name one scorer for every row "
                                                                f"({', '.join(known_scorer_names())})"))
        return
    for source in sorted(preview.data_sources):
        if scorer_for_data_source(source) is not None:
            continue
        row = preview.data_source_rows.get(source)
        unset = " (a row without one reads as 'unknown')" if source == "unknown" and preview.whole else ""
        issues.append(_no_scorer(source, f"{unset} of {file}" + (f" (row {row})" if row is not None else "")))


def tokenizer_field(model: ModelConfig) -> tuple[str, str]:
    """The field the policy's tokenizer comes from, and its value: tokenizer_path when set, else the model's path."""
    if model.tokenizer_path:
        return "actor_rollout_ref.model.tokenizer_path", model.tokenizer_path
    return "actor_rollout_ref.model.path", model.path


def _check_files(field: str, files: Sequence[str], data: DataConfig, issues: list[ConfigIssue], warnings: list[str],
                 chat_template: bool | None, needs_reward: bool, by_data_source: bool,
                 model: ModelConfig, multi_turn: bool) -> int | None:
    """Each file of one list checked; the usable rows of all of them, or None when any is unusable."""
    total, usable = 0, True
    for index, file in enumerate(files):
        where = f"{field}[{index}]" if len(files) > 1 else field
        try:
            preview = check_file(file, data.prompt_key, data.reward_key, require_ground_truth=needs_reward,
                                 whole_rows=WHOLE_READ_ROWS)
        except DatasetError as error:
            rule = str(error).removeprefix(f"{file}: ")
            if not Path(file).exists() and "patterns are not expanded" not in rule:
                hub = "; hub datasets are never downloaded: write its rows to parquet or JSONL first" \
                    if looks_like_hub_id(file) else ""
                rule = f"does not exist{hub} (the format, and tools/prepare_gsm8k.py: {GUIDE}#data)"
            issues.append(ConfigIssue(where, file, rule))
            usable = False
            continue
        if preview.rows == 0:
            issues.append(ConfigIssue(where, file, "holds no rows"))
            usable = False
            continue
        total += preview.rows - (preview.malformed_rows if data.on_malformed == "skip" else 0)
        usable &= _check_rows(where, file, preview, data, warnings, issues)
        for key_field, column in (("data.prompt_key", data.prompt_key),
                                  *((("data.reward_key", data.reward_key),) if needs_reward else ())):
            if column not in preview.columns:
                close = difflib.get_close_matches(column, preview.columns, n=1, cutoff=0.5)
                hint = f"did you mean '{close[0]}'? " if close else ""
                issues.append(ConfigIssue(key_field, column, f"is not a column of {file}; {hint}its columns: "
                                                             f"{', '.join(preview.columns) or 'none'}"))
                usable = False
        for column in preview.multimodal_columns:
            issues.append(ConfigIssue(where, file, f"has the column {column!r} (verl's multimodal inputs): hybridrl "
                                                   f"trains text-only models, and each prompt would train without "
                                                   f"its {column}; drop the column to train on the text alone"))
            usable = False
        for name in sorted(preview.agent_names):  # verl's agent loop per row: the job's loop, or refused
            problem = agent_name_problem(name, multi_turn)
            if problem is not None:
                issues.append(ConfigIssue(where, file, problem))
                usable = False
        if by_data_source:
            _check_data_sources(file, preview, issues)
        if preview.prompt_kind == "messages":
            if data.apply_chat_template is False:
                issues.append(ConfigIssue("data.apply_chat_template", False,
                                          f"but the prompts of {file} are chat messages, which only a chat template "
                                          "turns into text: unset it (null formats chat messages, as verl does) "
                                          "or set it true"))
            elif chat_template is False and not data.apply_chat_template:  # true: refused once, by _check_data
                field, value = tokenizer_field(model)
                issues.append(ConfigIssue(field, value,
                                          f"names a tokenizer without a chat template, but the prompts of {file} are "
                                          "chat messages; use the instruct model's tokenizer or store text prompts"))
    return total if usable else None


def _check_rows(where: str, file: str, preview: FilePreview, data: DataConfig, warnings: list[str],
                issues: list[ConfigIssue]) -> bool:
    """The file's rows as `train` reads them (`check_file`): a malformed one refused naming its row (skipped rows
    said), or, for a file too large to read whole, what the plan checked of it; whether they are usable."""
    if not preview.whole:
        checked = ("its schema and data_source column" if Path(file).suffix.lower() in PARQUET_SUFFIXES
                   else f"its first {_PREVIEW_LINES} lines")
        warnings.append(f"{where}: {file} holds {preview.rows:,} rows, more than the {WHOLE_READ_ROWS:,} the plan "
                        f"reads whole: it checked {checked}; train reads and checks every row before any process "
                        "starts")
        return True
    if not preview.malformed_rows:
        return True
    row, reason = preview.malformed[0]
    if data.on_malformed == "skip":
        examples = "; ".join(f"row {number}: {why}" for number, why in preview.malformed)
        warnings.append(f"{where}: {preview.malformed_rows} malformed rows of {file} are skipped "
                        f"(data.on_malformed=skip), e.g. {examples}")
        return True
    issues.append(ConfigIssue(where, file, malformed_row(f"row {row}", reason, preview.malformed_rows - 1)))
    return False


def _check_reward(config: JobConfig, issues: list[ConfigIssue]) -> str | None:
    """The scorer or custom function `train` loads, checked; how it calls the custom function (`call_form`), when
    it can."""
    custom = config.algorithm.custom_reward_function
    if custom.path:
        if not Path(custom.path).is_file():
            issues.append(ConfigIssue("algorithm.custom_reward_function.path", custom.path,
                                      "does not exist; name the Python file that defines the reward function "
                                      f"(trusted code; the conventions: {GUIDE}#rewards)"))
            return None
        try:
            function = load_reward_function(custom.path, custom.name)
        except RewardFunctionError as error:
            field = "algorithm.custom_reward_function." + ("name" if "has no function" in str(error) else "path")
            issues.append(ConfigIssue(field, custom.name if field.endswith("name") else custom.path, str(error)))
            return None
        found = call_problem(function, custom.reward_kwargs)
        if found is not None:
            name, problem = found
            issues.append(ConfigIssue(f"algorithm.custom_reward_function.{name}", getattr(custom, name), problem))
            return None
        return call_form(function, custom.reward_kwargs)
    try:
        get_scorer(config.algorithm.reward_fn)
    except UnknownScorerError as error:
        issues.append(ConfigIssue("algorithm.reward_fn", config.algorithm.reward_fn,
                                  str(error).replace(f"unknown reward scorer {config.algorithm.reward_fn!r}.",
                                                     "is not a known scorer.").strip()))
    return None
