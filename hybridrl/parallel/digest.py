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
DIGEST_CHUNK = 1 << 20  # elements per pass: bounds the digest's scratch memory to ~3 x 8 MiB
_WORD_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_lane_weights: dict[torch.device, torch.Tensor] = {}


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


def tensor_digest(tensor: torch.Tensor) -> str:
    """Hex digest of a tensor's dtype, shape and bits, computed where the tensor lives.

    The sync check compares these between the training side (the shard it sent) and the rollout
    side (`RolloutEngine.parameter_digests`), so a whole model is never copied to be compared, and
    on GPU no weight is copied to the host either: only two int64 sums and the header are.

    The bits of each element, read as a signed integer, are multiplied by an odd pseudo-random
    weight of its position (two independent lanes) and summed with int64 wrap-around. Integer
    sums do not depend on the reduction order, so every device and kernel gives the same digest.
    A change of any one element always changes both sums (an odd weight is invertible mod 2**64
    and the change is below 2**33); a permutation or several changes collide with probability
    ~2**-64 per lane; dtype and shape enter the header.
    """
    flat = tensor.detach().contiguous().reshape(-1)
    words = flat.view(_WORD_DTYPES[flat.element_size()])
    weights = _weights(flat.device)
    sums = torch.zeros(2, dtype=torch.int64, device=flat.device)
    chunks = -(-words.numel() // DIGEST_CHUNK)
    if chunks:
        # a different even salt per chunk and lane keeps far-apart positions' weights unrelated
        salts = (_mix64(torch.arange(chunks, dtype=torch.int64, device=flat.device) * _GOLDEN + 3)
                 & ~1).unsqueeze(1) ^ torch.tensor([0, 2], dtype=torch.int64, device=flat.device)
        for chunk in range(chunks):
            part = words[chunk * DIGEST_CHUNK:(chunk + 1) * DIGEST_CHUNK].to(torch.int64)
            lane_weights = weights[:, :part.numel()] ^ salts[chunk].unsqueeze(1)
            sums += (part.unsqueeze(0) * lane_weights).sum(dim=1)
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{tensor.dtype}|{tuple(tensor.shape)}|".encode())
    digest.update(sums.cpu().numpy().tobytes())
    return digest.hexdigest()
