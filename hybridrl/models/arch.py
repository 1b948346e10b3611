"""Architecture registry: what an HF `config.json` means for a megatron-core GPTModel.

Torch-free on purpose: the config planner (`hybridrl.config`) imports `ModelShape` to validate a
run and estimate memory without paying for `import torch` / `import megatron`. Everything here
works on the config read as a plain dict; `hybridrl.models.bridge` turns the result into real
megatron objects.

The families themselves (their switches, defaults and weight tables) are one file each under
`hybridrl/models/families/`; this module reads a config.json against them.
"""
from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hybridrl.models.families import SUPPORTED_ARCHITECTURES
from hybridrl.models.family import ArchFamily, DecoderWeights, HFTensor

# Megatron pads the vocabulary to a multiple of this times TP (its `make_vocab_size_divisible_by`
# default) so that every TP rank holds an equal, aligned slice of the embedding and output layer.
DEFAULT_VOCAB_DIVISOR = 128


class UnsupportedModelError(ValueError):
    """The HF config describes a model this bridge cannot represent exactly."""


class ParallelLayoutError(ValueError):
    """The requested TP/PP/VPP sizes do not fit the model's shape."""


def _architecture_of(config: Mapping[str, Any]) -> ArchFamily:
    archs = config.get("architectures")
    supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
    if not archs:
        # Configs written by hand sometimes only carry model_type: accept it when it is unambiguous.
        by_type = {f.model_type: f for f in SUPPORTED_ARCHITECTURES.values()}
        model_type = config.get("model_type")
        if model_type in by_type:
            return by_type[model_type]
        raise UnsupportedModelError(
            f"config.json has no 'architectures' (model_type={model_type!r}); supported: {supported}"
        )
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported architectures={archs!r} in config.json; supported: {supported}"
        )
    return SUPPORTED_ARCHITECTURES[archs[0]]


# The Llama 3.1 RoPE scaling megatron-core implements (`RotaryEmbedding._apply_scaling`): only `factor` is
# a parameter, the other three are fixed at these values, which every Llama 3.1/3.2/3.3 checkpoint uses.
MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


# The RoPE scalings that run here as transformers runs them: rope_type -> what megatron-core is given.
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")

# YaRN's ramp bounds where config.json names none (transformers' `_compute_yarn_parameters`, vLLM's
# `YaRNScalingRotaryEmbedding` and megatron's `YarnRotaryEmbedding` all default to these).
YARN_DEFAULT_BETA_FAST = 32.0
YARN_DEFAULT_BETA_SLOW = 1.0


@dataclass(frozen=True)
class YarnRope:
    """`rope_type: yarn` as transformers 5 reads it (`_compute_yarn_parameters`), and vLLM 0.32 the same config."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = YARN_DEFAULT_BETA_FAST
    beta_slow: float = YARN_DEFAULT_BETA_SLOW
    # floor/ceil the ramp's bounds (transformers' and vLLM's `truncate`, megatron's correction_range_round_to_int)
    truncate: bool = True
    # what transformers and vLLM multiply cos and sin by: config.json's attention_factor, else inferred from factor
    # (and mscale / mscale_all_dim when both are set)
    attention_factor: float = 1.0


def _yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """transformers' (and vLLM's) `get_mscale`."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _positive_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and 0 < value < math.inf


