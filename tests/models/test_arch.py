"""Config mapping (torch-free ModelShape) and the pure layout math, checked against transformers and
megatron-core's own rules without starting any process group."""
from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hybridrl.models.arch import (
    SUPPORTED_ARCHITECTURES,
    ModelShape,
    ParallelLayoutError,
    UnsupportedModelError,
    padded_vocab_size,
)
from hybridrl.models.layout import (
    ParallelLayout,
    chunk_tensor_plans,
    fused_qkv_order,
    hf_export_map,
    hf_tensor_shapes,
    max_rank_numel,
    rank_numel,
    rank_tensor_plans,
    vocab_range_for_rank,
)
from tests.support.models_fixtures import ARCHS, make_hf_model, read_json


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("arch_cfg")
    return {arch: make_hf_model(root / arch, arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def hf_configs(hf_dirs) -> dict[str, dict]:
    return {arch: read_json(path / "config.json") for arch, path in hf_dirs.items()}


def test_arch_module_is_torch_free():
    code = ("import sys, hybridrl.models.arch, hybridrl.models.layout, hybridrl.models.convert_cli; "
            "bad = [m for m in ('torch', 'megatron', 'transformers') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_shape_matches_transformers_model(hf_dirs, hf_configs, arch):
    import transformers

    config = hf_configs[arch]
    shape = ModelShape.from_hf_config(config)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(hf_dirs[arch]))
    # Parameter count and every tensor shape agree with the real HF model.
    assert shape.param_count() == sum(p.numel() for p in model.parameters())
    state = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if shape.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    assert hf_tensor_shapes(shape) == state
    assert shape.num_kv_heads == 2 and shape.num_attention_heads == 4
    assert shape.head_dim == (32 if arch == "qwen3" else 16)
    assert shape.qkv_bias == (arch == "qwen2") and shape.qk_norm == (arch == "qwen3")
    assert shape.rms_norm_eps == config["rms_norm_eps"]
    assert shape.rope_theta == config["rope_parameters"]["rope_theta"]
    kwargs = shape.megatron_config_kwargs(tp=2, pp=2)
    assert kwargs["layernorm_epsilon"] == shape.rms_norm_eps
    assert kwargs["num_query_groups"] == 2 and kwargs["kv_channels"] == shape.head_dim
    assert kwargs["add_qkv_bias"] == shape.qkv_bias and kwargs["qk_layernorm"] == shape.qk_norm
    assert shape.gpt_model_kwargs(tp=2)["vocab_size"] == 256


# The keys a config.json must hold (and small MoE sizes): everything else is left to each family's defaults.
_MINIMAL = {"hidden_size": 256, "num_attention_heads": 32, "num_hidden_layers": 2, "intermediate_size": 64,
            "vocab_size": 128}
_MINIMAL_MOE = {"LlamaForCausalLM": {}, "MistralForCausalLM": {}, "Qwen2ForCausalLM": {}, "Qwen3ForCausalLM": {},
                "MixtralForCausalLM": {"num_local_experts": 2, "num_experts_per_tok": 2},
                "Qwen3MoeForCausalLM": {"num_experts": 2, "num_experts_per_tok": 2, "moe_intermediate_size": 32}}


@pytest.mark.parametrize("architecture", sorted(SUPPORTED_ARCHITECTURES))
def test_omitted_keys_take_the_transformers_class_defaults(tmp_path, architecture):
    """A config.json without rms_norm_eps, rope_theta, num_key_value_heads, head_dim or sliding_window (a
    hand-written one, or one older than the key) is read with the defaults transformers and vLLM fill in, which
    differ between families (Mixtral: eps 1e-5, theta 1e6; Mistral: 8 KV heads, window 4096; Qwen3-MoE: head_dim
    hidden/heads where Qwen3's is 128). The reference is the transformers model built from the same file."""
    import transformers

    model_type = SUPPORTED_ARCHITECTURES[architecture].model_type
    config = {"architectures": [architecture], "model_type": model_type, **_MINIMAL, **_MINIMAL_MOE[architecture]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = ModelShape.from_hf_dir(tmp_path)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path))
    attention, norm = model.model.layers[0].self_attn, model.model.layers[0].input_layernorm
    inv_freq = model.model.rotary_emb.inv_freq.double()  # theta ** (-2i / head_dim) in fp32, i < head_dim / 2
    assert shape.head_dim == attention.head_dim == inv_freq.numel() * 2
    assert shape.num_kv_heads == attention.k_proj.out_features // attention.head_dim
    assert shape.rms_norm_eps == norm.variance_epsilon
    assert shape.rope_theta == pytest.approx(inv_freq[1].item() ** (-shape.head_dim / 2), rel=1e-5)
    assert shape.sliding_window == getattr(model.config, "sliding_window", None)
    assert shape.tie_word_embeddings == (model.lm_head.weight is model.model.embed_tokens.weight)
    assert shape.param_count() == sum(p.numel() for p in model.parameters())
    # the router loss transformers would train an MoE model with (off: output_router_logits false by default)
    assert shape.output_router_logits == getattr(model.config, "output_router_logits", False) is False
    assert shape.router_aux_loss_coef == getattr(model.config, "router_aux_loss_coef", 0.0)
    # what megatron is given
    assert shape.megatron_config_kwargs()["layernorm_epsilon"] == norm.variance_epsilon
    assert shape.gpt_model_kwargs()["rotary_base"] == shape.rope_theta


def test_sliding_window_caps_the_exact_sequence_length(hf_configs):
    config = {**hf_configs["mistral"], "sliding_window": 32}
    assert ModelShape.from_hf_config(config).max_exact_sequence_length == 32
    assert ModelShape.from_hf_config(hf_configs["mistral"]).max_exact_sequence_length == 64


# Qwen's window settings: (use_sliding_window, sliding_window, max_window_layers, layer_types); 4 layers.
_FULL, _SLIDING = "full_attention", "sliding_attention"
QWEN_WINDOWS = [
    (False, 8, 2, None), (True, 8, 4, None), (True, 8, 9, None), (True, 8, 0, None), (True, 8, 2, None),
    (True, None, 2, None), (True, "absent", 4, None), (True, 8, 4, [_FULL, _FULL, _SLIDING, _SLIDING]),
    (True, 8, 2, [_SLIDING] * 4), (True, 8, 1, [_FULL, _SLIDING, _FULL, _SLIDING]),
]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_sliding_window_is_read_as_transformers_and_vllm_run_it(hf_configs, arch):
    """Qwen2/Qwen3's `use_sliding_window` with `max_window_layers` (or config.json's own `layer_types`): transformers'
    config says which layers have the window and its size; vLLM 0.32 windows every layer by the config's
    sliding_window and refuses (its Qwen2Model asserts) a mix of windowed and full layers unless max_window_layers
    equals the layer count. hybridrl accepts exactly what both run, capped at the window vLLM applies."""
    import transformers

    for use, window, max_window_layers, layer_types in QWEN_WINDOWS:
        config = {**hf_configs[arch], "use_sliding_window": use, "max_window_layers": max_window_layers}
        config.pop("layer_types", None)
        config.pop("sliding_window", None)
        if window != "absent":
            config["sliding_window"] = window
        if layer_types is not None:
            config["layer_types"] = layer_types
        case = (use, window, max_window_layers, layer_types)
        hf = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
        mixed = len(set(hf.layer_types)) > 1
        if mixed and hf.max_window_layers != hf.num_hidden_layers:  # vLLM 0.32's Qwen2Model assertion
            with pytest.raises(UnsupportedModelError, match=r"vLLM 0.32 refuses.*Valid: .*max_window_layers") as info:
                ModelShape.from_hf_config(config)
            named = "layer_types" if layer_types else f"max_window_layers={max_window_layers}"
            assert named in str(info.value).split(" gives ")[0], case
            continue
        shape = ModelShape.from_hf_config(config)
        assert shape.sliding_window == hf.sliding_window, case  # what vLLM windows every layer by
        assert shape.max_exact_sequence_length == min(hf.sliding_window or 10**9, hf.max_position_embeddings), case
    assert (True, 8, 4, None) in QWEN_WINDOWS and (True, 8, 2, None) in QWEN_WINDOWS  # accepted, refused
    with pytest.raises(UnsupportedModelError, match="layer_types=.*must list 4 entries"):
        ModelShape.from_hf_config({**hf_configs[arch], "layer_types": [_FULL] * 3})


def test_qwen3_moe_windows_every_layer(tmp_path):
    """Qwen3-MoE's attention takes `sliding_window` on every layer when use_sliding_window (no max_window_layers)."""
    config = {"architectures": ["Qwen3MoeForCausalLM"], **_MINIMAL, **_MINIMAL_MOE["Qwen3MoeForCausalLM"],
              "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}
    assert ModelShape.from_hf_config(config).sliding_window == 16
    assert ModelShape.from_hf_config({**config, "use_sliding_window": False}).sliding_window is None


def test_legacy_transformers4_config_keys():
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
              "num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": 100, "rope_theta": 5e5,
              "rope_scaling": None, "torch_dtype": "bfloat16"}
    shape = ModelShape.from_hf_config(config)
    assert shape.rope_theta == 5e5 and shape.num_kv_heads == 4 and not shape.tie_word_embeddings
    assert shape.rope_llama3_factor is None and not shape.gpt_model_kwargs()["rope_scaling"]
    # Llama 3.1's config.json as the hub holds it (transformers 4's keys)
    llama31 = {**config, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    shape = ModelShape.from_hf_config(llama31)
    assert (shape.rope_theta, shape.rope_llama3_factor) == (5e5, 8.0)
    assert shape.gpt_model_kwargs()["rope_scaling"] and shape.gpt_model_kwargs()["rope_scaling_factor"] == 8.0


def test_yarn_as_qwen_ships_it(hf_configs):
    """Qwen2.5/Qwen3's long-context setting (transformers 4's `rope_scaling`, as their config.json files carry it):
    megatron's YaRN position embedding with the factor, original length and default ramp, its own rotary factor made 1
    (mscale == mscale_all_dim) and transformers' attention factor 0.1 ln 4 + 1 in the softmax scale, squared."""
    config = {**hf_configs["qwen2"], "rope_theta": 1e6, "max_position_embeddings": 32768,
              "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    config.pop("rope_parameters", None)
    shape = ModelShape.from_hf_config(config)
    factor = 0.1 * math.log(4.0) + 1
    assert (shape.rope_theta, shape.rope_yarn_factor, shape.rope_yarn_original_max_position_embeddings) == \
        (1e6, 4.0, 32768)
    assert (shape.rope_yarn_beta_fast, shape.rope_yarn_beta_slow, shape.rope_yarn_truncate) == (32.0, 1.0, True)
    assert shape.rope_yarn_attention_factor == pytest.approx(factor, rel=1e-15)
    assert shape.gpt_model_kwargs()["position_embedding_type"] == "yarn"
    assert not shape.gpt_model_kwargs()["rope_scaling"] and shape.gpt_model_kwargs()["seq_len_interpolation_factor"] \
        is None
    assert shape.megatron_config_kwargs()["softmax_scale"] == pytest.approx(factor ** 2 / math.sqrt(16), rel=1e-15)
    assert shape.megatron_yarn_attributes() == dict(
        yarn_rotary_scaling_factor=4.0, yarn_original_max_position_embeddings=32768, yarn_beta_fast=32.0,
        yarn_beta_slow=1.0, yarn_mscale=1.0, yarn_mscale_all_dim=1.0, yarn_correction_range_round_to_int=True)
    # vLLM's table covers 4 x 32768 positions: max_position_embeddings stays the limit
    assert shape.max_exact_sequence_length == 32768 and shape.yarn_table_length == 131072
    assert any("YaRN RoPE scaling x4 of original_max_position_embeddings=32768" in note and "1.13863" in note
               for note in shape.reading_notes())
    # a model without YaRN: megatron's own scale and position embedding
    plain = ModelShape.from_hf_config(hf_configs["qwen2"])
    assert plain.megatron_config_kwargs()["softmax_scale"] is None and plain.megatron_yarn_attributes() == {}
    assert plain.gpt_model_kwargs()["position_embedding_type"] == "rope"
    # ModelShape survives the plan's JSON round trip
    assert ModelShape(**json.loads(json.dumps(shape.to_dict()))) == shape


@pytest.mark.parametrize("params", [
    {"factor": 4.0, "original_max_position_embeddings": 32},
    {"factor": 8.0, "original_max_position_embeddings": 32, "mscale": 1.0, "mscale_all_dim": 0.5},
    {"factor": 8.0, "original_max_position_embeddings": 32, "mscale": 0.7},  # one of the two: factor only
    {"factor": 4.0, "original_max_position_embeddings": 32, "attention_factor": 1.3, "mscale": 2.0,
     "mscale_all_dim": 1.0},  # explicit wins
    {"factor": 1.0, "original_max_position_embeddings": 64},  # factor 1: attention factor 1
    {"factor": 16.0, "original_max_position_embeddings": 16, "beta_fast": 8, "beta_slow": 2, "truncate": False},
])
def test_yarn_attention_factor_and_ramp_are_transformers(hf_configs, params):
    """The attention factor (and the other fields) as transformers 5's own `_compute_yarn_parameters` reads the same
    config.json (its attention scaling, from its config class)."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = {**hf_configs["llama"], "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, **params}}
    shape = ModelShape.from_hf_config(config)
    hf_config = transformers.LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"})
    _, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config, "cpu")
    assert shape.rope_yarn_attention_factor == pytest.approx(attention_factor, rel=1e-15)
    assert shape.rope_yarn_factor == params["factor"]
    assert shape.rope_yarn_original_max_position_embeddings == params["original_max_position_embeddings"]
    assert (shape.rope_yarn_beta_fast, shape.rope_yarn_beta_slow) == (params.get("beta_fast", 32),
                                                                      params.get("beta_slow", 1))
    assert shape.megatron_yarn_attributes()["yarn_correction_range_round_to_int"] is params.get("truncate", True)


def test_yarn_original_length_defaults_as_transformers(hf_configs):
    """Without original_max_position_embeddings transformers takes the top-level one, else max_position_embeddings
    (`standardize_rope_params`); vLLM reads transformers' config object, so the same."""
    base = {**hf_configs["llama"], "max_position_embeddings": 64}
    params = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}
    shape = ModelShape.from_hf_config({**base, "rope_parameters": params})
    assert shape.rope_yarn_original_max_position_embeddings == 64
    shape = ModelShape.from_hf_config({**base, "rope_parameters": params, "original_max_position_embeddings": 16})
    assert shape.rope_yarn_original_max_position_embeddings == 16
    # vLLM's cos/sin table (16 x 2 positions) caps the exact length below max_position_embeddings
    assert shape.max_exact_sequence_length == 32


@pytest.mark.parametrize("config, message", [
    ({"architectures": ["GPTNeoXForCausalLM"]}, "GPTNeoXForCausalLM"),
    ({"architectures": ["LlamaForCausalLM", "Qwen2ForCausalLM"]}, "LlamaForCausalLM"),
    ({"model_type": "gpt2"}, "gpt2"),
])
def test_unsupported_architecture_names_value_and_supported(config, message):
    with pytest.raises(UnsupportedModelError) as info:
        ModelShape.from_hf_config(config)
    assert message in str(info.value)
    for supported in SUPPORTED_ARCHITECTURES:
        assert supported in str(info.value)


@pytest.mark.parametrize("change, message", [
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 4096}},
     r"rope_type='llama3' with original_max_position_embeddings=4096 .*original_max_position_embeddings=8192"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192}}, r"rope_parameters.factor=None"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5, "original_max_position_embeddings": 32}},
     r"rope_parameters.factor=None: rope_type 'yarn' needs its factor.*vLLM 0.32 does not infer"),
    ({"rope_scaling": {"type": "yarn", "factor": 0.5}}, r"rope_scaling.factor=0.5: rope_type 'yarn' needs"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "beta_fast": None}},
     r"rope_parameters.beta_fast=None is not supported: transformers replaces .* by 32, vLLM 0.32 uses"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "beta_slow": 0}},
     r"rope_parameters.beta_slow=0 is not supported: .*valid: a number > 0, or no beta_slow \(1\)"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "attention_factor": 0.0}},
     r"rope_parameters.attention_factor=0.0: YaRN's attention factor"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "truncate": "yes"}},
     r"rope_parameters.truncate='yes' must be true or false"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "mscale": "1"}},
     r"rope_parameters.mscale='1' must be a number"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                          "original_max_position_embeddings": 16}, "original_max_position_embeddings": 32},
     r"rope_parameters.original_max_position_embeddings=16 differs from the top-level .*=32"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                          "original_max_position_embeddings": 32.5}},
     r"rope_parameters.original_max_position_embeddings=32.5: YaRN needs"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 5e5, "factor": 4.0}}, "'longrope' is not supported"),
    ({"rope_scaling": {"type": "linear", "factor": 0.5}}, r"rope_scaling.factor=0.5: rope_type 'linear' needs"),
    ({"rope_scaling": {"type": "dynamic", "alpha": 2.0}}, "alpha=2.0 is not supported"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     r"rope_parameters.partial_rotary_factor=0.5 .*vLLM 0.32 rotates only"),
    ({"rope_parameters": None, "rope_theta": 1e4, "partial_rotary_factor": 0.5}, r"^partial_rotary_factor=0.5 is not"),
    ({"num_hidden_layers": 4, "layer_types": ["full_attention"] * 4}, None),  # Llama: not read, by anyone
    ({"hidden_act": "gelu"}, "gelu"),
    ({"attention_bias": True}, "attention_bias"),
    ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
])
def test_unrepresentable_configs_are_refused(hf_configs, change, message):
    config = {**hf_configs["llama"], **change}
    if message is None:
        ModelShape.from_hf_config(config)
        return
    with pytest.raises(UnsupportedModelError, match=message):
        ModelShape.from_hf_config(config)


