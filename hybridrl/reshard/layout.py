"""HF full tensors -> the exact tensors vLLM holds on one inference-TP rank (torch, no vLLM import).

The layout itself is `hybridrl.models.vllm_layout.vllm_targets` (derived from the family's weight
table); this module only materializes it from full HF tensors: the reference every sync is checked
against, and the payload of a full-state weight update.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from hybridrl.models.arch import ModelShape
from hybridrl.models.layout import TensorPlan, hf_tensor_shapes
from hybridrl.models.vllm_layout import shape_of, split_slot_name, stacked_params, vllm_targets


def vllm_shard_nbytes(
    hf_config: Mapping[str, Any] | ModelShape, infer_tp: int, rank: int = 0, dtype: torch.dtype = torch.float32
) -> int:
    """Bytes of one rank's vLLM parameters in this layout (vocab padding and KV replication included)."""
    element = torch.empty((), dtype=dtype).element_size()
    return element * sum(target.numel for target in vllm_targets(hf_config, infer_tp, rank).values())


def _materialize(target: TensorPlan, tensor_of: Callable[[str], torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """One vLLM tensor from full HF tensors: its segments concatenated, zero rows for padding (a copy)."""
    if target.axis is None:
        (seg,) = target.segments
        if seg.hf_name is None:
            raise ValueError(f"{target.name}: a whole copy (axis None) of no HF tensor (a padding segment)")
        return tensor_of(seg.hf_name).clone()
    parts = [None if s.hf_name is None else tensor_of(s.hf_name).narrow(target.axis, s.start, s.length)
             for s in target.segments]
    ref = next((p for p in parts if p is not None), like)
    for index, seg in enumerate(target.segments):
        if parts[index] is None:
            dims = list(target.shape)
            dims[target.axis] = seg.length
            parts[index] = ref.new_zeros(dims)
    return torch.cat(parts, dim=target.axis)


def hf_to_vllm_shards(
    hf_state_dict: Mapping[str, torch.Tensor],
    hf_config: Mapping[str, Any] | ModelShape,
    infer_tp: int,
    rank: int,
) -> dict[str, torch.Tensor]:
    """Exactly the tensors (names, shapes, values) vLLM holds on TP rank `rank` of `infer_tp`.

    `hf_state_dict` holds full HF-named tensors (as in `model.safetensors`); `hf_config` is the
    model's `config.json` as a dict (or a `ModelShape`). With tied embeddings `lm_head.weight` may be
    absent from the state dict and is absent from the result (vLLM keeps one shared parameter).
    Returned tensors never alias the inputs, so callers may write into them.
    """
    shape = shape_of(hf_config)
    targets = vllm_targets(shape, infer_tp, rank)

    def tensor_of(name: str) -> torch.Tensor:
        try:
            return hf_state_dict[name]
        except KeyError:
            raise KeyError(f"HF state dict lacks {name!r}, needed for the vLLM layout") from None

    needed = {seg.hf_name for t in targets.values() for seg in t.segments if seg.hf_name is not None}
    wrong = {name: (tuple(tensor_of(name).shape), dims) for name, dims in hf_tensor_shapes(shape).items()
             if name in needed and tuple(tensor_of(name).shape) != dims}
    if wrong:
        raise ValueError(f"HF tensors have unexpected shapes for this config (got, expected): {wrong}")
    like = tensor_of(shape.weights.embedding.hf_name)
    out = {}
    for param, names in stacked_params(targets).items():
        parts = [_materialize(targets[name], tensor_of, like) for name in names]
        # an MoE expert parameter: its experts' slots stacked on a new dim 0, as vLLM holds them
        out[param] = parts[0] if split_slot_name(names[0])[1] is None else torch.stack(parts)
    return out