def _yarn(key: str, params: Mapping[str, Any], config: Mapping[str, Any], max_positions: int) -> YarnRope:
    """config.json's YaRN, refused where transformers 5 and vLLM 0.32 would read it differently (each names the field):
    vLLM takes `factor`, `beta_fast` and `beta_slow` as written, where transformers infers a missing factor from
    max_position_embeddings / original_max_position_embeddings and replaces a null or zero beta by its default."""
    factor = _rope_factor(key, "yarn", params, "Qwen2.5/Qwen3: 4.0 with original_max_position_embeddings=32768; "
                          "vLLM 0.32 does not infer a missing one from max_position_embeddings as transformers does")
    inner = params.get("original_max_position_embeddings")
    outer = config.get("original_max_position_embeddings")
    if inner is not None and outer is not None and inner != outer:
        raise UnsupportedModelError(
            f"{key}.original_max_position_embeddings={inner!r} differs from the top-level "
            f"original_max_position_embeddings={outer!r} (transformers takes the top-level one): write one value")
    original = outer if outer is not None else inner if inner is not None else max_positions
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise UnsupportedModelError(f"{key}.original_max_position_embeddings={original!r}: YaRN needs the "
                                    "pre-training context length, an integer >= 1 (Qwen2.5/Qwen3: 32768)")
    betas = {}
    for name, default in (("beta_fast", YARN_DEFAULT_BETA_FAST), ("beta_slow", YARN_DEFAULT_BETA_SLOW)):
        value = params.get(name, default)
        if not _positive_number(value):
            raise UnsupportedModelError(
                f"{key}.{name}={value!r} is not supported: transformers replaces a null or zero {name} by "
                f"{default:g}, vLLM 0.32 uses the value written: the rollout would not be the model trained; valid: a "
                f"number > 0, or no {name} ({default:g})")
        betas[name] = float(value)
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise UnsupportedModelError(f"{key}.truncate={truncate!r} must be true or false (true: the ramp's bounds "
                                    "rounded to whole dimensions, as transformers and vLLM do by default)")
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        for name, value in (("mscale", mscale), ("mscale_all_dim", mscale_all_dim)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
                raise UnsupportedModelError(f"{key}.{name}={value!r} must be a number")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_get_mscale(factor, mscale) / _yarn_get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_get_mscale(factor)
    elif not _positive_number(attention_factor):
        raise UnsupportedModelError(f"{key}.attention_factor={attention_factor!r}: YaRN's attention factor (cos and "
                                    "sin are multiplied by it) must be a number > 0, or absent (inferred from factor)")
    return YarnRope(factor, original, truncate=truncate, attention_factor=float(attention_factor), **betas)


@dataclass(frozen=True)
class RopeSettings:
    """A config.json's RoPE as megatron-core runs it (`_rope`)."""

    theta: float
    # Llama 3's scaling (megatron's own `rope_scaling`): the factor its lowest frequencies are divided by
    llama3_factor: float | None = None
    # linear interpolation: positions divided by this (megatron's `seq_len_interpolation_factor`), as transformers
    # divides the inverse frequencies by it
    linear_factor: float | None = None
    # dynamic NTK: transformers changes the base only for sequences longer than max_position_embeddings, which the
    # plan refuses (`max_exact_sequence_length`), and vLLM never does: plain RoPE here
    dynamic_factor: float | None = None
    # YaRN: megatron's YarnRotaryEmbedding for the frequencies, the attention factor in the softmax scale
    yarn: YarnRope | None = None


def _rope_factor(key: str, rope_type: str, params: Mapping[str, Any], example: str) -> float:
    factor = params.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, int | float) or factor < 1:
        raise UnsupportedModelError(f"{key}.factor={factor!r}: rope_type {rope_type!r} needs its factor, a number "
                                    f">= 1 ({example})")
    return float(factor)


def _rope(config: Mapping[str, Any], default_theta: float, max_positions: int) -> RopeSettings:
    """The RoPE of transformers 5's `rope_parameters` or 4.x's `rope_theta` + `rope_scaling`; the base is the family's
    `default_theta` when neither names one (`max_positions`: the model's max_position_embeddings).

    Plain RoPE, linear, dynamic-NTK, Llama 3's and YaRN scaling are read as transformers reads them; any other
    scaling (longrope, ...) is refused: megatron-core would run it as plain RoPE and silently change the logits.
    """
    theta = config.get("rope_theta", default_theta)
    found: dict[str, float] = {}
    yarn: YarnRope | None = None
    # transformers 5 moves a top-level partial_rotary_factor into rope_parameters, where vLLM reads it
    for where, holder in (("", config), ("rope_parameters.", config.get("rope_parameters")),
                          ("rope_scaling.", config.get("rope_scaling"))):
        partial = holder.get("partial_rotary_factor", 1.0) if isinstance(holder, Mapping) else 1.0
        if partial != 1.0:
            raise UnsupportedModelError(
                f"{where}partial_rotary_factor={partial!r} is not supported: vLLM 0.32 rotates only that share of "
                "each head, where transformers' plain RoPE for these families rotates all of it (and its scaled RoPE "
                "fails): the rollout would not be the model trained; valid: 1.0")
    for key in ("rope_parameters", "rope_scaling"):
        params = config.get(key)
        if not isinstance(params, Mapping) or not params:
            continue
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "llama3":
            differ = [f"{name}={params.get(name)!r}" for name, value in MEGATRON_LLAMA3_ROPE.items()
                      if params.get(name) != value]
            if differ:
                fixed = ", ".join(f"{name}={value:g}" for name, value in MEGATRON_LLAMA3_ROPE.items())
                raise UnsupportedModelError(
                    f"{key}.rope_type='llama3' with {', '.join(differ)} is not supported: megatron-core's Llama 3 "
                    f"RoPE scaling fixes {fixed} (Llama 3.1's values); only its factor may differ")
            found["llama3"] = _rope_factor(key, rope_type, params, "Llama 3.1: 8, Llama 3.2: 32")
        elif rope_type == "linear":
            found["linear"] = _rope_factor(key, rope_type, params, "e.g. 2.0: positions interpolated 2x")
        elif rope_type == "dynamic":
            if "alpha" in params and "factor" not in params:
                raise UnsupportedModelError(
                    f"{key}: rope_type 'dynamic' with alpha={params['alpha']!r} is not supported (transformers reads "
                    "only a factor); valid: a factor >= 1")
            found["dynamic"] = _rope_factor(key, rope_type, params, "e.g. 2.0")
        elif rope_type == "yarn":
            yarn = _yarn(key, params, config, max_positions)
        elif rope_type != "default":
            raise UnsupportedModelError(
                f"{key}.rope_type={rope_type!r} is not supported: megatron-core would run it as plain RoPE and "
                f"change the logits; supported rope_type: "
                f"{', '.join(map(repr, SUPPORTED_ROPE_TYPES))} (llama3 with Llama 3.1's frequency bands)")
        theta = params.get("rope_theta", theta)
    return RopeSettings(float(theta), llama3_factor=found.get("llama3"), linear_factor=found.get("linear"),
                        dynamic_factor=found.get("dynamic"), yarn=yarn)


