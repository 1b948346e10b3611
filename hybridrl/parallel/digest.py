"""`tensor_digest`: one digest of a tensor's dtype, shape and bits, computed on the tensor's own device.

Both sides of a weight sync use it: the resharder digests the shards it produced
(`hybridrl.reshard.checksums`) and the rollout engine the parameters vLLM holds
(`RolloutEngine.parameter_digests`), so it lives below both. Only torch is imported.
"""
from __future__ import annotations

import hashlib

import torch


def _wrapping(constant: int) -> int:
    """A 64-bit constant as the int64 torch computes with (two's complement)."""
    return constant - (1 << 64) if constant >= 1 << 63 else constant


_GOLDEN, _MIX1, _MIX2 = (_wrapping(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))
DIGEST_CHUNK = 1 << 20  # words per pass (the lane weights are built for one chunk, once per device)
_lane_weights: dict[torch.device, torch.Tensor] = {}
# Devices whose lane sums are a matrix-vector product (see `_lane_sums`); CUDA has no integer mv.
MATRIX_VECTOR_DEVICES = frozenset({"cpu"})


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    return (z >> bits) & ((1 << (64 - bits)) - 1)  # logical shift: torch's >> on int64 is arithmetic


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer in wrapping int64 arithmetic: a bijection that scatters nearby inputs."""
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


def _weights(device: torch.device) -> torch.Tensor:
    """Two lanes of odd pseudo-random weights for the positions of one chunk, built once per device."""
    if device not in _lane_weights:
        index = torch.arange(DIGEST_CHUNK, dtype=torch.int64, device=device)
        _lane_weights[device] = torch.stack([_mix64(index * _GOLDEN + lane) | 1 for lane in (1, 2)])
    return _lane_weights[device]


def _chunk_multipliers(chunks: int, device: torch.device) -> torch.Tensor:
    """`[chunks, 2]` odd multipliers, one per chunk and lane: far-apart positions' weights stay unrelated."""
    index = torch.arange(chunks, dtype=torch.int64, device=device).unsqueeze(1)
    return _mix64(index * _GOLDEN + torch.tensor([3, 4], dtype=torch.int64, device=device)) | 1


def _lane_sums(weights: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """`[2]` wrapping int64 sums of `words * weights[lane]`.

    On CPU a matrix-vector product reads each word once without a `[2, chunk]` product in memory (~3x
    faster); integer mv does not exist on CUDA, where the elementwise product is cheap. Both are exact
    integer arithmetic mod 2**64, so every device gives the same sums."""
    if words.device.type in MATRIX_VECTOR_DEVICES:
        return torch.mv(weights, words)
    return (words.unsqueeze(0) * weights).sum(dim=1)


def _int64_words(flat: torch.Tensor) -> torch.Tensor:
    """A flat tensor's bytes as int64 words (machine order, little-endian on every supported device),
    zero-padded to a whole word: a view where its bytes start on a word boundary and fill whole words,
    else one copy."""
    raw = flat.view(torch.uint8)
    if raw.numel() % 8 == 0 and raw.storage_offset() % 8 == 0:
        return raw.view(torch.int64)
    words = torch.zeros(-(-raw.numel() // 8), dtype=torch.int64, device=raw.device)
    words.view(torch.uint8)[:raw.numel()].copy_(raw)
    return words


def tensor_digest(tensor: torch.Tensor) -> str:
    """Hex digest of a tensor's dtype, shape and bits, computed where the tensor lives.

    The sync check compares these between the training side (the shard it sent) and the rollout
    side (`RolloutEngine.parameter_digests`), so a whole model is never copied to be compared, and
    on GPU no weight is copied to the host either: only two int64 sums and the header are.

    The tensor's bytes (contiguous, in element order, zero-padded to a multiple of 8) are read as
    little-endian signed 64-bit words; each word is multiplied by an odd pseudo-random weight of its
    offset in its chunk of `DIGEST_CHUNK` words (two independent lanes), and each chunk's lane sum by
    an odd pseudo-random multiplier of the chunk, all with int64 wrap-around. Integer sums do not
    depend on the reduction order, so every device and kernel gives the same digest. A change of any
    one element always changes both sums (it changes one word, a product of odd numbers is odd, so
    invertible mod 2**64); a permutation or several changes collide with probability ~2**-64 per lane;
    dtype and shape enter the header. Whole words halve the multiply-adds of 4-byte elements and need
    no widened copy: the CPU's integer matrix-vector product reads the tensor's memory in place.
    """
    flat = tensor.detach().contiguous().reshape(-1)
    words = _int64_words(flat)
    sums = torch.zeros(2, dtype=torch.int64, device=flat.device)
    chunks = -(-words.numel() // DIGEST_CHUNK)
    if chunks:
        weights = _weights(flat.device)
        multipliers = _chunk_multipliers(chunks, flat.device)
        for chunk in range(chunks):
            part = words[chunk * DIGEST_CHUNK:(chunk + 1) * DIGEST_CHUNK]
            sums += _lane_sums(weights[:, :part.numel()], part) * multipliers[chunk]
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{tensor.dtype}|{tuple(tensor.shape)}|".encode())
    digest.update(sums.cpu().numpy().tobytes())
    return digest.hexdigest()
