"""Checkpoint IO: read HF and sharded-megatron checkpoints tensor range by tensor range, write both.

Readers expose one operation, `read(hf_name, axis, start, stop)`: a range of an HF-named tensor,
whatever the files hold. For an HF folder that is a `safetensors` slice read; for our sharded
megatron checkpoint it is stitched from the rank files that hold pieces of it (`layout.hf_export_map`).
Writers pull every output tensor through `assemble(reader, plan)`, so HF→mcore, mcore→HF and
mcore→mcore re-sharding are the same code, and no step holds more than one rank file's tensors
(mcore) or one output shard (HF).

Sharded megatron checkpoint (`hybridrl convert hf-to-mcore`, or `bridge.save_mcore_checkpoint`):
  model_tp{T:02d}_pp{P:03d}[_ep{E:03d}[_etp{X:02d}]].safetensors  one per rank file position
                                         (`layout.ParallelLayout.model_ranks`: TP×PP(×EP), or per
                                         slot of TP and expert TP×EP when they differ); keys =
                                         GPTModel.state_dict() keys (local-spec names), prefixed
                                         `model{v}.` per VPP chunk
  hybridrl_checkpoint.json               format, layout, architecture, HF config, dtype, padded
                                         vocab, and shape/dtype/sha256 of every tensor
  hf_assets/                             tokenizer and other small files copied from the HF folder

Every writer checks its output (never one of its inputs, nor a folder holding or inside one) and the free disk
space first and writes into a staging folder that is renamed into place at the end (`hybridrl.persistence`): on
any error the output is left as it was.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open

from hybridrl.models.arch import ModelShape, read_hf_config
from hybridrl.models.layout import (
    PICKLED_WEIGHTS_HINT,
    ModelRank,
    ParallelLayout,
    ShardRange,
    TensorPlan,
    hf_export_map,
    hf_tensor_axis,
    hf_tensor_problems,
    hf_tensor_shapes,
    rank_file_fields,
    rank_file_name,
    rank_tensor_plans,
)
from hybridrl.persistence import (
    METADATA_FILE,
    CheckpointError,
    atomic_dir,
    check_free_space,
    check_output_dir,
    save_safetensors,
    verl_checkpoint_hint,
)

# a training checkpoint keeps each role's weights in such a checkpoint under `<global_step_N>/<role>/model`
MODEL_DIR = "model"
CHECKPOINT_FORMAT = "hybridrl-mcore"
CHECKPOINT_VERSION = 1
ASSETS_DIR = "hf_assets"
HF_INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
# Small non-weight files of an HF folder worth carrying through a conversion (tokenizer, templates).
ASSET_PATTERNS: tuple[str, ...] = (
    "tokenizer*", "special_tokens_map.json", "vocab.*", "merges.txt", "*.model", "chat_template*",
    "added_tokens.json", "preprocessor_config.json",
)

_ST_DTYPES: dict[str, torch.dtype] = {
    "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
}
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
}


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    if name is None or isinstance(name, torch.dtype):
        return name
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
    key = aliases.get(name.lower(), name.lower().removeprefix("torch."))
    if key not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"unsupported dtype {name!r}: expected float32, bfloat16 or float16")
    return getattr(torch, key)


def tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 of the tensor's raw bytes as stored (dtype-exact, layout-independent); GPU tensors are
    read through a host copy (numpy cannot see device memory)."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


# ---- readers ----------------------------------------------------------------------------------------

class _SafetensorsFiles:
    """Open-on-demand safetensors handles (kept open: get_slice is cheap on an open file)."""

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()
        self._handles: dict[Path, Any] = {}

    def get(self, path: Path) -> Any:
        if path not in self._handles:
            try:
                self._handles[path] = self._stack.enter_context(safe_open(str(path), framework="pt"))
            except OSError as exc:
                raise CheckpointError(f"cannot open {path}: {exc}") from exc
            except Exception as exc:  # safetensors' own error type: a bad header, or fewer bytes than it lists
                raise CheckpointError(f"cannot read {path}: {exc} (not a complete safetensors file: damaged, or "
                                      "cut short by an interrupted download or copy)") from exc
        return self._handles[path]

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()


def _slice(handle: Any, key: str, axis: int | None, start: int, stop: int) -> torch.Tensor:
    view = handle.get_slice(key)
    if axis is None:
        return view[:]
    if axis == 0:
        return view[start:stop]
    if axis == 1:
        return view[:, start:stop]
    raise ValueError(f"axis {axis} not supported")


class HFCheckpointReader:
    """Reads tensor ranges from an HF folder (`model.safetensors` or sharded with an index json)."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        if not self.dir.is_dir():
            raise CheckpointError(f"HF checkpoint folder {self.dir} does not exist")
        self.config = read_hf_config(self.dir)
        self.shape = ModelShape.from_hf_config(self.config)
        self._files = _SafetensorsFiles()
        try:
            self.weight_files = self._weight_map()
            self._check_tensors()
        except BaseException:
            self._files.close()
            raise

    def _weight_map(self) -> dict[str, Path]:
        index = self.dir / HF_INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                out = {name: self.dir / fname for name, fname in weight_map.items()}
            except (ValueError, TypeError, KeyError, AttributeError) as exc:  # not JSON, or not {"weight_map": {...}}
                raise CheckpointError(f"{index} is not a safetensors index ({type(exc).__name__}: {exc}): "
                                      'expected a JSON object with "weight_map": {tensor name: file name}') from exc
            missing = sorted({str(p.name) for p in out.values() if not p.is_file()})
            if missing:
                raise CheckpointError(f"{index} lists files that are missing: {', '.join(missing)}")
            return out
        single = self.dir / "model.safetensors"
        if not single.is_file():
            others = sorted(p.name for p in self.dir.glob("*.bin"))
            hint = f" (found {', '.join(others)}: {PICKLED_WEIGHTS_HINT})" if others else ""
            raise CheckpointError(f"no model.safetensors or {HF_INDEX_FILE} in {self.dir}{hint}")
        # through the handles, which name the file when it is damaged (a truncated download)
        return {name: single for name in self._files.get(single).keys()}  # noqa: SIM118 - safe_open has no __iter__

    def _check_tensors(self) -> None:
        found = {name: (tuple(self._files.get(path).get_slice(name).get_shape()), path.name)
                 for name, path in self.weight_files.items()}
        problems = hf_tensor_problems(self.shape, found)
        if problems:
            raise CheckpointError(f"HF checkpoint {self.dir} does not match its config.json "
                                  f"({self.shape.architecture}): " + "; ".join(problems))

    def read(self, hf_name: str, axis: int | None, start: int, stop: int) -> torch.Tensor:
        return _slice(self._files.get(self.weight_files[hf_name]), hf_name, axis, start, stop)

    def dtype_of(self, hf_name: str) -> torch.dtype:
        st = self._files.get(self.weight_files[hf_name]).get_slice(hf_name).get_dtype()
        return _ST_DTYPES[st]

    def generation_config(self) -> dict[str, Any] | None:
        path = self.dir / "generation_config.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def assets(self) -> list[Path]:
        found: dict[str, Path] = {}
        for pattern in ASSET_PATTERNS:
            for path in self.dir.glob(pattern):
                if path.is_file():
                    found[path.name] = path
        return [found[name] for name in sorted(found)]

    def close(self) -> None:
        self._files.close()