def test_qwen2_head_dim_other_than_hidden_over_heads_is_refused(hf_configs):
    """transformers' Qwen2 attention reads config.json's head_dim, vLLM 0.32's takes hidden_size // heads."""
    with pytest.raises(UnsupportedModelError, match=r"head_dim=32 .*valid: 16 or no head_dim"):
        ModelShape.from_hf_config({**hf_configs["qwen2"], "head_dim": 32})
    assert ModelShape.from_hf_config({**hf_configs["qwen2"], "head_dim": 16}).head_dim == 16


def test_parallel_errors_are_collected(hf_configs):
    shape = ModelShape.from_hf_config(hf_configs["llama"])
    errors = shape.parallel_errors(tp=3, pp=3)
    assert any("num_attention_heads=4" in e for e in errors)
    assert any("num_hidden_layers=4" in e for e in errors)
    assert shape.parallel_errors(tp=4, pp=2, vpp=2) == []  # tp > kv heads is supported
    with pytest.raises(ParallelLayoutError, match="tp=8 does not divide num_attention_heads=4"):
        shape.check_parallel(tp=8)
    with pytest.raises(ParallelLayoutError, match="vpp=2 needs pp >= 2"):
        shape.check_parallel(pp=1, vpp=2)


def test_padded_vocab_follows_megatron_rule():
    assert padded_vocab_size(200, 1) == 256
    assert padded_vocab_size(200, 2) == 256
    assert padded_vocab_size(200, 4) == 512
    assert padded_vocab_size(151936, 1) == 151936  # Qwen2 vocab is already a multiple of 128
    assert padded_vocab_size(151936, 8) == 152576


