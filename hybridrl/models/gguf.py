"""GGUF file -> plain Hugging Face folder (safetensors, tokenizer, chat template, generation config).

A GGUF file (llama.cpp's format) holds quantized weights, the model's hyper-parameters and its
tokenizer. transformers reads it (`from_pretrained(..., gguf_file=...)`, which needs the `gguf` and
`accelerate` packages) and, for the architectures hybridrl's bridge supports, dequantizes every
weight into a dense model; that model still carries a `quantization_config` and refuses
`save_pretrained`. `convert_gguf_to_hf` copies its weights into a fresh model of the same class
built from the config without the quantization entry (a strict load: every key must match), and
saves that with the tokenizer, so the result is an ordinary HF folder every part of hybridrl
(megatron bridge, vLLM, transformers) loads.

The dequantized weights are the quantized model's, exactly (Q4_1 blocks -> fp32); they are not
the original full-precision checkpoint's.

torch, transformers and `hybridrl.models.checkpoint` (which imports torch) are imported inside the
functions: `hybridrl convert`'s parser imports this module and stays torch-free.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hybridrl.models.arch import SUPPORTED_ARCHITECTURES, ModelShape, UnsupportedModelError
from hybridrl.persistence import CheckpointError, atomic_dir, check_free_space, check_output_dir

# The versions measured with transformers 5.19 (setup.py's `dev` extra pins the same).
REQUIRED_PACKAGES = {"gguf": "0.19.0", "accelerate": "1.15.0"}
INSTALL_HINT = "pip install " + " ".join(f"'{name}=={version}'" for name, version in REQUIRED_PACKAGES.items())
GGUF_MAGIC = b"GGUF"
# Keys of transformers' GGUF-derived config that have no meaning in a plain HF folder.
_DROPPED_CONFIG_KEYS = ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version")


class GGUFError(ValueError):
    """The GGUF file cannot be converted (not a GGUF file, unreadable, unsupported)."""


class MissingGGUFDependencyError(ImportError):
    """`gguf` or `accelerate` is not installed."""


def check_dependencies() -> None:
    missing = [name for name in REQUIRED_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingGGUFDependencyError(
            f"reading GGUF files needs the Python package(s) {', '.join(missing)} "
            f"(transformers' GGUF loader uses gguf and accelerate): {INSTALL_HINT}, "
            "or `pip install -e '.[dev]'`")


def supported_model_types() -> dict[str, str]:
    """HF model_type -> architecture, for the families `hybridrl.models.arch` supports."""
    return {family.model_type: family.architecture for family in SUPPORTED_ARCHITECTURES.values()}


def check_gguf_file(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    with path.open("rb") as handle:
        magic = handle.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path} is not a GGUF file (starts with {magic!r}, not {GGUF_MAGIC!r})")
    return path


@contextlib.contextmanager
def _one_reader(path: Path) -> Iterator[None]:
    """Parse the file once while transformers loads it.

    `from_pretrained(gguf_file=...)` builds a `gguf.GGUFReader` for the config, again for the
    tensors and again for the tokenizer's config; each parse of this 49152-token vocabulary costs
    10-20 s on a CPU core. The reader is read-only, so one instance serves every call on this path.
    """
    import gguf

    original = gguf.GGUFReader
    cache: dict[str, Any] = {}
    target = str(path.resolve())

    def reader(file: Any, *args: Any, **kwargs: Any) -> Any:
        key = str(Path(file).resolve())
        if key != target or args or kwargs:
            return original(file, *args, **kwargs)
        if key not in cache:
            cache[key] = original(file)
        return cache[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


@contextlib.contextmanager
def _transformers_progress(enabled: bool) -> Iterator[None]:
    """transformers' own progress bars on or off (its GGUF dequantization bar ignores the switch, so
    its module's `tqdm` is replaced by a disabled one while `enabled` is False)."""
    import functools

    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    original_tqdm = getattr(gguf_utils, "tqdm", None)
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    if not enabled and original_tqdm is not None:
        gguf_utils.tqdm = functools.partial(original_tqdm, disable=True)
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was_enabled else hf_logging.disable_progress_bar)()
        if original_tqdm is not None:
            gguf_utils.tqdm = original_tqdm


def read_gguf_config(path: str | Path) -> dict[str, Any]:
    """The HF config transformers derives from the file's metadata (no tensors read), checked against
    the architectures the bridge supports."""
    check_dependencies()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = check_gguf_file(path)
    try:
        config = dict(load_gguf_checkpoint(str(path), return_tensors=False)["config"])
    except ValueError as exc:  # transformers: "GGUF model with architecture X is not supported yet."
        detail = " (transformers cannot read it either)"
        raise UnsupportedModelError(_unsupported(path, gguf_architecture(path), detail)) from exc
    _architecture_for(config, path)
    return config


def gguf_architecture(path: str | Path) -> str:
    """The file's `general.architecture` (llama.cpp's name: 'llama', 'qwen2', ...)."""
    import gguf

    field = gguf.GGUFReader(str(path)).fields.get("general.architecture")
    return str(field.contents()) if field is not None else "<none>"


def _unsupported(path: Path, architecture: str, detail: str = "") -> str:
    types = supported_model_types()
    return (f"{path}: GGUF architecture {architecture!r} is not supported by hybridrl's megatron bridge"
            f"{detail}; supported: {', '.join(f'{t} ({a})' for t, a in sorted(types.items()))}")


