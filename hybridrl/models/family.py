"""The vocabulary a model family's weight table is written in (pure data, no torch).

A family file under `hybridrl/models/families/` lists its logical weights once: for each, the HF
tensor(s) it is made of, the megatron parameter and the vLLM parameter it becomes, and how tensor
parallelism splits it (`Split`). `models/layout.py` derives the HF and megatron-shard plans from
that table and `models/vllm_layout.py` the vLLM-shard plans, so the three cannot disagree and a new
family is one new file.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Split(StrEnum):
    """How TP splits a logical weight; each side (megatron, vLLM) applies its own rule per kind."""

    REPLICATED = "replicated"  # a whole copy on every TP rank (norms)
    ROW = "row"  # row-parallel linear: split on dim 1
    COLUMN = "column"  # column-parallel linear: split on dim 0
    # Several HF tensors fused into one column-parallel parameter, rank r holding
    # [part r of the first; part r of the second; ...] (gate_up / linear_fc1).
    FUSED_COLUMN = "fused_column"
    # q, k, v fused. Megatron orders rows per query group [q heads of g; k_g; v_g] and splits that
    # whole order in TP chunks; vLLM gives rank r [q heads of r; k heads of r; v heads of r] and, when
    # TP > KV heads, replicates each KV head on TP / KV consecutive ranks.
    QKV = "qkv"
    # Vocabulary rows padded with zeros and split on dim 0: megatron pads to a multiple of
    # 128 * TP, vLLM to a multiple of 64.
    VOCAB = "vocab"


@dataclass(frozen=True)
class HFTensor:
    """One HF tensor: its name (`{i}` = the global layer index, `{e}` = the global expert index of
    an MoE expert's weight) and its dims by name (`ModelShape.dim`)."""

    name: str
    dims: tuple[str, ...]

    def at(self, layer: int | None, expert: int | None = None) -> str:
        if layer is None:
            return self.name
        return self.name.format(i=layer) if expert is None else self.name.format(i=layer, e=expert)


class MLPKind(StrEnum):
    """Which kind of MLP a layer of an MoE model has (`ModelShape.layer_is_moe`); a weight marked
    with one exists only in the layers of that kind."""

    DENSE = "dense"
    MOE = "moe"


@dataclass(frozen=True)
class WeightSpec:
    """One logical weight: HF tensors → one megatron parameter and one vLLM parameter.

    `megatron` uses the local layer spec's names (`{i}` = the layer's index inside its chunk);
    `vllm` uses vLLM's parameter names (`{i}` = the global layer index). `when` names a boolean
    `ModelShape` switch (e.g. "qkv_bias") without which the weight does not exist; `mlp` limits it
    to the layers with that kind of MLP (a dense MLP inside an MoE model, the router).

    `expert=True`: one such weight per routed expert. HF names carry `{e}`, the global expert
    index; the megatron name carries `{e}`, the index among this expert-parallel rank's local
    experts (global = ep_rank * experts_per_rank + local); TP splits each expert like `split` says
    (the expert tensor-parallel size is TP). vLLM stacks all experts of a layer in one parameter
    (`vllm` names it), each expert one slot split by the same `split` (`models.vllm_layout`).
    """

    hf: tuple[HFTensor, ...]
    megatron: str
    vllm: str
    split: Split
    when: str | None = None
    mlp: MLPKind | None = None
    expert: bool = False

    @property
    def hf_name(self) -> str:
        """The HF tensor of an unfused weight outside the layers (embedding, final norm, LM head)."""
        (tensor,) = self.hf
        return tensor.name

    def exists(self, shape: object, layer: int | None = None) -> bool:
        """Whether this model has the weight (in decoder layer `layer`, for a layer weight)."""
        if self.when is not None and not getattr(shape, self.when):
            return False
        if self.mlp is None or layer is None:
            return True
        is_moe = shape.layer_is_moe(layer)  # type: ignore[attr-defined]
        return is_moe == (self.mlp is MLPKind.MOE)


@dataclass(frozen=True)
class DecoderWeights:
    """A decoder-only model's weight table: embedding, one layer's weights, final norm, LM head.

    With tied embeddings the LM head does not exist on the HF and vLLM side; megatron keeps a
    synchronized copy of the embedding as its output layer on the last pipeline stage.
    """

    embedding: WeightSpec
    layer: tuple[WeightSpec, ...]
    final_norm: WeightSpec
    lm_head: WeightSpec


@dataclass(frozen=True)
class ArchFamily:
    """An HF architecture: its switches, the HF class defaults used when config.json omits a key,
    and its weight table.

    The defaults are the transformers config class's own (`MixtralConfig().rms_norm_eps` is 1e-5 where
    Llama's is 1e-6): transformers and vLLM fill an omitted key with them, so megatron must too
    (tests/models/test_arch.py checks each against transformers)."""

    architecture: str
    model_type: str
    qkv_bias: bool
    qk_norm: bool
    default_max_positions: int
    weights: DecoderWeights
    # None: hidden_size // num_attention_heads (the HF default for all but Qwen3).
    default_head_dim: int | None = None
    default_tie_word_embeddings: bool = False
    default_rms_norm_eps: float = 1e-6
    default_rope_theta: float = 10000.0
    # None: num_attention_heads (as an explicit null is read by every family).
    default_num_kv_heads: int | None = None
    # The attention window of a Mistral-style family when config.json has no `sliding_window` key.
    default_sliding_window: int | None = None
    # Mixture of experts: `ModelShape` reads the expert count, top-k and MoE layers from config.json.
    moe: bool = False