@dataclass(frozen=True)
class McoreMetadata:
    path: Path
    raw: dict[str, Any]
    shape: ModelShape
    layout: ParallelLayout

    @classmethod
    def read(cls, ckpt_dir: str | Path) -> McoreMetadata:
        ckpt_dir = Path(ckpt_dir)
        meta_path = ckpt_dir / METADATA_FILE
        if not meta_path.is_file():
            verl = verl_checkpoint_hint(ckpt_dir)
            raise CheckpointError(f"{ckpt_dir} is not a hybridrl megatron checkpoint: no {METADATA_FILE}"
                                  + (f"; it is {verl}, then hybridrl convert hf-to-mcore --hf on it for a "
                                     "megatron checkpoint" if verl else ""))
        raw = json.loads(meta_path.read_text())
        if raw.get("format") != CHECKPOINT_FORMAT or raw.get("version") != CHECKPOINT_VERSION:
            raise CheckpointError(f"{meta_path}: format {raw.get('format')!r} v{raw.get('version')!r}, "
                                  f"expected {CHECKPOINT_FORMAT!r} v{CHECKPOINT_VERSION}")
        layout = ParallelLayout(**raw["layout"])
        return cls(ckpt_dir, raw, ModelShape.from_hf_config(raw["hf_config"]), layout)

    @property
    def hf_config(self) -> dict[str, Any]:
        return self.raw["hf_config"]

    @property
    def files(self) -> dict[str, dict[str, Any]]:
        return self.raw["files"]