@dataclass(frozen=True)
class ModelShape:
    """Every number of a supported decoder-only model that layout, memory and FLOP math need."""

    architecture: str
    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    rms_norm_eps: float
    rope_theta: float
    qkv_bias: bool
    qk_norm: bool
    # The attention window vLLM applies (Mistral's `sliding_window`; Qwen's with `use_sliding_window`:
    # `_sliding_window`); None: full causal attention. Megatron's layers have no window, so only sequences up to it
    # are exact.
    sliding_window: int | None = None
    # Mixture of experts (0 experts: a dense model). `moe_layers` lists the decoder layers whose MLP
    # is the routed experts (the others keep the dense MLP of `ffn_hidden_size`); each token goes to
    # `moe_top_k` experts of `moe_ffn_hidden_size`, weighted by the router's softmax over all experts,
    # renormalized over the chosen ones when `moe_norm_topk_prob`.
    num_experts: int = 0
    moe_top_k: int = 0
    moe_ffn_hidden_size: int = 0
    moe_norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    # The router's load-balancing loss as config.json sets it for transformers' training: `output_router_logits`
    # (transformers adds `router_aux_loss_coef` x its loss to the training loss only when true) and the coefficient
    # (the config class's default, 0.001, when absent). Read by `moe_aux_loss` when the job sets no coefficient.
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.0
    # config.json's attention_dropout: transformers drops attention probabilities in train mode; megatron here never
    # does (the plan warns when it is not 0).
    attention_dropout: float = 0.0
    # Llama 3's RoPE scaling (`rope_type: llama3`, megatron's `rope_scaling`): the factor its lowest
    # frequencies are divided by; None: plain RoPE.
    rope_llama3_factor: float | None = None
    # Linear RoPE scaling (`rope_type: linear`): positions divided by this (megatron's seq_len_interpolation_factor).
    rope_linear_factor: float | None = None
    # Dynamic-NTK RoPE scaling (`rope_type: dynamic`): plain RoPE up to max_position_embeddings, as transformers runs
    # it there (it changes the base only beyond, where the plan refuses sequences) and vLLM 0.32 everywhere.
    rope_dynamic_factor: float | None = None
    # YaRN (`rope_type: yarn`): the frequencies interpolated by this factor below the ramp between beta_slow and
    # beta_fast rotations over the original context (megatron's YarnRotaryEmbedding), and cos and sin multiplied by
    # the attention factor in transformers and vLLM, which megatron runs as softmax_scale = attention_factor^2 /
    # sqrt(head_dim) (`megatron_config_kwargs`); None: no YaRN.
    rope_yarn_factor: float | None = None
    rope_yarn_original_max_position_embeddings: int | None = None
    rope_yarn_beta_fast: float = YARN_DEFAULT_BETA_FAST
    rope_yarn_beta_slow: float = YARN_DEFAULT_BETA_SLOW
    rope_yarn_truncate: bool = True
    rope_yarn_attention_factor: float = 1.0

    def __post_init__(self) -> None:
        # A shape read back from JSON (Plan.from_json) carries a list: keep the shape hashable.
        object.__setattr__(self, "moe_layers", tuple(self.moe_layers))

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelShape:
        """Read an HF config dict; raise `UnsupportedModelError` for anything not exactly representable."""
        if not isinstance(config, Mapping):
            raise UnsupportedModelError(f"config.json holds a JSON {_json_kind(config)}, not an object: {NOT_A_CONFIG}")
        family = _architecture_of(config)
        name = family.architecture

        def need(key: str) -> Any:
            if key not in config or config[key] is None:
                raise UnsupportedModelError(f"{name} config.json lacks required key {key!r}")
            return config[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        # An absent key is the family's default (Mistral's 8 KV heads), an explicit null the head count.
        kv_heads = int((config["num_key_value_heads"] if "num_key_value_heads" in config
                        else family.default_num_kv_heads) or heads)
        head_dim = config.get("head_dim") or family.default_head_dim or hidden // heads
        if config.get("hidden_act", "silu") not in ("silu", "swish"):
            raise UnsupportedModelError(
                f"{name}: hidden_act={config['hidden_act']!r} is not supported (only silu)"
            )
        if config.get("mlp_bias"):
            raise UnsupportedModelError(f"{name}: mlp_bias=True is not supported")
        # Llama/Mistral/Qwen3 `attention_bias` puts a bias on o_proj too, which megatron can only add
        # together with every other linear bias: not representable with this mapping.
        if config.get("attention_bias") and not family.qkv_bias:
            raise UnsupportedModelError(f"{name}: attention_bias=True is not supported")
        if heads % kv_heads:
            raise UnsupportedModelError(
                f"{name}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        if family.model_type == "qwen2" and config.get("head_dim") not in (None, hidden // heads):
            # transformers' Qwen2 attention reads head_dim; vLLM 0.32's takes hidden_size // num_attention_heads
            raise UnsupportedModelError(
                f"{name}: head_dim={config['head_dim']} is not supported: vLLM 0.32's Qwen2 attention ignores it "
                f"(it uses hidden_size // num_attention_heads = {hidden // heads}); valid: {hidden // heads} or no "
                "head_dim")
        sliding_window = _sliding_window(family, config, int(need("num_hidden_layers")))
        tie = config.get("tie_word_embeddings")
        moe = _moe_fields(family, config, int(need("num_hidden_layers")), need) if family.moe else {}
        max_positions = int(config.get("max_position_embeddings") or family.default_max_positions)
        rope = _rope(config, family.default_rope_theta, max_positions)
        yarn: dict[str, Any] = {} if rope.yarn is None else dict(
            rope_yarn_factor=rope.yarn.factor,
            rope_yarn_original_max_position_embeddings=rope.yarn.original_max_position_embeddings,
            rope_yarn_beta_fast=rope.yarn.beta_fast, rope_yarn_beta_slow=rope.yarn.beta_slow,
            rope_yarn_truncate=rope.yarn.truncate, rope_yarn_attention_factor=rope.yarn.attention_factor)
        return cls(
            architecture=name,
            model_type=family.model_type,
            num_layers=int(need("num_hidden_layers")),
            hidden_size=hidden,
            num_attention_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(head_dim),
            ffn_hidden_size=int(need("intermediate_size")),
            vocab_size=int(need("vocab_size")),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(family.default_tie_word_embeddings if tie is None else tie),
            rms_norm_eps=float(config.get("rms_norm_eps", family.default_rms_norm_eps)),
            rope_theta=rope.theta,
            qkv_bias=family.qkv_bias,
            qk_norm=family.qk_norm,
            sliding_window=int(sliding_window) if sliding_window else None,
            rope_llama3_factor=rope.llama3_factor,
            rope_linear_factor=rope.linear_factor,
            rope_dynamic_factor=rope.dynamic_factor,
            attention_dropout=float(config.get("attention_dropout") or 0.0),
            **yarn,
            **moe,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelShape:
        return cls.from_hf_config(read_hf_config(path))

    def reading_notes(self) -> list[str]:
        """How config.json's RoPE scaling and attention window run here, for the plan (empty: plain RoPE, no window)."""
        notes = []
        if self.rope_llama3_factor is not None:
            notes.append(f"Llama 3 RoPE scaling x{self.rope_llama3_factor:g} (megatron's rope_scaling)")
        if self.rope_linear_factor is not None:
            notes.append(f"linear RoPE scaling x{self.rope_linear_factor:g} (positions / {self.rope_linear_factor:g}: "
                         "megatron's seq_len_interpolation_factor)")
        if self.rope_dynamic_factor is not None:
            notes.append(f"dynamic RoPE scaling x{self.rope_dynamic_factor:g}: plain RoPE up to "
                         f"max_position_embeddings={self.max_position_embeddings}, as transformers and vLLM run it")
        if self.rope_yarn_factor is not None:
            notes.append(
                f"YaRN RoPE scaling x{self.rope_yarn_factor:g} of original_max_position_embeddings="
                f"{self.rope_yarn_original_max_position_embeddings} (beta_fast {self.rope_yarn_beta_fast:g}, beta_slow "
                f"{self.rope_yarn_beta_slow:g}{'' if self.rope_yarn_truncate else ', truncate=false'}: megatron's "
                f"YarnRotaryEmbedding), attention factor {self.rope_yarn_attention_factor:.6g} (transformers and vLLM "
                f"multiply cos and sin by it; megatron's softmax_scale = its square / sqrt(head_dim) = "
                f"{self.yarn_softmax_scale:.6g})")
        if self.sliding_window is not None:
            notes.append(f"sliding window {self.sliding_window} (vLLM windows every layer, megatron none: sequences "
                         f"up to {self.max_exact_sequence_length} tokens)")
        return notes

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def max_exact_sequence_length(self) -> int:
        """Longest sequence on which the megatron model equals HF and vLLM: max_position_embeddings, capped by a
        sliding window (megatron's layers have none) and by YaRN's original_max_position_embeddings x factor (vLLM
        0.32's YaRN cos/sin table ends there; transformers' and megatron's YaRN are the same at every position)."""
        limit = self.max_position_embeddings
        if self.sliding_window is not None:
            limit = min(limit, self.sliding_window)
        if self.yarn_table_length is not None:
            limit = min(limit, self.yarn_table_length)
        return limit

    @property
    def yarn_table_length(self) -> int | None:
        """Positions vLLM 0.32's YaRN module holds cos/sin for (`torch.arange(original * factor)`); None: no YaRN."""
        if self.rope_yarn_factor is None or self.rope_yarn_original_max_position_embeddings is None:
            return None
        return math.ceil(self.rope_yarn_original_max_position_embeddings * self.rope_yarn_factor)

    @property
    def yarn_softmax_scale(self) -> float | None:
        """The attention's softmax scale under YaRN: transformers and vLLM multiply cos and sin by the attention
        factor m, which multiplies every query-key product by m^2; megatron-core 0.16.1's GPT model drops that factor
        (`GPTModel.forward` discards YarnRotaryEmbedding's mscale), so the scale carries it. None: no YaRN."""
        if self.rope_yarn_factor is None:
            return None
        return self.rope_yarn_attention_factor ** 2 / math.sqrt(self.head_dim)

    def megatron_yarn_attributes(self) -> dict[str, Any]:
        """What megatron-core 0.16.1's `GPTModel(position_embedding_type='yarn')` reads from its TransformerConfig with
        getattr: attributes no field of that class declares (only MLATransformerConfig has YaRN fields, under other
        names), so `bridge.transformer_config` sets them on the built config. `yarn_mscale` equal to
        `yarn_mscale_all_dim` makes megatron's own concentration factor (which its attention applies to q and k when
        these attributes exist) exactly 1: the attention factor is in `softmax_scale` instead, which every attention
        (local, TE, SDPA) and every fused RoPE path honours. Empty without YaRN."""
        if self.rope_yarn_factor is None:
            return {}
        return dict(yarn_rotary_scaling_factor=self.rope_yarn_factor,
                    yarn_original_max_position_embeddings=self.rope_yarn_original_max_position_embeddings,
                    yarn_beta_fast=self.rope_yarn_beta_fast, yarn_beta_slow=self.rope_yarn_beta_slow,
                    yarn_mscale=1.0, yarn_mscale_all_dim=1.0,
                    yarn_correction_range_round_to_int=self.rope_yarn_truncate)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def layer_is_moe(self, layer: int) -> bool:
        """Whether decoder layer `layer` (global index) routes its tokens to experts."""
        return layer in self.moe_layers

    def experts_per_rank(self, ep: int) -> int:
        return self.num_experts // ep if self.is_moe else 0

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_kv_heads

    @property
    def weights(self) -> DecoderWeights:
        """The family's weight table (`hybridrl/models/families/`)."""
        return SUPPORTED_ARCHITECTURES[self.architecture].weights

    def dim(self, name: str) -> int:
        """A named dimension of the weight tables (`HFTensor.dims`)."""
        sizes = {"hidden": self.hidden_size, "q": self.q_size, "kv": self.kv_size, "head_dim": self.head_dim,
                 "ffn": self.ffn_hidden_size, "vocab": self.vocab_size, "experts": self.num_experts,
                 "moe_ffn": self.moe_ffn_hidden_size}
        return sizes[name]

    def hf_numel(self, tensor: HFTensor) -> int:
        return math.prod(self.dim(d) for d in tensor.dims)

    def params_of_layer(self, layer: int) -> int:
        """Parameters of decoder layer `layer` (every expert counted)."""
        return self._layer_params[layer][0]

    def expert_params_of_layer(self, layer: int) -> int:
        """The routed experts' share of `params_of_layer(layer)` (every expert counted; 0 in a dense layer)."""
        return self._layer_params[layer][1]

    @functools.cached_property
    def _layer_params(self) -> tuple[tuple[int, int], ...]:
        """(all, routed experts') parameters of each decoder layer, counted once per shape: the plan asks for them
        per stage, per pass and per layout (`hybridrl plan --search` plans hundreds of layouts of one model).
        Not a field: outside equality, hashing and `asdict`."""
        return tuple(self._count_layer_params(layer) for layer in range(self.num_layers))

    def _count_layer_params(self, layer: int) -> tuple[int, int]:
        total = experts = 0
        for spec in self.weights.layer:
            if spec.exists(self, layer):
                numel = sum(self.hf_numel(t) for t in spec.hf) * (self.num_experts if spec.expert else 1)
                total += numel
                experts += numel if spec.expert else 0
        return total, experts

    def params_per_layer(self) -> int:
        """The largest layer's parameters (all layers alike in a dense model; an MoE layer with every
        expert counted in an MoE model: an upper bound for a rank's share until EP is estimated)."""
        return max(self.params_of_layer(layer) for layer in range(self.num_layers))

    def param_count(self) -> int:
        """Parameters of the HF model (unpadded vocab; a tied output layer counted once)."""
        table = self.weights
        outer = [table.embedding, table.final_norm] + ([] if self.tie_word_embeddings else [table.lm_head])
        return sum(self.hf_numel(t) for spec in outer for t in spec.hf) \
            + sum(self.params_of_layer(layer) for layer in range(self.num_layers))

    def padded_vocab_size(self, tp: int, divisor: int = DEFAULT_VOCAB_DIVISOR) -> int:
        return padded_vocab_size(self.vocab_size, tp, divisor)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # ---- parallel fit ----------------------------------------------------------------------------
    def parallel_errors(self, tp: int = 1, pp: int = 1, vpp: int | None = None, ep: int = 1, *,
                        first_stage_layers: int | None = None, last_stage_layers: int | None = None,
                        etp: int | None = None) -> list[str]:
        """Every reason TP/PP/VPP/EP/ETP and the stage split cannot shard this model (empty when it
        can), for all-at-once reports (the arguments are `ParallelLayout.sizes()`; `etp` None: TP)."""
        errors: list[str] = []
        for label, value in (("tp", tp), ("pp", pp), ("ep", ep), ("etp", etp or tp)):
            if value < 1:
                errors.append(f"{label}={value} must be >= 1")
        if vpp is not None and vpp < 1:
            errors.append(f"vpp={vpp} must be >= 1")
        if errors:
            return errors
        heads, kv = self.num_attention_heads, self.num_kv_heads
        if heads % tp:
            errors.append(f"tp={tp} does not divide num_attention_heads={heads}")
        # Megatron shards KV heads when tp <= kv; when tp > kv each KV head is shared by tp/kv ranks
        # (megatron gathers the fused qkv and picks its group), which needs tp to be a multiple of kv.
        if tp <= kv and kv % tp:
            errors.append(f"tp={tp} does not divide num_key_value_heads={kv}")
        if tp > kv and tp % kv:
            errors.append(f"tp={tp} > num_key_value_heads={kv} must be a multiple of it")
        qkv_rows = self.q_size + 2 * self.kv_size
        if qkv_rows % tp:
            errors.append(f"tp={tp} does not divide the fused qkv size {qkv_rows}")
        if self.ffn_hidden_size % tp and (not self.is_moe or len(self.moe_layers) < self.num_layers):
            errors.append(f"tp={tp} does not divide intermediate_size={self.ffn_hidden_size}")
        if ep > 1 and not self.is_moe:
            errors.append(f"ep={ep} needs a mixture-of-experts model ({self.architecture} is dense): use ep=1")
        if etp is not None and etp != tp and not self.is_moe:
            errors.append(f"etp={etp} needs a mixture-of-experts model ({self.architecture} is dense): use etp=tp")
        if self.is_moe:
            if self.num_experts % ep:
                errors.append(f"ep={ep} does not divide num_experts={self.num_experts}")
            # each expert's fc1/fc2 is split over the expert TP ranks like a dense MLP over TP
            label = "tp" if etp is None or etp == tp else "etp"
            if self.moe_ffn_hidden_size % (etp or tp):
                errors.append(f"{label}={etp or tp} does not divide the experts' intermediate size "
                              f"{self.moe_ffn_hidden_size}")
        if vpp is not None and vpp > 1 and pp < 2:
            errors.append(f"vpp={vpp} needs pp >= 2 (got pp={pp})")
        else:
            # the one stage-split rule (layout.py imports this module, hence the late import)
            from hybridrl.models.layout import ParallelLayout

            errors += ParallelLayout(tp, pp, vpp, ep, first_stage_layers, last_stage_layers).split_errors(
                self.num_layers)
        return errors

    def check_parallel(self, tp: int = 1, pp: int = 1, vpp: int | None = None, ep: int = 1, *,
                       first_stage_layers: int | None = None, last_stage_layers: int | None = None,
                       etp: int | None = None) -> None:
        errors = self.parallel_errors(tp, pp, vpp, ep, first_stage_layers=first_stage_layers,
                                      last_stage_layers=last_stage_layers, etp=etp)
        if errors:
            raise ParallelLayoutError(f"{self.architecture}: " + "; ".join(errors))

    # ---- megatron configuration (plain values; bridge.py makes the objects) ---------------------
    def megatron_config_kwargs(self, tp: int = 1, pp: int = 1, vpp: int | None = None,
                               ep: int = 1, *, first_stage_layers: int | None = None,
                               last_stage_layers: int | None = None, etp: int | None = None) -> dict[str, Any]:
        """`TransformerConfig` keyword arguments, with `activation_func` given by name ('silu')."""
        self.check_parallel(tp, pp, vpp, ep, first_stage_layers=first_stage_layers,
                            last_stage_layers=last_stage_layers, etp=etp)
        return dict(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_kv_heads,
            kv_channels=self.head_dim,
            ffn_hidden_size=self.ffn_hidden_size,
            normalization="RMSNorm",
            # megatron's default epsilon (1e-5) differs from HF's: always pass the model's.
            layernorm_epsilon=self.rms_norm_eps,
            gated_linear_unit=True,
            activation_func="silu",
            add_bias_linear=False,
            add_qkv_bias=self.qkv_bias,
            qk_layernorm=self.qk_norm,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
            # megatron places the layers by these (get_transformer_layer_offset); None = even
            num_layers_in_first_pipeline_stage=first_stage_layers,
            num_layers_in_last_pipeline_stage=last_stage_layers,
            **self._moe_config_kwargs(etp or tp, ep),
            # YaRN's attention factor (transformers' cos and sin x m: q.k x m^2); None: megatron's 1 / sqrt(kv_channels)
            softmax_scale=self.yarn_softmax_scale,
        )

    def _moe_config_kwargs(self, etp: int, ep: int) -> dict[str, Any]:
        if not self.is_moe:
            return {}
        return dict(
            num_moe_experts=self.num_experts,
            moe_router_topk=self.moe_top_k,
            moe_ffn_hidden_size=self.moe_ffn_hidden_size,
            # 1 = this layer's MLP is the experts, 0 = the dense MLP (megatron's per-layer pattern).
            moe_layer_freq=[int(self.layer_is_moe(i)) for i in range(self.num_layers)],
            # HF: softmax over all experts (in fp32), top-k, renormalized if norm_topk_prob. megatron
            # without pre-softmax takes the top-k logits and softmaxes those: the renormalized top-k
            # of the full softmax exactly; with pre-softmax it softmaxes all and keeps the top-k as is.
            moe_router_score_function="softmax",
            moe_router_pre_softmax=not self.moe_norm_topk_prob,
            moe_router_dtype="fp32",
            moe_grouped_gemm=False,
            moe_token_dispatcher_type="alltoall",
            # Router losses are the training slice's (issue 20); off here, so the forward is HF's.
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
        )

    def gpt_model_kwargs(self, tp: int = 1) -> dict[str, Any]:
        """`GPTModel` keyword arguments that depend only on the model (not the rank's stage)."""
        return dict(
            vocab_size=self.padded_vocab_size(tp),
            max_sequence_length=self.max_position_embeddings,
            position_embedding_type="rope" if self.rope_yarn_factor is None else "yarn",
            rotary_base=self.rope_theta,
            rotary_percent=1.0,
            rope_scaling=self.rope_llama3_factor is not None,
            **({} if self.rope_llama3_factor is None else {"rope_scaling_factor": self.rope_llama3_factor}),
            seq_len_interpolation_factor=self.rope_linear_factor,
            share_embeddings_and_output_weights=self.tie_word_embeddings,
        )


def _sliding_window(family: ArchFamily, config: Mapping[str, Any], num_layers: int) -> int | None:
    """The attention window a family's config.json gives the model vLLM runs (None: none), which caps the sequences
    on which megatron's window-less layers are exact (`ModelShape.max_exact_sequence_length`).

    Mistral and Mixtral window every layer by `sliding_window`. Qwen2, Qwen3 and Qwen3-MoE have one only with
    `use_sliding_window: true` (transformers then keeps `sliding_window`, 4096 when absent), and transformers' Qwen2
    and Qwen3 apply it to the layers `layer_types` marks "sliding_attention" (config.json's list, else the layers from
    `max_window_layers` on): none when max_window_layers >= num_hidden_layers. vLLM 0.32 applies the window to every
    layer and refuses a Qwen2/Qwen3 model whose layers mix the two kinds, so that mix is refused here by name."""
    if family.model_type in ("mistral", "mixtral"):
        window = config.get("sliding_window", family.default_sliding_window)
        return int(window) if window else None
    use = config.get("use_sliding_window", False)
    window = config.get("sliding_window", 4096) if use else None
    if family.model_type not in ("qwen2", "qwen3"):
        return int(window) if window else None
    max_window_layers = config.get("max_window_layers", 28)
    layer_types = config.get("layer_types")
    if layer_types is None:
        layer_types = ["sliding_attention" if window is not None and i >= max_window_layers else "full_attention"
                       for i in range(num_layers)]
    kinds = ("full_attention", "sliding_attention")
    if not isinstance(layer_types, list) or len(layer_types) != num_layers or any(k not in kinds for k in layer_types):
        raise UnsupportedModelError(
            f"{family.architecture}: layer_types={layer_types!r} must list {num_layers} entries (num_hidden_layers), "
            f"each one of {', '.join(map(repr, kinds))}")
    sliding = [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
    if 0 < len(sliding) < num_layers and max_window_layers != num_layers:
        explicit = "layer_types" in config
        setting = "layer_types" if explicit else f"use_sliding_window=true with max_window_layers={max_window_layers}"
        valid = (f"layer_types of one kind, or max_window_layers={num_layers} (vLLM then windows every layer)"
                 if explicit else f"max_window_layers=0 (every layer windowed) or >= num_hidden_layers={num_layers} "
                 "(none in transformers), or use_sliding_window=false")
        raise UnsupportedModelError(
            f"{family.architecture}: {setting} gives layers {sliding[0]}..{sliding[-1]} a {window}-token window and "
            f"the other {num_layers - len(sliding)} full attention (transformers' reading); vLLM 0.32 refuses a model "
            f"that mixes the two. Valid: {valid}")
    return int(window) if window else None


def _moe_fields(family: ArchFamily, config: Mapping[str, Any], num_layers: int, need: Any) -> dict[str, Any]:
    """ModelShape's MoE fields from an MoE family's config.json (Qwen3-MoE or Mixtral keys)."""
    name = family.architecture
    # Qwen3-MoE's own key is num_experts; transformers 5 writes num_local_experts (Mixtral's) for both.
    experts = config.get("num_experts") or config.get("num_local_experts")
    if not experts:
        raise UnsupportedModelError(f"{name} config.json lacks num_experts / num_local_experts")
    top_k = int(need("num_experts_per_tok"))
    if not 1 <= top_k <= int(experts):
        raise UnsupportedModelError(f"{name}: num_experts_per_tok={top_k} must be in 1..{experts} (num_experts)")
    # Mixtral always renormalizes the top-k weights; Qwen3-MoE when norm_topk_prob.
    renormalized = family.model_type == "mixtral" or bool(config.get("norm_topk_prob", False))
    if top_k == 1 and renormalized:
        # transformers weights the one chosen expert by 1 (its probability over itself); megatron-core takes the
        # top-1 only with pre-softmax routing (its TransformerConfig refuses any other), which weights it by its
        # probability over all experts: a different model.
        setting = "" if family.model_type == "mixtral" else " with norm_topk_prob=true"
        raise UnsupportedModelError(
            f"{name}: num_experts_per_tok=1{setting} is not supported: transformers weights the chosen expert by 1, "
            "and megatron-core routes top-1 only with pre-softmax routing, which weights it by its router "
            f"probability; supported: num_experts_per_tok in 2..{experts}"
            + ("" if family.model_type == "mixtral" else ", or 1 with norm_topk_prob=false"))
    if family.model_type == "mixtral":
        if config.get("router_jitter_noise"):
            raise UnsupportedModelError(f"{name}: router_jitter_noise={config['router_jitter_noise']} is not "
                                        "supported (megatron's input jitter differs): use 0")
        return dict(num_experts=int(experts), moe_top_k=top_k, moe_ffn_hidden_size=int(need("intermediate_size")),
                    moe_norm_topk_prob=True, moe_layers=tuple(range(num_layers)), **_router_loss(family, config))
    if config.get("shared_expert_intermediate_size"):
        raise UnsupportedModelError(f"{name}: shared experts are not supported")
    step = int(config.get("decoder_sparse_step") or 1)
    dense = set(config.get("mlp_only_layers") or ())
    # transformers' Qwen3MoeDecoderLayer: experts where (i + 1) % decoder_sparse_step == 0, outside mlp_only_layers
    layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    return dict(num_experts=int(experts), moe_top_k=top_k, moe_ffn_hidden_size=int(need("moe_intermediate_size")),
                moe_norm_topk_prob=renormalized, moe_layers=layers, **_router_loss(family, config))


# transformers' MixtralConfig and Qwen3MoeConfig default router_aux_loss_coef
DEFAULT_ROUTER_AUX_LOSS_COEF = 0.001


def _router_loss(family: ArchFamily, config: Mapping[str, Any]) -> dict[str, Any]:
    """`ModelShape.output_router_logits` and `router_aux_loss_coef` from an MoE config.json."""
    coef = config.get("router_aux_loss_coef", DEFAULT_ROUTER_AUX_LOSS_COEF)
    if isinstance(coef, bool) or not isinstance(coef, int | float) or not 0 <= coef < math.inf:
        raise UnsupportedModelError(f"{family.architecture}: router_aux_loss_coef={coef!r} must be a number >= 0")
    return dict(output_router_logits=bool(config.get("output_router_logits", False)), router_aux_loss_coef=float(coef))


def padded_vocab_size(vocab_size: int, tp: int, divisor: int = DEFAULT_VOCAB_DIVISOR) -> int:
    """Megatron's padding rule: round up to a multiple of `divisor * tp`."""
    multiple = divisor * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


def value_model_hf_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A value model's (critic, reward model) HF config as the workers build it: a sequence classifier read
    as its causal-LM twin (same backbone), untied (the output layer gives way to a scalar head)."""
    config = dict(config)
    archs = [a.replace("ForSequenceClassification", "ForCausalLM") for a in config.get("architectures") or []]
    if archs:
        config["architectures"] = archs
    config["tie_word_embeddings"] = False
    return config


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """config.json of an HF folder (or the file itself) as a dict, with a clear error if absent, not JSON or not a
    JSON object (`UnsupportedModelError`, naming the file)."""
    path = Path(path)
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    try:
        config = json.loads(config_file.read_bytes())
    except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8
        raise UnsupportedModelError(f"{config_file} is not valid JSON ({exc}): {NOT_A_CONFIG}") from exc
    if not isinstance(config, dict):
        raise UnsupportedModelError(f"{config_file} holds a JSON {_json_kind(config)}, not an object: {NOT_A_CONFIG}")
    return config


NOT_A_CONFIG = ("an HF model's config.json is one JSON object of its settings "
                '({"architectures": ["LlamaForCausalLM"], "hidden_size": ..., ...})')


def _json_kind(value: Any) -> str:
    kinds = {list: "array", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}
    return kinds.get(type(value), type(value).__name__)
