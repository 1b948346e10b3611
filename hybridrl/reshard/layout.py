"""HF full tensors -> the exact tensors vLLM holds on one inference-TP rank (pure, no vLLM import).

The resharder must produce, on each rollout rank, byte-for-byte what vLLM's own loader would put in
that rank's parameters; this module is the single description of that target. It is checked against
real vLLM (parameters captured before the CPU weight repacking) in `tests/test_reshard_layout.py`.

vLLM 0.32 layouts (Llama, Mistral, Qwen2, Qwen3; `vllm/model_executor/layers/linear.py` and
`vocab_parallel_embedding.py`):

- `model.embed_tokens.weight`, `lm_head.weight`: vocab padded to a multiple of 64
  (`DEFAULT_VOCAB_PADDING_SIZE`, independent of TP) with zero rows, then split evenly on dim 0.
  With `tie_word_embeddings` vLLM has one parameter, listed as `model.embed_tokens.weight` only.
- `...self_attn.qkv_proj.{weight,bias}`: rank r holds `[q heads of r; k heads of r; v heads of r]`.
  When infer_tp > num KV heads each rank holds exactly one KV head, replicated on
  `infer_tp // num_kv_heads` consecutive ranks: KV head index `r // (infer_tp // num_kv_heads)`.
- `...self_attn.o_proj.weight`, `...mlp.down_proj.weight` (row-parallel): split on dim 1.
- `...mlp.gate_up_proj.weight`: rank r holds `[gate rows of r; up rows of r]`.
- norms (`input_layernorm`, `post_attention_layernorm`, `model.norm`, Qwen3's per-head
  `q_norm`/`k_norm`): replicated on every rank.

Only torch is imported (and the torch-free `ModelShape`), so trainer-side code can use this without
loading vLLM.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from hybridrl.models.arch import ModelShape

# vLLM's `DEFAULT_VOCAB_PADDING_SIZE` (vocab_parallel_embedding.py): the padded vocab must also
# divide by infer_tp, which holds for every power-of-two TP up to 64.
VLLM_VOCAB_PADDING = 64

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"

TensorSource = Callable[[str], torch.Tensor]


def _shape_of(hf_config: Mapping[str, Any] | ModelShape) -> ModelShape:
    return hf_config if isinstance(hf_config, ModelShape) else ModelShape.from_hf_config(hf_config)


def vllm_padded_vocab(vocab_size: int) -> int:
    return -(-vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING


def check_infer_tp(shape: ModelShape, infer_tp: int, rank: int | None = None) -> None:
    """Raise ValueError when vLLM could not shard this model `infer_tp` ways."""
    problems = []
    if infer_tp < 1:
        problems.append(f"infer_tp={infer_tp} must be >= 1")
    else:
        if shape.num_attention_heads % infer_tp:
            problems.append(f"num_attention_heads={shape.num_attention_heads} is not divisible by infer_tp={infer_tp}")
        kv = shape.num_kv_heads
        if (kv >= infer_tp and kv % infer_tp) or (kv < infer_tp and infer_tp % kv):
            problems.append(f"num_key_value_heads={kv} and infer_tp={infer_tp}: one must divide the other")
        if shape.ffn_hidden_size % infer_tp:
            problems.append(f"intermediate_size={shape.ffn_hidden_size} is not divisible by infer_tp={infer_tp}")
        if vllm_padded_vocab(shape.vocab_size) % infer_tp:
            padded = vllm_padded_vocab(shape.vocab_size)
            problems.append(f"padded vocab {padded} is not divisible by infer_tp={infer_tp}")
        if rank is not None and not 0 <= rank < infer_tp:
            problems.append(f"rank={rank} is outside [0, {infer_tp})")
    if problems:
        raise ValueError("; ".join(problems))


def _kv_head_range(shape: ModelShape, infer_tp: int, rank: int) -> tuple[int, int]:
    """[first, stop) KV heads rank `rank` holds."""
    kv = shape.num_kv_heads
    if infer_tp <= kv:
        per_rank = kv // infer_tp
        return rank * per_rank, (rank + 1) * per_rank
    replicas = infer_tp // kv
    head = rank // replicas
    return head, head + 1


def layer_param_names(shape: ModelShape, layer: int) -> list[str]:
    prefix = f"model.layers.{layer}"
    names = [f"{prefix}.self_attn.qkv_proj.weight"]
    if shape.qkv_bias:
        names.append(f"{prefix}.self_attn.qkv_proj.bias")
    names.append(f"{prefix}.self_attn.o_proj.weight")
    if shape.qk_norm:
        names += [f"{prefix}.self_attn.q_norm.weight", f"{prefix}.self_attn.k_norm.weight"]
    names += [
        f"{prefix}.mlp.gate_up_proj.weight",
        f"{prefix}.mlp.down_proj.weight",
        f"{prefix}.input_layernorm.weight",
        f"{prefix}.post_attention_layernorm.weight",
    ]
    return names


def vllm_param_shapes(
    hf_config: Mapping[str, Any] | ModelShape, infer_tp: int, rank: int = 0
) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter vLLM holds on `rank` (same for every rank of a TP group)."""
    shape = _shape_of(hf_config)
    check_infer_tp(shape, infer_tp, rank)
    hidden, head_dim = shape.hidden_size, shape.head_dim
    q_rows = shape.num_attention_heads // infer_tp * head_dim
    kv_first, kv_stop = _kv_head_range(shape, infer_tp, rank)
    kv_rows = (kv_stop - kv_first) * head_dim
    ffn = shape.ffn_hidden_size // infer_tp
    vocab_rows = vllm_padded_vocab(shape.vocab_size) // infer_tp

    shapes: dict[str, tuple[int, ...]] = {EMBED: (vocab_rows, hidden)}
    for layer in range(shape.num_layers):
        prefix = f"model.layers.{layer}"
        shapes[f"{prefix}.self_attn.qkv_proj.weight"] = (q_rows + 2 * kv_rows, hidden)
        if shape.qkv_bias:
            shapes[f"{prefix}.self_attn.qkv_proj.bias"] = (q_rows + 2 * kv_rows,)
        shapes[f"{prefix}.self_attn.o_proj.weight"] = (hidden, q_rows)
        if shape.qk_norm:
            shapes[f"{prefix}.self_attn.q_norm.weight"] = (head_dim,)
            shapes[f"{prefix}.self_attn.k_norm.weight"] = (head_dim,)
        shapes[f"{prefix}.mlp.gate_up_proj.weight"] = (2 * ffn, hidden)
        shapes[f"{prefix}.mlp.down_proj.weight"] = (hidden, ffn)
        shapes[f"{prefix}.input_layernorm.weight"] = (hidden,)
        shapes[f"{prefix}.post_attention_layernorm.weight"] = (hidden,)
    shapes[FINAL_NORM] = (hidden,)
    if not shape.tie_word_embeddings:
        shapes[LM_HEAD] = (vocab_rows, hidden)
    return shapes


