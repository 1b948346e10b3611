"""Per-tensor checksums of weight shards, to prove that what the rollout engine holds is what we sent.

One digest for both sides: `hybridrl.parallel.digest.tensor_digest` (two 64-bit lanes of position-weighted
integer sums of the tensor's bits, computed on the tensor's own device, plus a blake2b header of
dtype and shape), which `RolloutEngine.parameter_digests` computes on the rollout side, so the
comparison never copies a model, and on GPU never copies a weight to the host. It changes for any
single changed element (always), any permutation of rows (a wrong generation TP index, a q/k/v
mix-up) and any dtype or shape difference; a float sum would miss permutations and can miss a
flipped low mantissa bit. Cost per GiB: `bench/reshard.py` (CPU) and `bench/gpu_check.py` (CUDA).

The resharder records these for the shards it produced (`SyncReport.checksums`); after delivery the
caller compares them with the rollout side's (`verify_checksums`); any mismatch raises
`ShardChecksumError` naming the tensors and the rank, which stops training.

The digest covers the dtype, so both sides must digest the same dtype: with a rollout dtype other
than the training one (bf16 vLLM from fp32 training), the resharder produces, and digests, its
shards already cast to the rollout dtype (`ReshardConfig.output_dtype`, which the hybrid worker sets).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from hybridrl.parallel.digest import tensor_digest

tensor_checksum = tensor_digest


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
