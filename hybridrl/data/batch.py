"""`Batch`: the container that carries sequences between the controller and the workers.

A batch is three things that travel together:

* ``tensors``: named torch tensors whose first dimension is the sequence (row) axis,
* ``non_tensors``: per-row metadata that is not a tensor (``uid``, group index, data source),
  stored as numpy arrays with the same first dimension, so every row operation keeps them aligned,
* ``meta``: batch-level information (temperature, step number, ...), not indexed by row.

Transport. Ray serializes torch tensors by copying them into a pickle byte stream (~80 ms put +
~50 ms get per 64 MB here), while numpy arrays go out-of-band into the object store and come back
zero-copy. So a `Batch` pickles its tensors as numpy arrays (see `__reduce__`) and rebuilds them
with `torch.from_numpy` on arrival: the only copy is the one into the object store.

Read-only arrivals. Zero-copy means the tensors of a batch fetched with `ray.get` (or received
as an actor argument) alias the object store's shared memory, which Ray hands out read-only.
Torch cannot mark a tensor read-only, so an in-place write would not fail: it would silently
change the shared object, which the TP/PP peers of the same data-parallel rank are reading too.
Such tensors are listed in `Batch.shared_keys`; call `make_writable()` (copies only those) before
writing in place. Replacing a column (``batch["x"] = new``) is always fine.
"""
from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hybridrl.parallel.device import loaded_strict_device

# numpy has no bfloat16 / float8: such tensors travel as same-width integers and are viewed back.
_NUMPY_SUBSTITUTES: dict[torch.dtype, torch.dtype] = {
    torch.bfloat16: torch.int16,
}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _NUMPY_SUBSTITUTES[getattr(torch, _name)] = torch.uint8


def _as_row_array(name: str, value: Any) -> np.ndarray:
    """Per-row metadata as a numpy array whose first dim is the row axis.

    Lists become 1-D object arrays even when their items are lists or tuples (numpy would
    otherwise build a 2-D array or fail on ragged items).
    """
    if isinstance(value, np.ndarray):
        if value.ndim == 0:
            raise ValueError(f"non-tensor {name!r} is a 0-d array; per-row metadata needs a row axis")
        return value
    if isinstance(value, torch.Tensor):
        raise TypeError(f"non-tensor {name!r} is a torch.Tensor: put it in `tensors` instead")
    if isinstance(value, (list, tuple)):
        array = np.empty(len(value), dtype=object)
        for i, item in enumerate(value):
            array[i] = item
        return array
    raise TypeError(f"non-tensor {name!r} must be a numpy array, list or tuple, got {type(value).__name__}")


def _tensor_to_numpy(name: str, tensor: torch.Tensor) -> tuple[np.ndarray, str]:
    """A numpy view of a CPU copy of `tensor` plus the torch dtype name to restore on arrival."""
    if tensor.ndim == 0:
        raise ValueError(f"tensor {name!r} is 0-d; batch tensors need a row axis")
    dtype_name = str(tensor.dtype).removeprefix("torch.")
    tensor = tensor.detach().cpu()  # free for CPU tensors
    # Out-of-band pickling needs a contiguous buffer; contiguous() is free when it already is.
    tensor = tensor.contiguous()
    substitute = _NUMPY_SUBSTITUTES.get(tensor.dtype)
    if substitute is not None:
        tensor = tensor.view(substitute)
    return tensor.numpy(), dtype_name


def _tensor_from_numpy(array: np.ndarray, dtype_name: str) -> torch.Tensor:
    with warnings.catch_warnings():
        # torch warns that a non-writable array gives a tensor it cannot protect; we track that
        # ourselves in `shared_keys`.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        tensor = torch.from_numpy(array)
    dtype = getattr(torch, dtype_name)
    if tensor.dtype != dtype:
        tensor = tensor.view(dtype)
    return tensor