def vllm_shard_nbytes(
    hf_config: Mapping[str, Any] | ModelShape, infer_tp: int, rank: int = 0, dtype: torch.dtype = torch.float32
) -> int:
    """Bytes of one rank's vLLM parameters in this layout (vocab padding and KV replication included)."""
    element = torch.empty((), dtype=dtype).element_size()
    total = 0
    for dims in vllm_param_shapes(hf_config, infer_tp, rank).values():
        count = 1
        for dim in dims:
            count *= dim
        total += count
    return total * element


def _vocab_shard(full: torch.Tensor, vocab_size: int, infer_tp: int, rank: int) -> torch.Tensor:
    if full.shape[0] != vocab_size:
        raise ValueError(f"vocab tensor has {full.shape[0]} rows, config says vocab_size={vocab_size}")
    rows = vllm_padded_vocab(vocab_size) // infer_tp
    start, stop = rank * rows, (rank + 1) * rows
    shard = full.new_zeros((rows, *full.shape[1:]))
    real_stop = min(stop, vocab_size)
    if real_stop > start:
        shard[: real_stop - start] = full[start:real_stop]
    return shard


def _rows(tensor: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    return tensor.narrow(0, start, stop - start)


def _cols(tensor: torch.Tensor, index: int, parts: int) -> torch.Tensor:
    width = tensor.shape[1] // parts
    return tensor.narrow(1, index * width, width)


def layer_to_vllm_shards(
    shape: ModelShape, layer: int, hf_tensor: TensorSource, infer_tp: int, rank: int
) -> dict[str, torch.Tensor]:
    """vLLM tensors of decoder layer `layer` on `rank`; `hf_tensor(name)` returns full HF tensors.

    Works one layer at a time so a streaming caller only needs that layer's HF tensors.
    """
    check_infer_tp(shape, infer_tp, rank)
    hf = f"model.layers.{layer}"
    head_dim = shape.head_dim
    q_per_rank = shape.num_attention_heads // infer_tp * head_dim
    kv_first, kv_stop = _kv_head_range(shape, infer_tp, rank)
    kv_start, kv_end = kv_first * head_dim, kv_stop * head_dim
    q_start, q_end = rank * q_per_rank, (rank + 1) * q_per_rank
    ffn = shape.ffn_hidden_size // infer_tp

    out: dict[str, torch.Tensor] = {}
    for suffix in ("weight", "bias") if shape.qkv_bias else ("weight",):
        out[f"{hf}.self_attn.qkv_proj.{suffix}"] = torch.cat([
            _rows(hf_tensor(f"{hf}.self_attn.q_proj.{suffix}"), q_start, q_end),
            _rows(hf_tensor(f"{hf}.self_attn.k_proj.{suffix}"), kv_start, kv_end),
            _rows(hf_tensor(f"{hf}.self_attn.v_proj.{suffix}"), kv_start, kv_end),
        ])
    out[f"{hf}.self_attn.o_proj.weight"] = _cols(hf_tensor(f"{hf}.self_attn.o_proj.weight"), rank, infer_tp).clone()
    if shape.qk_norm:
        for norm in ("q_norm", "k_norm"):
            out[f"{hf}.self_attn.{norm}.weight"] = hf_tensor(f"{hf}.self_attn.{norm}.weight").clone()
    out[f"{hf}.mlp.gate_up_proj.weight"] = torch.cat([
        _rows(hf_tensor(f"{hf}.mlp.gate_proj.weight"), rank * ffn, (rank + 1) * ffn),
        _rows(hf_tensor(f"{hf}.mlp.up_proj.weight"), rank * ffn, (rank + 1) * ffn),
    ])
    out[f"{hf}.mlp.down_proj.weight"] = _cols(hf_tensor(f"{hf}.mlp.down_proj.weight"), rank, infer_tp).clone()
    for norm in ("input_layernorm", "post_attention_layernorm"):
        out[f"{hf}.{norm}.weight"] = hf_tensor(f"{hf}.{norm}.weight").clone()
    return out


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
    shape = _shape_of(hf_config)
    check_infer_tp(shape, infer_tp, rank)

    def hf_tensor(name: str) -> torch.Tensor:
        try:
            return hf_state_dict[name]
        except KeyError:
            raise KeyError(f"HF state dict lacks {name!r}, needed for the vLLM layout") from None

    out = {EMBED: _vocab_shard(hf_tensor(EMBED), shape.vocab_size, infer_tp, rank)}
    for layer in range(shape.num_layers):
        out.update(layer_to_vllm_shards(shape, layer, hf_tensor, infer_tp, rank))
    out[FINAL_NORM] = hf_tensor(FINAL_NORM).clone()
    if not shape.tie_word_embeddings:
        out[LM_HEAD] = _vocab_shard(hf_tensor(LM_HEAD), shape.vocab_size, infer_tp, rank)

    expected = vllm_param_shapes(shape, infer_tp, rank)
    got = {name: tuple(t.shape) for name, t in out.items()}
    if got != expected:
        names = sorted(expected.keys() | got.keys())
        wrong = {n: (got.get(n), expected.get(n)) for n in names if got.get(n) != expected.get(n)}
        raise ValueError(f"HF tensors have unexpected shapes for this config (got, expected): {wrong}")
    return out