class McoreCheckpointReader:
    """Reads HF-named tensor ranges out of a sharded megatron checkpoint, after verifying it."""

    def __init__(self, ckpt_dir: str | Path, verify: bool = True,
                 progress: Callable[[int], Any] | None = None):
        self.meta = McoreMetadata.read(ckpt_dir)
        self.dir = self.meta.path
        self.shape, self.layout = self.meta.shape, self.meta.layout
        self.config = self.meta.hf_config
        self._files = _SafetensorsFiles()
        self._check_structure()
        if verify:
            self.verify(progress)
        self._pieces = hf_export_map(self.shape, self.layout)

    def _rank_path(self, tp_rank: int, pp_rank: int, ep_rank: int = 0, etp_rank: int | None = None) -> Path:
        return self.dir / rank_file_name(self.layout, tp_rank, pp_rank, ep_rank, etp_rank)

    def _check_structure(self) -> None:
        """Every rank file exists and holds exactly the tensors its layout implies, with their shapes."""
        for rank in self.layout.model_ranks():
            fname = rank_file_name(self.layout, *rank)
            path = self.dir / fname
            if not path.is_file():
                raise CheckpointError(f"checkpoint {self.dir} is incomplete: {fname} is missing")
            plans = rank_tensor_plans(self.shape, self.layout, *rank)
            recorded = self.meta.files.get(fname, {}).get("tensors", {})
            handle = self._files.get(path)
            keys = set(handle.keys())
            if keys != set(plans) or set(recorded) != set(plans):
                diff = sorted(set(plans) ^ keys) or sorted(set(plans) ^ set(recorded))
                raise CheckpointError(f"{fname} does not match the checkpoint layout; "
                                      f"differing tensors: {', '.join(diff[:6])}")
            for key, plan in plans.items():
                got = tuple(handle.get_slice(key).get_shape())
                if got != plan.shape:
                    raise CheckpointError(f"{fname} tensor {key} has shape {list(got)}, layout "
                                          f"implies {list(plan.shape)}")

    def verify(self, progress: Callable[[int], Any] | None = None) -> None:
        """Recompute every tensor's sha256 against the metadata; name the file and tensor on mismatch."""
        for fname, entry in self.meta.files.items():
            handle = self._files.get(self.dir / fname)
            for key, info in entry["tensors"].items():
                if tensor_sha256(handle.get_tensor(key)) != info["sha256"]:
                    raise CheckpointError(
                        f"checksum mismatch in {self.dir / fname}, tensor {key}: the file was "
                        "modified or corrupted after it was written"
                    )
                if progress is not None:
                    progress(1)

    def num_tensors(self) -> int:
        return sum(len(entry["tensors"]) for entry in self.meta.files.values())

    def read(self, hf_name: str, axis: int | None, start: int, stop: int) -> torch.Tensor:
        return read_pieces(self._pieces[hf_name], lambda rank: self._files.get(self._rank_path(*rank)),
                           axis, start, stop)

    def dtype_of(self, hf_name: str) -> torch.dtype:
        return parse_dtype(self.meta.raw["dtype"])  # type: ignore[return-value]

    def generation_config(self) -> dict[str, Any] | None:
        return self.meta.raw.get("generation_config")

    def assets(self) -> list[Path]:
        folder = self.dir / ASSETS_DIR
        return sorted(p for p in folder.iterdir() if p.is_file()) if folder.is_dir() else []

    def close(self) -> None:
        self._files.close()