def _megatron_config(num_layers: int, pp: int, vpp: int | None, first: int | None = None,
                     last: int | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp, num_layers=num_layers,
        pipeline_model_parallel_layout=None, num_layers_in_first_pipeline_stage=first,
        num_layers_in_last_pipeline_stage=last, account_for_embedding_in_pipeline_split=False,
        account_for_loss_in_pipeline_split=False,
    )


def _megatron_chunk(config: object, pp_rank: int, vp_stage: int | None) -> tuple[int, int]:
    """(first layer, layers) megatron builds in that chunk."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return (get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank),
            get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank))


@pytest.mark.parametrize("num_layers, pp, vpp, first, last", [
    (4, 1, None, None, None), (4, 2, None, None, None), (8, 2, 2, None, None), (12, 3, 2, None, None),
    (8, 4, 2, None, None),
    # uneven: megatron's num_layers_in_first/last_pipeline_stage
    (4, 2, None, 1, 3), (4, 2, None, 3, 1), (4, 2, None, 1, None), (4, 2, None, None, 3),
    (30, 2, None, 16, None), (10, 4, None, 1, 3), (12, 3, 2, 4, None), (14, 4, 2, 2, 4),
])
def test_stage_chunks_match_megatron_layer_offsets(num_layers, pp, vpp, first, last):
    layout = ParallelLayout(tp=1, pp=pp, vpp=vpp, first_stage_layers=first, last_stage_layers=last)
    config = _megatron_config(num_layers, pp, vpp, first, last)
    owned = []
    for pp_rank in range(pp):
        for chunk in layout.chunks(num_layers, pp_rank):
            assert (chunk.first_layer, chunk.num_layers) == _megatron_chunk(config, pp_rank, chunk.vp_stage)
            owned.extend(chunk.layers)
    assert sorted(owned) == list(range(num_layers))
    firsts = [c for c in layout.all_chunks(num_layers) if c.pre_process]
    lasts = [c for c in layout.all_chunks(num_layers) if c.post_process]
    assert len(firsts) == len(lasts) == 1 and firsts[0].first_layer == 0
    assert lasts[0].layers[-1] == num_layers - 1
    assert layout.owner_of_layer(num_layers, num_layers - 1)[0] == lasts[0]


def test_indivisible_even_pipeline_is_refused():
    with pytest.raises(ParallelLayoutError, match="num_hidden_layers=4 is not divisible by pp\\*vpp=3"):
        ParallelLayout(pp=3).chunks(4, 0)


def test_stage_split_rule_is_megatrons():
    """`split_errors` accepts exactly the splits megatron-core builds: its TransformerConfig accepts
    them and its offset and layer-count functions give every chunk >= 1 layer (megatron itself lets
    first + last exceed the layers at PP >= 3, building negative counts; and divides by zero with VPP
    and no middle stage: both refused here)."""
    from megatron.core.transformer import TransformerConfig

    cases = 0
    for num_layers, pp, vpp in [(4, 2, None), (6, 3, None), (8, 4, 2), (12, 3, 2), (8, 2, 2), (5, 2, None)]:
        for first, last in itertools.product([None, 0, 1, 2, 3, 4, 6], repeat=2):
            try:
                config = TransformerConfig(
                    num_layers=num_layers, hidden_size=8, num_attention_heads=2, pipeline_model_parallel_size=pp,
                    virtual_pipeline_model_parallel_size=vpp, num_layers_in_first_pipeline_stage=first,
                    num_layers_in_last_pipeline_stage=last, pipeline_dtype=torch.float32)
                built = [_megatron_chunk(config, p, v) for p in range(pp) for v in range(vpp or 1)]
                megatron_ok = all(count >= 1 for _, count in built)
            except (ValueError, AssertionError, ZeroDivisionError):
                megatron_ok = False
            layout = ParallelLayout(pp=pp, vpp=vpp, first_stage_layers=first, last_stage_layers=last)
            errors = layout.split_errors(num_layers)
            assert megatron_ok == (not errors), (num_layers, pp, vpp, first, last, errors)
            if megatron_ok:
                mine = [(c.first_layer, c.num_layers) for p in range(pp) for c in layout.chunks(num_layers, p)]
                assert mine == built
                cases += 1
            else:
                with pytest.raises(ParallelLayoutError):
                    layout.chunks(num_layers, 0)
    assert cases > 20  # the grid holds enough accepted splits to compare


def test_stage_split_errors_name_the_rule():
    assert ParallelLayout(pp=1, first_stage_layers=2).split_errors(4) == [
        "first_stage_layers / last_stage_layers need pp >= 2 (got pp=1)"]
    assert ParallelLayout(pp=2, first_stage_layers=1, last_stage_layers=2).split_errors(4) == [
        "first_stage_layers=1, last_stage_layers=2 must add up to the 4 layers at pp=2"]
    assert ParallelLayout(pp=2, first_stage_layers=4).split_errors(4) == [
        "first_stage_layers=4, last_stage_layers=None leave 0 of the 4 layers for 1 more stage(s): every "
        "stage needs at least 1"]
    assert ParallelLayout(pp=3, vpp=2, first_stage_layers=3).split_errors(12) == ["first_stage_layers=3 is not "
                                                                                   "divisible by vpp=2"]
    assert ParallelLayout(pp=2, vpp=2, first_stage_layers=2, last_stage_layers=2).split_errors(4) == [
        "first_stage_layers=2, last_stage_layers=2 with vpp=2 needs a middle stage (pp >= 3), or only one of "
        "them set"]
    assert ParallelLayout(pp=2, first_stage_layers=1).stage_layers(4) == (1, 3)
    assert ParallelLayout(pp=4, last_stage_layers=1).stage_layers(10) == (3, 3, 3, 1)
    assert ParallelLayout(pp=4).stage_layers(8) == (2, 2, 2, 2)


def _materialize(shape: ModelShape, plan, hf: dict[str, torch.Tensor]) -> torch.Tensor:
    parts = []
    for seg in plan.segments:
        if seg.hf_name is None:
            pad = list(plan.shape)
            pad[plan.axis or 0] = seg.length
            parts.append(torch.zeros(pad))
        elif plan.axis is None:
            parts.append(hf[seg.hf_name])
        else:
            parts.append(hf[seg.hf_name].narrow(plan.axis, seg.start, seg.length))
    return torch.cat(parts, dim=plan.axis or 0)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shards_cover_every_hf_element_once(hf_configs, arch, tp):
    """Label every HF element uniquely, shard, and check each label lands exactly once (pads aside)."""
    shape = ModelShape.from_hf_config(hf_configs[arch])
    layout = ParallelLayout(tp=tp, pp=2)
    offset, hf = 1, {}
    for name, dims in hf_tensor_shapes(shape).items():
        numel = torch.Size(dims).numel()
        hf[name] = torch.arange(offset, offset + numel, dtype=torch.float64).reshape(dims)
        offset += numel
    seen: list[torch.Tensor] = []
    for pp_rank in range(layout.pp):
        for tp_rank in range(tp):
            for plan in rank_tensor_plans(shape, layout, tp_rank, pp_rank).values():
                tensor = _materialize(shape, plan, hf)
                assert tuple(tensor.shape) == plan.shape
                if not plan.is_copy:
                    seen.append(tensor.flatten())
    labels = torch.cat(seen)
    labels = labels[labels > 0]
    assert labels.numel() == offset - 1
    assert torch.equal(labels.sort().values, torch.arange(1, offset, dtype=torch.float64))
    hf_export_map(shape, layout)  # raises if any HF tensor is not covered exactly once


def test_fused_qkv_is_grouped_and_split_contiguously(hf_configs):
    shape = ModelShape.from_hf_config(hf_configs["llama"])  # 4 q heads, 2 kv heads, head_dim 16
    order = fused_qkv_order(shape, 0)
    assert [(s.hf_name.split(".")[-2], s.start, s.stop) for s in order] == [
        ("q_proj", 0, 32), ("k_proj", 0, 16), ("v_proj", 0, 16),
        ("q_proj", 32, 64), ("k_proj", 16, 32), ("v_proj", 16, 32),
    ]
    chunk = ParallelLayout(tp=2).chunks(4, 0)[0]
    qkv = {p.name: p for p in chunk_tensor_plans(shape, ParallelLayout(tp=2), chunk, 1)}
    rank1 = qkv["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert rank1.segments == tuple(order[3:])
    # tp=4 > 2 KV heads: each rank holds a contiguous quarter of the fused rows (megatron gathers).
    chunk4 = ParallelLayout(tp=4).chunks(4, 0)[0]
    quarter = [p for p in chunk_tensor_plans(shape, ParallelLayout(tp=4), chunk4, 1)
               if p.name.endswith("linear_qkv.weight")][0]
    assert [(s.hf_name.split(".")[-2], s.start, s.stop) for s in quarter.segments] == [
        ("k_proj", 0, 16), ("v_proj", 0, 16)
    ]
    fc1 = [p for p in chunk_tensor_plans(shape, ParallelLayout(tp=2), chunk, 1)
           if p.name.endswith("linear_fc1.weight")][0]
    assert [(s.hf_name.split(".")[-2], s.start, s.stop) for s in fc1.segments] == [
        ("gate_proj", 48, 96), ("up_proj", 48, 96)
    ]


def test_vocab_range_for_rank(hf_configs):
    shape = ModelShape.from_hf_config(hf_configs["llama"])  # vocab 200, padded 256 at tp 2
    assert vocab_range_for_rank(shape, 0, 2) == (0, 128)
    assert vocab_range_for_rank(shape, 1, 2) == (128, 200)
    assert vocab_range_for_rank(shape, 3, 4) == (200, 200)  # all padding on the last of 4 ranks


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 2), (4, 1)])
def test_rank_numel_adds_up_to_param_count(hf_configs, arch, tp, pp):
    shape = ModelShape.from_hf_config(hf_configs[arch])
    layout = ParallelLayout(tp=tp, pp=pp)
    per_rank = [rank_numel(shape, layout, t, p) for p in range(pp) for t in range(tp)]
    padding = (shape.padded_vocab_size(tp) - shape.vocab_size) * shape.hidden_size
    copies = 0
    for p in range(pp):
        for t in range(tp):
            for plan in rank_tensor_plans(shape, layout, t, p).values():
                if plan.is_copy:
                    copies += torch.Size(plan.shape).numel()
    padded_tables = 1 if shape.tie_word_embeddings else 2  # copies (replicated norms, a tied
    # output layer on the last stage) are counted in full, padding included, in `copies`
    assert sum(per_rank) == shape.param_count() + padded_tables * padding + copies
    assert max_rank_numel(shape, layout) == max(per_rank)


def test_every_family_file_is_registered_and_names_each_weight_once():
    """A family file under models/families/ that the registry does not list would be silently
    unsupported; and a table that names an HF or vLLM tensor twice would load one of them twice."""
    import pkgutil

    import hybridrl.models.families as families
    from hybridrl.models.layout import table_specs

    modules = {info.name for info in pkgutil.iter_modules(families.__path__)}
    registered = {family.model_type for family in SUPPORTED_ARCHITECTURES.values()}
    assert modules == registered == {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral"}
    for arch, family in SUPPORTED_ARCHITECTURES.items():
        config = dict(architectures=[arch], hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=96, num_hidden_layers=2, vocab_size=100, tie_word_embeddings=False,
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1])
        shape = ModelShape.from_hf_config(config)
        specs = list(table_specs(shape))
        hf = [t.at(layer, expert) for spec, layer, expert in specs for t in spec.hf]
        # vLLM stacks a layer's experts in one parameter: one name per (weight, layer)
        vllm = [spec.vllm.format(i=layer) for spec, layer, expert in specs if not expert]
        assert len(hf) == len(set(hf)) and len(vllm) == len(set(vllm)), arch
        assert shape.is_moe == family.moe, arch
        assert shape.weights is family.weights


def test_the_transformer_config_builds_without_megatrons_deprecation_warning(hf_configs):
    """megatron's default cuda_graph_scope "full" is deprecated (a warning at every config built, in every worker):
    the bridge passes its replacement, the empty list, which megatron turns "full" into (the same scope)."""
    import warnings

    from hybridrl.models.arch import ModelShape
    from hybridrl.models.bridge import transformer_config

    shape = ModelShape.from_hf_config(hf_configs["llama"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = transformer_config(shape, 1, 1, None, device="cuda", dtype=torch.bfloat16)
    assert config.cuda_graph_scope == []
    assert not [w for w in caught if "scope" in str(w.message)], [str(w.message) for w in caught]