@dataclass(eq=False)  # element-wise tensor equality has no single truth value
class Batch:
    """Row-aligned tensors + per-row metadata + batch-level `meta`. See the module docstring."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    non_tensors: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    # Tensor keys whose storage aliases read-only shared memory (filled on arrival, see docstring).
    shared_keys: frozenset[str] = field(default_factory=frozenset, compare=False)

    def __post_init__(self) -> None:
        self.tensors = dict(self.tensors)
        self.non_tensors = {k: _as_row_array(k, v) for k, v in self.non_tensors.items()}
        self.meta = dict(self.meta)
        self.shared_keys = frozenset(self.shared_keys)
        overlap = self.tensors.keys() & self.non_tensors.keys()
        if overlap:
            raise ValueError(f"keys {sorted(overlap)} are both tensors and non-tensors")
        for name, tensor in self.tensors.items():
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
            if tensor.ndim == 0:
                raise ValueError(f"tensor {name!r} is 0-d; batch tensors need a row axis")
        rows = self._rows_by_key()
        if not rows:
            raise ValueError("a Batch needs at least one tensor or non-tensor column")
        if len(set(rows.values())) != 1:
            raise ValueError(f"columns disagree on the number of rows: {rows}")

    def _rows_by_key(self) -> dict[str, int]:
        rows = {k: int(t.shape[0]) for k, t in self.tensors.items()}
        rows.update({k: int(a.shape[0]) for k, a in self.non_tensors.items()})
        return rows

    # ----------------------------------------------------------------------------- access
    def __len__(self) -> int:
        first = next(iter(self.tensors.values()), None)
        if first is not None:
            return int(first.shape[0])
        return int(next(iter(self.non_tensors.values())).shape[0])

    def keys(self) -> list[str]:
        return [*self.tensors, *self.non_tensors]

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.non_tensors

    def __getitem__(self, key: str) -> torch.Tensor | np.ndarray:
        if key in self.tensors:
            return self.tensors[key]
        if key in self.non_tensors:
            return self.non_tensors[key]
        raise KeyError(f"{key!r} is not a column of this batch; columns: {self.keys()}")

    def tensor(self, key: str) -> torch.Tensor:
        """The tensor column `key` (`batch[key]` typed; an error naming it when it holds per-row objects instead)."""
        value = self[key]
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"column {key!r} is a per-row array ({value.dtype}), not a tensor")
        return value

    def column(self, key: str) -> np.ndarray:
        """The per-row array column `key` (`batch[key]` typed; an error naming it when it is a tensor instead)."""
        value = self[key]
        if not isinstance(value, np.ndarray):
            raise TypeError(f"column {key!r} is a tensor, not a per-row array")
        return value

    def __setitem__(self, key: str, value: torch.Tensor | np.ndarray | Sequence[Any]) -> None:
        """Add or replace a column; its row count must match the batch."""
        rows = len(value)
        if rows != len(self):
            raise ValueError(f"column {key!r} has {rows} rows, the batch has {len(self)}")
        if isinstance(value, torch.Tensor):
            self.non_tensors.pop(key, None)
            self.tensors[key] = value
            self.shared_keys = self.shared_keys - {key}
        else:
            self.tensors.pop(key, None)
            self.shared_keys = self.shared_keys - {key}
            self.non_tensors[key] = _as_row_array(key, value)

    def _with_columns(
        self, tensors: dict[str, torch.Tensor], non_tensors: dict[str, np.ndarray], shared: Iterable[str]
    ) -> Batch:
        return Batch(tensors, non_tensors, dict(self.meta), frozenset(shared) & tensors.keys())

    # ------------------------------------------------------------------------ row operations
    def slice(self, start: int, stop: int) -> Batch:
        """Rows [start, stop) as views (no copy)."""
        return self._with_columns(
            {k: t[start:stop] for k, t in self.tensors.items()},
            {k: a[start:stop] for k, a in self.non_tensors.items()},
            self.shared_keys,
        )

    def index(self, indices: Sequence[int] | np.ndarray | torch.Tensor) -> Batch:
        """Rows at `indices` in that order (a copy; repeats allowed)."""
        idx = torch.as_tensor(np.asarray(indices, dtype=np.int64))
        if idx.ndim != 1:
            raise ValueError(f"indices must be 1-D, got shape {tuple(idx.shape)}")
        n = len(self)
        if idx.numel() and (int(idx.min()) < -n or int(idx.max()) >= n):
            raise IndexError(f"indices out of range for a batch of {n} rows")
        idx = torch.where(idx < 0, idx + n, idx)
        idx_np = idx.numpy()
        # Fresh tensors: nothing aliases shared memory afterwards.
        return self._with_columns(
            {k: t.index_select(0, idx.to(t.device)) for k, t in self.tensors.items()},
            {k: a[idx_np] for k, a in self.non_tensors.items()},
            (),
        )

    def reorder(self, permutation: Sequence[int] | np.ndarray | torch.Tensor) -> Batch:
        """Rows permuted: row i of the result is row permutation[i]. Must be a permutation."""
        perm = np.asarray(permutation, dtype=np.int64)
        if perm.shape != (len(self),) or not np.array_equal(np.sort(perm), np.arange(len(self))):
            raise ValueError(f"reorder needs a permutation of range({len(self)}), got {perm.tolist()}")
        return self.index(perm)

    def split(self, num_chunks: int) -> list[Batch]:
        """`num_chunks` equal consecutive chunks (views). The row count must divide evenly."""
        if num_chunks <= 0:
            raise ValueError(f"num_chunks must be positive, got {num_chunks}")
        n = len(self)
        if n % num_chunks:
            raise ValueError(
                f"cannot split a batch of {n} rows into {num_chunks} equal chunks "
                f"({n} % {num_chunks} = {n % num_chunks}); pad with pad_to_multiple({num_chunks}) "
                f"or use split_sizes()"
            )
        size = n // num_chunks
        return self.split_sizes([size] * num_chunks)

    def split_sizes(self, sizes: Sequence[int]) -> list[Batch]:
        """Consecutive chunks with the given row counts (views); the sizes must sum to len(self)."""
        if any(s < 0 for s in sizes):
            raise ValueError(f"chunk sizes must be non-negative, got {list(sizes)}")
        if sum(sizes) != len(self):
            raise ValueError(f"chunk sizes {list(sizes)} sum to {sum(sizes)}, the batch has {len(self)} rows")
        chunks, start = [], 0
        for size in sizes:
            chunks.append(self.slice(start, start + size))
            start += size
        return chunks

    @classmethod
    def concat(cls, batches: Sequence[Batch]) -> Batch:
        """Rows of all batches in order. Columns must match; `meta` is the first batch's."""
        if not batches:
            raise ValueError("concat needs at least one batch")
        first = batches[0]
        for i, other in enumerate(batches[1:], start=1):
            same_columns = (
                other.tensors.keys() == first.tensors.keys()
                and other.non_tensors.keys() == first.non_tensors.keys()
            )
            if not same_columns:
                raise ValueError(
                    f"batch {i} has columns {sorted(other.keys())}, batch 0 has {sorted(first.keys())}"
                )
        if len(batches) == 1:
            return first._with_columns(dict(first.tensors), dict(first.non_tensors), first.shared_keys)
        tensors = {k: torch.cat([b.tensors[k] for b in batches], dim=0) for k in first.tensors}
        non_tensors = {
            k: np.concatenate([b.non_tensors[k] for b in batches], axis=0) for k in first.non_tensors
        }
        return cls(tensors, non_tensors, dict(first.meta))

    def pad_to_multiple(self, multiple: int) -> tuple[Batch, int]:
        """Pad to a multiple of `multiple` rows by repeating rows from the start.

        Repeating real rows (rather than zeros) keeps the padding valid input for any model
        (e.g. no all-masked sequences). Returns (batch, pad_count); `unpad(pad_count)` undoes it.
        """
        if multiple <= 0:
            raise ValueError(f"multiple must be positive, got {multiple}")
        n = len(self)
        pad = (-n) % multiple
        if pad == 0:
            return self, 0
        if n == 0:
            raise ValueError("cannot pad an empty batch by repeating rows")
        return self.index(np.arange(n + pad) % n), pad

    def unpad(self, pad_count: int) -> Batch:
        """Drop the last `pad_count` rows (added by pad_to_multiple)."""
        if not 0 <= pad_count <= len(self):
            raise ValueError(f"pad_count {pad_count} is outside [0, {len(self)}]")
        return self.slice(0, len(self) - pad_count) if pad_count else self

    def select(self, keys: Iterable[str]) -> Batch:
        """Only the named columns (tensors or non-tensors); `meta` is kept."""
        keys = list(keys)
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"columns {missing} not in this batch; columns: {self.keys()}")
        return self._with_columns(
            {k: self.tensors[k] for k in keys if k in self.tensors},
            {k: self.non_tensors[k] for k in keys if k in self.non_tensors},
            self.shared_keys,
        )

    # ----------------------------------------------------------------------------- transport
    def make_writable(self, keys: Iterable[str] | None = None) -> Batch:
        """Copy (in this batch) the tensors that alias read-only shared memory; returns self."""
        targets = self.shared_keys if keys is None else self.shared_keys & set(keys)
        for key in targets:
            self.tensors[key] = self.tensors[key].clone()
        self.shared_keys = self.shared_keys - targets
        return self

    def to_transport(self) -> dict[str, Any]:
        """A picklable dict of numpy arrays (zero-copy views of CPU tensors) + metadata.

        GPU tensors are copied to CPU; autograd history is dropped.
        """
        arrays, dtypes = {}, {}
        for key, tensor in self.tensors.items():
            arrays[key], dtypes[key] = _tensor_to_numpy(key, tensor)
        return {"arrays": arrays, "dtypes": dtypes, "non_tensors": self.non_tensors, "meta": self.meta}

    @classmethod
    def from_transport(cls, payload: Mapping[str, Any]) -> Batch:
        """Rebuild from `to_transport()` output without copying; read-only arrays -> shared_keys."""
        arrays: dict[str, np.ndarray] = payload["arrays"]
        tensors = {k: _tensor_from_numpy(a, payload["dtypes"][k]) for k, a in arrays.items()}
        # A batch that crossed a process boundary is host memory, on GPU clusters too: strict-device
        # mode (the CPU test suite's guard for the GPU path) must see it that way.
        strict = loaded_strict_device()
        if strict is not None:
            strict.mark_host(tensors)
        shared = frozenset(k for k, a in arrays.items() if not a.flags.writeable)
        return cls(tensors, dict(payload["non_tensors"]), dict(payload["meta"]), shared)

    def __reduce__(self):
        # Every pickling path (ray.put, actor arguments and results, multiprocessing) sends numpy.
        return (Batch.from_transport, (self.to_transport(),))

    def __repr__(self) -> str:
        cols = [
            f"{k}: {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for k, t in self.tensors.items()
        ]
        cols += [f"{k}: {a.dtype}" for k, a in self.non_tensors.items()]
        return f"Batch(rows={len(self)}, {', '.join(cols)}, meta_keys={sorted(self.meta)})"
