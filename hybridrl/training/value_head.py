"""Value models (critic, reward model): the causal-LM backbone with a scalar head instead of the LM head.

We build the megatron GPTModel chunks with the bridge exactly as for the policy, then replace the
last chunk's vocab-parallel `output_layer` with `ValueHead`, a `[1, hidden]` projection. GPTModel
calls its output layer as `output_layer(hidden [s, b, h], weight=..., runtime_gather_output=...)`
and returns `[b, s, out]`, so the model's output becomes `[b, s, 1]` with no other change.

The head is replicated on every TP rank (one output feature cannot be split). Its input, the
final norm's output, is replicated over TP too, so each TP rank computes the same value and the
same head gradient: no TP all-reduce is needed for it, and the gradient flowing back into the
hidden states is already complete on every rank (unlike a vocab-parallel layer, whose input
gradient megatron sums over TP). Megatron counts non-TP-parallel parameters once (TP rank 0) in
the grad norm, so the norm is right as well. DP replicas start equal because the head is
initialized from a generator seeded identically on every rank.

Under sequence parallelism the final norm's output is not replicated: megatron leaves it split along
the sequence over TP (`[s/tp, b, h]`; only its vocab-parallel output layer, which the head replaces,
gathers it). The head then scores its own tokens and all-gathers the scalars over TP (`s/tp` x 1
values, not the hidden states), so every rank holds all `s` values as without SP. The gather's
backward hands each rank its own tokens' gradient (not a sum: every rank computes the same loss from
the same values), and the head's weight gradient, a sum over this rank's tokens only, is tagged
``sequence_parallel`` so that megatron's `finalize_model_grads` sums it over TP as it does the norms'.

Value models are built untied (`tie_word_embeddings=False`): a tied model on PP > 1 keeps a copy of
the embedding as the last stage's output weight and sums its gradient with the first stage's,
which must not happen once that weight is gone.

Weights: the backbone comes from an HF folder (causal-LM or sequence-classification: both name
the backbone `model.*`) or a hybridrl megatron checkpoint, read range by range through the
bridge's layout math; the head from a sequence-classification checkpoint's `score.weight`
(`num_labels` must be 1), or freshly initialized.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hybridrl.models.arch import value_model_hf_config
from hybridrl.models.bridge import ModelSource, chunk_tensors
from hybridrl.models.checkpoint import METADATA_FILE, McoreCheckpointReader, assemble

SCORE_WEIGHT = "score.weight"
HF_INDEX_FILE = "model.safetensors.index.json"
OUTPUT_LAYER = "output_layer.weight"


class ValueHead(nn.Module):
    """`hidden [s, b, h] -> [s, b, 1]`, called like megatron's output layer."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: str | torch.device = "cpu", *,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, hidden_size, dtype=dtype, device=device))
        self.sequence_parallel = sequence_parallel
        self.weight.sequence_parallel = sequence_parallel  # megatron's flag: sum its gradient over TP

    def reset_parameters(self, seed: int) -> None:
        """Same values on every rank: a private generator, the global RNG streams untouched."""
        gen = torch.Generator().manual_seed(seed)
        std = 1.0 / (self.weight.shape[1] + 1)
        with torch.no_grad():
            self.weight.copy_(torch.randn(self.weight.shape, generator=gen) * std)

    def forward(self, hidden_states: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        values = torch.matmul(hidden_states, self.weight.t())
        if self.sequence_parallel:  # [s/tp, b, 1] -> [s, b, 1]; backward: this rank's rows of the gradient
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            values = gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False)
        return values, None


def value_model_source(path: str | Path) -> ModelSource:
    """The bridge's ModelSource for a value model at `path`, untied (see the module docstring).

    A sequence-classification config is read as its causal-LM twin (same backbone).
    """
    path = Path(path)
    if (path / METADATA_FILE).is_file():
        config = ModelSource.from_path(path).hf_config
    else:
        config = json.loads((path / "config.json").read_text())
    source = ModelSource.from_config(value_model_hf_config(config))
    return dataclasses.replace(source, shape=dataclasses.replace(source.shape, tie_word_embeddings=False))


def attach_value_head(models: Sequence[Any], seed: int) -> ValueHead | None:
    """Put a freshly initialized `ValueHead` in place of the last chunk's output layer.

    Returns the head (None on ranks without the last stage).
    """
    head = None
    for model in models:
        model.share_embeddings_and_output_weights = False
        if model.post_process:
            ref = next(model.decoder.parameters())
            head = ValueHead(model.config.hidden_size, ref.dtype, ref.device,
                             sequence_parallel=bool(model.config.sequence_parallel))
            head.reset_parameters(seed)
            model.output_layer = head
    return head


class _HFTensors:
    """HF-named tensor ranges from a folder's safetensors files (any head: causal-LM or classifier)."""

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        index = folder / HF_INDEX_FILE
        if index.is_file():
            names = json.loads(index.read_text())["weight_map"]
            files = {name: folder / fname for name, fname in names.items()}
        else:
            single = folder / "model.safetensors"
            if not single.is_file():
                raise FileNotFoundError(f"no model.safetensors or {HF_INDEX_FILE} in {folder}")
            with safe_open(str(single), framework="pt") as handle:
                files = {name: single for name in handle.keys()}  # noqa: SIM118 - no __iter__
        self.files = files
        self._open = safe_open

    def has(self, name: str) -> bool:
        return name in self.files

    def read(self, hf_name: str, axis: int | None, start: int, stop: int) -> torch.Tensor:
        if hf_name not in self.files:
            raise KeyError(f"tensor {hf_name} not in the checkpoint")
        with self._open(str(self.files[hf_name]), framework="pt") as handle:
            view = handle.get_slice(hf_name)
            if axis is None:
                return view[:]
            return view[start:stop] if axis == 0 else view[:, start:stop]

    def close(self) -> None:
        pass


@torch.no_grad()
def load_value_model(models: Sequence[Any], path: str | Path) -> bool:
    """Load the backbone of every chunk from `path`, and the head from `score.weight` if present.

    Returns whether a head was loaded (False: the head keeps its fresh initialization).
    """
    path = Path(path)
    reader: Any = McoreCheckpointReader(path) if (path / METADATA_FILE).is_file() else _HFTensors(path)
    head_loaded = False
    try:
        for model in models:
            # this rank's tensors of every kind (its TP, EP and expert TP ranks'), named as its layer spec names them
            plans, tensors = chunk_tensors(model)
            for plan in plans:
                if plan.name == OUTPUT_LAYER:  # the value head, loaded from score.weight below
                    continue
                target = tensors[plan.name]
                target.copy_(assemble(reader, plan, target.dtype))
            if model.post_process and isinstance(reader, _HFTensors) and reader.has(SCORE_WEIGHT):
                score = reader.read(SCORE_WEIGHT, None, 0, 0)
                if score.shape != model.output_layer.weight.shape:
                    raise ValueError(f"{path}: {SCORE_WEIGHT} has shape {list(score.shape)}, a scalar value "
                                     f"head needs {list(model.output_layer.weight.shape)} (num_labels=1)")
                model.output_layer.weight.copy_(score)
                head_loaded = True
    finally:
        reader.close()
    return head_loaded