def read_pieces(pieces: Sequence[ShardRange], handle_of: Callable[[ModelRank], Any], axis: int | None,
                start: int, stop: int, key_prefix: str = "") -> torch.Tensor:
    """Range [start, stop) along `axis` of one HF tensor, stitched from the rank files holding its pieces.

    `pieces` is that tensor's entry of `layout.hf_export_map`; `handle_of(rank)` opens the
    safetensors file of a rank file position (`layout.ModelRank`); `key_prefix` is put before each
    piece's key (files that hold several tensors per parameter, e.g. the optimizer states of
    `hybridrl.training.checkpointing`).
    """
    parts = []
    for piece in pieces:
        handle = handle_of(piece.rank)
        if piece.axis is None:
            return _slice(handle, key_prefix + piece.key, None, 0, 0)
        lo, hi = max(start, piece.hf_start), min(stop, piece.hf_stop)
        if lo < hi:
            off = piece.shard_offset + lo - piece.hf_start
            parts.append((lo, _slice(handle, key_prefix + piece.key, piece.axis, off, off + hi - lo)))
    parts.sort(key=lambda item: item[0])
    return torch.cat([t for _, t in parts], dim=axis if axis is not None else 0)


TensorReader = HFCheckpointReader | McoreCheckpointReader


class RangeReader(Protocol):
    """What `assemble` reads through: range [start, stop) along `axis` of one HF tensor (a checkpoint reader, or
    `training.train_state.KindReader` over one kind of optimizer state)."""

    def read(self, hf_name: str, axis: int | None, start: int, stop: int) -> torch.Tensor: ...


