"""Per-tensor checksums of weight shards, to prove that what the rollout engine holds is what we sent.

The digest is sha256 over the tensor's dtype, shape and raw bytes (C order). sha256 changes for any
flipped bit, any permutation of rows (e.g. a wrong generation TP index or a q/k/v mix-up) and any
dtype/shape difference; a float sum would miss permutations and can miss a flipped low mantissa
bit. Cost: about 1-2 GB/s per core on CPU, plus a device->host copy of one tensor at a time on GPU.

The resharder computes these on the shards it produced; the caller computes them on the rollout
side's snapshot after the sync (`RolloutEngine.named_parameters_snapshot`) and compares with
`compare_checksums`; any mismatch stops training with the tensor names and ranks.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch


def tensor_checksum(tensor: torch.Tensor) -> str:
    """sha256 hex digest of (dtype, shape, bytes) of `tensor`."""
    data = tensor.detach()
    if data.device.type != "cpu":
        data = data.to("cpu")
    data = data.contiguous().reshape(-1).view(torch.uint8)
    digest = hashlib.sha256(f"{tensor.dtype}|{tuple(tensor.shape)}|".encode())
    digest.update(memoryview(data.numpy()))
    return digest.hexdigest()


def shard_checksums(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    return {name: tensor_checksum(tensor) for name, tensor in named_tensors}


@dataclass(frozen=True)
class ChecksumMismatch:
    name: str
    rank: int
    expected: str | None  # None: the tensor is missing on the training side
    actual: str | None  # None: the tensor is missing on the rollout side


class ShardChecksumError(RuntimeError):
    """The rollout engine's weights differ from the resharder's output."""

    def __init__(self, mismatches: list[ChecksumMismatch]):
        shown = "; ".join(
            f"rank {m.rank} {m.name}: " + (
                "missing on the rollout side" if m.actual is None
                else "not produced by the resharder" if m.expected is None
                else f"{m.expected[:12]} != {m.actual[:12]}"
            )
            for m in mismatches[:8]
        )
        more = f" (+{len(mismatches) - 8} more)" if len(mismatches) > 8 else ""
        super().__init__(f"weight sync checksum mismatch on {len(mismatches)} tensor(s): {shown}{more}")
        self.mismatches = mismatches


def compare_checksums(
    expected: Mapping[str, str], actual: Mapping[str, str], rank: int, *, ignore_extra: bool = False
) -> list[ChecksumMismatch]:
    """Every tensor whose digest differs or that one side lacks (`ignore_extra`: the rollout side may
    hold tensors the sync does not cover, e.g. buffers)."""
    out = []
    for name in sorted(expected.keys() | actual.keys()):
        want, got = expected.get(name), actual.get(name)
        if want is None and ignore_extra:
            continue
        if want != got:
            out.append(ChecksumMismatch(name, rank, want, got))
    return out


def verify_checksums(expected: Mapping[str, str], actual: Mapping[str, str], rank: int,
                     *, ignore_extra: bool = False) -> None:
    """Raise `ShardChecksumError` naming every differing tensor."""
    mismatches = compare_checksums(expected, actual, rank, ignore_extra=ignore_extra)
    if mismatches:
        raise ShardChecksumError(mismatches)