def _architecture_for(config: dict[str, Any], path: Path) -> str:
    model_type = config.get("model_type")
    types = supported_model_types()
    if model_type not in types:
        raise UnsupportedModelError(_unsupported(path, str(model_type)))
    return types[model_type]


def load_gguf_model(path: str | Path, progress: bool = False, tokenizer: bool = True) -> tuple[Any, Any]:
    """transformers' own load of the file: (dequantized fp32 model, tokenizer or None). The model keeps
    its `quantization_config` (transformers refuses to save it); `convert_gguf_to_hf` makes it plain."""
    import torch
    import transformers

    path = check_gguf_file(path)
    with _one_reader(path), _transformers_progress(progress):
        read_gguf_config(path)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32)
        loaded_tokenizer = (transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
                            if tokenizer else None)
    model.eval()
    return model, loaded_tokenizer


def plain_config_dict(model: Any, dtype: Any) -> dict[str, Any]:
    """The loaded model's config without GGUF/quantization entries, with `architectures` set."""
    from hybridrl.models.checkpoint import DTYPE_NAMES

    config = model.config.to_dict()
    for key in _DROPPED_CONFIG_KEYS:
        config.pop(key, None)
    config["architectures"] = [_architecture_for(config, Path(str(model.name_or_path)))]
    config["dtype"] = DTYPE_NAMES[dtype]
    ModelShape.from_hf_config(config)  # the bridge can represent it (raises UnsupportedModelError)
    return config


def _skip_weight_init() -> Any:
    """transformers' `no_init_weights` (every weight is overwritten by the strict load that follows)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers: initialize, which only costs time
        return contextlib.nullcontext()
    return no_init_weights()


def _gguf_numel(path: Path) -> int:
    """Elements of all tensors once dense, from the tensor table (no tensor data read)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    total = 0
    for tensor in reader.tensors:
        count = 1
        for dim in tensor.shape:
            count *= int(dim)
        total += count
    return total


def convert_gguf_to_hf(
    gguf_path: str | Path, out_dir: str | Path, *, dtype: Any = None, force: bool = False,
    progress: bool = False,
) -> Path:
    """Write the GGUF file's model as a plain HF folder at `out_dir` (atomically).

    Checks first (dependencies, the file, the architecture, the output folder, free disk space), then
    loads with transformers, copies the weights into a plain model and saves it, with tokenizer,
    chat template and generation config, into a staging folder next to `out_dir` that is renamed
    into place at the end: on any error `out_dir` is left as it was.
    """
    import torch
    import transformers
    from tqdm import tqdm

    check_dependencies()
    path = check_gguf_file(gguf_path)
    out_dir = Path(out_dir)
    dtype = dtype or torch.float32
    if dtype not in (torch.float32, torch.bfloat16):
        raise CheckpointError(f"gguf-to-hf writes float32 or bfloat16, not {dtype}")
    inputs = {"the GGUF file": path}
    check_output_dir(out_dir, force, inputs)
    stages = ["read metadata", "dequantize (transformers)", "plain model", "write folder", "check"]
    with _one_reader(path), tqdm(total=len(stages), desc="gguf-to-hf", unit="stage", disable=not progress,
                                 leave=False) as bar:
        bar.set_postfix_str(stages[0])
        read_gguf_config(path)
        element_size = torch.empty((), dtype=dtype).element_size()
        check_free_space(out_dir, element_size * _gguf_numel(path) + (64 << 20))  # + tokenizer files
        bar.update(1)

        bar.set_postfix_str(stages[1])
        loaded, tokenizer = load_gguf_model(path, progress=progress)
        bar.update(1)

        bar.set_postfix_str(stages[2])
        config_dict = plain_config_dict(loaded, dtype)
        config = transformers.AutoConfig.for_model(**config_dict)
        model_class = getattr(transformers, config_dict["architectures"][0])
        with _skip_weight_init():  # buffers (RoPE frequencies) are still computed: they are not in the file
            plain = model_class(config)
        state = loaded.state_dict()
        plain.load_state_dict(state, strict=True, assign=True)
        if config.tie_word_embeddings:
            plain.tie_weights()
        plain = plain.to(dtype)
        plain.generation_config = transformers.GenerationConfig.from_model_config(config)
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(loaded.generation_config, key, None)
            if value is not None:
                setattr(plain.generation_config, key, value)
        del loaded, state
        bar.update(1)

        bar.set_postfix_str(stages[3])
        tokenizer.model_max_length = config.max_position_embeddings  # GGUF leaves it unbounded
        with atomic_dir(out_dir, force, inputs) as tmp:
            plain.save_pretrained(str(tmp))
            tokenizer.save_pretrained(str(tmp))
            bar.update(1)
            bar.set_postfix_str(stages[4])
            check_hf_folder(tmp)
        bar.update(1)
    return out_dir


def check_hf_folder(folder: str | Path) -> None:
    """What a converted folder must be: plain config the bridge supports, weights, tokenizer with a
    chat template, generation config."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    if "quantization_config" in config:
        raise CheckpointError(f"{folder}/config.json still has a quantization_config")
    ModelShape.from_hf_config(config)
    missing = [name for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json")
               if not (folder / name).is_file()]
    if not any(folder.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise CheckpointError(f"{folder} lacks {', '.join(missing)}")
    if not has_chat_template(folder):
        raise CheckpointError(f"{folder}: the tokenizer lost its chat template")


def has_chat_template(folder: str | Path) -> bool:
    folder = Path(folder)
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    return bool(tokenizer_config.get("chat_template"))