def assemble(reader: RangeReader, plan: TensorPlan, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Build one megatron tensor from its plan: HF ranges concatenated along the axis, zero padding."""
    parts: list[torch.Tensor] = []
    for seg in plan.segments:
        if seg.hf_name is None:
            pad_shape = list(plan.shape)
            pad_shape[plan.axis or 0] = seg.length
            parts.append(torch.zeros(pad_shape, dtype=parts[0].dtype if parts else torch.float32))
        else:
            parts.append(reader.read(seg.hf_name, plan.axis, seg.start, seg.stop))
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=plan.axis or 0)
    if tuple(out.shape) != plan.shape:
        raise CheckpointError(f"{plan.name}: assembled shape {list(out.shape)} != {list(plan.shape)}")
    return out.to(dtype) if dtype is not None else out


def read_hf_tensor(reader: TensorReader, shape: ModelShape, hf_name: str) -> torch.Tensor:
    full = hf_tensor_shapes(shape)[hf_name]
    axis = hf_tensor_axis(shape, hf_name)
    return reader.read(hf_name, axis, 0, full[axis] if axis is not None else 0)


def _copy_assets(assets: list[Path], dest: Path) -> None:
    if assets:
        dest.mkdir(exist_ok=True)
        for path in assets:
            shutil.copy2(path, dest / path.name)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# ---- writers ----------------------------------------------------------------------------------------

def write_rank_file(path: Path, tensors: Mapping[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """Save one rank's tensors; return their metadata entries (shape, dtype, sha256)."""
    contiguous = {key: t.detach().contiguous() for key, t in tensors.items()}
    save_safetensors(contiguous, path, metadata={"format": "pt"})
    return {
        key: {"shape": list(t.shape), "dtype": DTYPE_NAMES[t.dtype], "sha256": tensor_sha256(t)}
        for key, t in contiguous.items()
    }


def mcore_metadata(
    shape: ModelShape, layout: ParallelLayout, hf_config: Mapping[str, Any], dtype: torch.dtype,
    files: dict[str, dict[str, Any]], generation_config: Mapping[str, Any] | None,
    assets: list[str],
) -> dict[str, Any]:
    chunks = [
        {"pp_rank": c.pp_rank, "vp_stage": c.vp_stage, "first_layer": c.first_layer,
         "num_layers": c.num_layers}
        for c in layout.all_chunks(shape.num_layers)
    ]
    return {
        "format": CHECKPOINT_FORMAT,
        "version": CHECKPOINT_VERSION,
        "architecture": shape.architecture,
        "layout": layout.to_dict(),
        "dtype": DTYPE_NAMES[dtype],
        "vocab_size": shape.vocab_size,
        "padded_vocab_size": shape.padded_vocab_size(layout.tp),
        "layer_chunks": chunks,
        "model_shape": shape.to_dict(),
        "hf_config": dict(hf_config),
        "generation_config": dict(generation_config) if generation_config else None,
        "assets": assets,
        "files": files,
    }


def source_dtype(reader: TensorReader) -> torch.dtype:
    """The input's dtype (that of its embedding), used when no output dtype is asked for (megatron outputs)."""
    return reader.dtype_of(reader.shape.weights.embedding.hf_name)


def declared_dtype(config: Mapping[str, Any]) -> torch.dtype | None:
    """The dtype a model's config.json declares (transformers 5's `dtype`, 4's `torch_dtype`) when it is one a
    checkpoint holds (float32, bfloat16, float16), else None."""
    for key in ("dtype", "torch_dtype"):
        value = config.get(key)
        if isinstance(value, str):
            try:
                return parse_dtype(value)
            except ValueError:
                continue
    return None


def hf_export_dtype(reader: TensorReader) -> torch.dtype:
    """The dtype of an HF folder written when none is asked for: the model's own, as its config.json declares it
    (the checkpoint keeps that config), else the stored tensors'. A training checkpoint holds its training dtype,
    which need not be the model's: fp32 on CPU by default, for a bf16 model too, whose export is then bf16 as the
    model came in (`--dtype float32` keeps the trained fp32 values)."""
    return declared_dtype(reader.config) or source_dtype(reader)


def _progress_bar(total: int, desc: str, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tensor", disable=not enabled, leave=False)


def estimated_mcore_bytes(shape: ModelShape, layout: ParallelLayout, dtype: torch.dtype) -> int:
    numel = 0
    for rank in layout.model_ranks():
        for plan in rank_tensor_plans(shape, layout, *rank).values():
            count = 1
            for dim in plan.shape:
                count *= dim
            numel += count
    return numel * _element_size(dtype)


def write_mcore_checkpoint(
    reader: TensorReader, out_dir: str | Path, layout: ParallelLayout, *, dtype: torch.dtype | None = None,
    force: bool = False, progress: bool = False,
) -> Path:
    """Write `reader`'s model as a sharded megatron checkpoint for `layout` (atomically)."""
    shape: ModelShape = reader.shape
    shape.check_parallel(**layout.sizes())
    out_dir = Path(out_dir)
    # a dtype asked for becomes the model's: its config.json says so, as an HF export's does (`hf_export_dtype`)
    config = hf_config_for_export(reader.config, dtype) if dtype is not None else dict(reader.config)
    dtype = dtype or source_dtype(reader)
    inputs = {"the input checkpoint": reader.dir}
    check_output_dir(out_dir, force, inputs)
    check_free_space(out_dir, estimated_mcore_bytes(shape, layout, dtype))
    rank_plans = {
        ranks: rank_tensor_plans(shape, layout, *ranks) for ranks in layout.model_ranks()
    }
    total = sum(len(p) for p in rank_plans.values())
    files: dict[str, dict[str, Any]] = {}
    assets = reader.assets()
    with atomic_dir(out_dir, force, inputs) as tmp, _progress_bar(total, "hf-to-mcore", progress) as bar:
        for rank, plans in rank_plans.items():
            tensors = {}
            for key, plan in plans.items():
                tensors[key] = assemble(reader, plan, dtype)
                bar.update(1)
            fname = rank_file_name(layout, *rank)
            files[fname] = rank_file_fields(layout, rank) | {"tensors": write_rank_file(tmp / fname, tensors)}
            del tensors
        _copy_assets(assets, tmp / ASSETS_DIR)
        meta = mcore_metadata(shape, layout, config, dtype, files, reader.generation_config(),
                              [p.name for p in assets])
        (tmp / METADATA_FILE).write_text(json.dumps(meta, indent=1, sort_keys=False))
    return out_dir


def hf_config_for_export(config: Mapping[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    out = dict(config)
    name = DTYPE_NAMES[dtype]
    keys = [k for k in ("dtype", "torch_dtype") if k in out] or ["dtype"]
    for key in keys:
        out[key] = name
    return out


def generation_config_for_export(config: Mapping[str, Any], stored: Mapping[str, Any] | None) -> dict:
    if stored:
        return dict(stored)
    # What transformers derives from the model config when a folder has no generation_config.json.
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    out = {k: config[k] for k in keys if config.get(k) is not None}
    out["_from_model_config"] = True
    return out


def write_hf_checkpoint(
    reader: TensorReader, out_dir: str | Path, *, dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, force: bool = False, progress: bool = False,
    adjust: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
    inputs: Mapping[str, str | Path] | None = None,
) -> Path:
    """Write `reader`'s model as an HF folder: safetensors shards (+ index), config, generation config
    (the output checked up front, written into a staging folder renamed into place). `adjust(name, tensor)`:
    each HF tensor as written (a LoRA checkpoint's adapters merged into the weights they adapt); `inputs`: other
    folders read besides the reader's (name -> path; that LoRA folder), which the output must keep apart from."""
    out_dir = Path(out_dir)
    dtype = dtype or hf_export_dtype(reader)
    inputs = {"the input checkpoint": reader.dir, **(inputs or {})}
    check_output_dir(out_dir, force, inputs)
    check_free_space(out_dir, estimated_hf_bytes(reader.shape, dtype))
    with atomic_dir(out_dir, force, inputs) as tmp:
        write_hf_files(reader, tmp, dtype=dtype, max_shard_bytes=max_shard_bytes, progress=progress, adjust=adjust)
    return out_dir


def estimated_hf_bytes(shape: ModelShape, dtype: torch.dtype) -> int:
    return sum(_numel(s) * _element_size(dtype) for s in hf_tensor_shapes(shape).values())


def write_hf_files(
    reader: TensorReader, folder: Path, *, dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, progress: bool = False,
    adjust: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """The HF folder's files written into `folder` (an existing, empty staging folder), in `dtype` (None: the
    model's own, `hf_export_dtype`)."""
    shape: ModelShape = reader.shape
    dtype = dtype or hf_export_dtype(reader)
    hf_shapes = hf_tensor_shapes(shape)
    sizes = {name: _numel(s) * _element_size(dtype) for name, s in hf_shapes.items()}
    # Plan shards first (HF's greedy rule: start a new shard when the next tensor would overflow).
    shards: list[list[str]] = [[]]
    used = 0
    for name in hf_shapes:
        if shards[-1] and used + sizes[name] > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += sizes[name]
    n = len(shards)
    names = (["model.safetensors"] if n == 1
             else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)])
    assets = reader.assets()
    with _progress_bar(len(hf_shapes), "to-hf", progress) as bar:
        weight_map: dict[str, str] = {}
        for fname, members in zip(names, shards):
            tensors = {}
            for name in members:
                tensor = read_hf_tensor(reader, shape, name)
                tensors[name] = (adjust(name, tensor) if adjust else tensor).to(dtype).contiguous()
                weight_map[name] = fname
                bar.update(1)
            save_safetensors(tensors, folder / fname, metadata={"format": "pt"})
            del tensors
        if n > 1:
            index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
            (folder / HF_INDEX_FILE).write_text(json.dumps(index, indent=2))
        config = hf_config_for_export(reader.config, dtype)
        (folder / "config.json").write_text(json.dumps(config, indent=2))
        gen = generation_config_for_export(config, reader.generation_config())
        (folder / "generation_config.json").write_text(json.dumps(gen, indent=2))
        for path in assets:
            shutil.copy2(path, folder / path.name)


def _numel(dims: tuple[int, ...]) -> int:
    count = 1
    for dim in dims:
        count *= dim
    return count


def open_reader(path: str | Path, verify: bool = True) -> TensorReader:
    """An HF folder or a hybridrl megatron checkpoint, told apart by the metadata file."""
    path = Path(path)
    if (path / METADATA_FILE).is_file():
        return McoreCheckpointReader(path, verify=verify)
    return HFCheckpointReader(path)
