"""Our megatron GPTModels give transformers' logits for the same weights, on real gloo process groups.

Each test forks tp*pp ranks (`run_ranks`), builds this rank's chunks with `build_gpt_models`, loads
weights through the layout math and runs megatron's own pipeline schedule (forward only); the last
stage gathers the vocab-parallel logits. The parent compares them with HF's eager forward.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridrl.models.arch import ModelShape
from tests.support.forked import run_ranks
from tests.support.model_passes import grads_rank, pipeline_logits
from tests.support.models_fixtures import (
    ARCHS,
    VOCAB,
    assert_same_tensors,
    hf_logits,
    hf_model_dirs,
    make_hf_model,
    max_logit_error,
    per_file_state,
    read_json,
    safetensors_state,
    sample_tokens,
)

TOLERANCE = 1e-5  # max abs logits difference, fp32
TOKENS = sample_tokens(batch=2)


# ---- rank side ---------------------------------------------------------------------------------------



def _corrupt(models: list[Any], kind: str, hf_dir: str) -> None:
    """Deliberately wrong layouts that a careless converter would produce."""
    from safetensors.torch import load_file

    from hybridrl.parallel.state import get_context

    hf = load_file(str(Path(hf_dir) / "model.safetensors"))
    ctx = get_context()
    with torch.no_grad():
        for model in models:
            for layer in model.decoder.layers:
                i = layer.layer_number - 1
                if kind == "plain_qkv_concat":  # [q; k; v] instead of per-group interleaving (TP=1)
                    qkv = torch.cat([hf[f"model.layers.{i}.self_attn.{p}_proj.weight"] for p in "qkv"])
                    layer.self_attention.linear_qkv.weight.copy_(qkv)
                elif kind == "split_gate_up_concat":  # contiguous TP split of [gate; up]
                    full = torch.cat([hf[f"model.layers.{i}.mlp.{p}_proj.weight"] for p in ("gate", "up")])
                    layer.mlp.linear_fc1.weight.copy_(full.chunk(ctx.tp)[ctx.tp_rank])


def _logits_rank(rank: int, world_size: int, tp: int, pp: int, vpp: int | None,
                 cases: list[tuple[str, str, str]], corrupt: str | None = None,
                 save_to: dict[str, str] | None = None,
                 split: tuple[int | None, int | None] = (None, None)) -> dict[str, Any]:
    """For each (name, model source, weights path): build, load, forward; optionally save/export.
    `split`: layers on the (first, last) pipeline stage, None = even."""
    from hybridrl.models.bridge import build_gpt_models, export_hf, load_weights, save_mcore_checkpoint
    from hybridrl.parallel.state import destroy_model_parallel, initialize_model_parallel

    initialize_model_parallel(tp=tp, pp=pp, vpp=vpp, device="cpu", first_stage_layers=split[0],
                              last_stage_layers=split[1])
    out: dict[str, Any] = {}
    try:
        for name, source, weights in cases:
            models = build_gpt_models(source)
            load_weights(models, weights)
            if corrupt:
                out[name + ":good"] = pipeline_logits(models, TOKENS)
                _corrupt(models, corrupt, weights)
            out[name] = pipeline_logits(models, TOKENS)
            if save_to:
                save_mcore_checkpoint(models, Path(save_to["mcore"]) / name)
                export_hf(models, Path(save_to["hf"]) / name)
    finally:
        destroy_model_parallel()
    return out


def _log_prob_rank(rank: int, world_size: int, hf_dir: str) -> dict[str, torch.Tensor]:
    """TP-sharded log-probs of the next tokens, with and without masking the vocab padding."""
    from hybridrl.algorithms.vocab_parallel import vocab_parallel_log_prob
    from hybridrl.models.bridge import build_gpt_model, load_weights, mask_vocab_padding
    from hybridrl.parallel.state import destroy_model_parallel, initialize_model_parallel

    ctx = initialize_model_parallel(tp=world_size, device="cpu")
    try:
        model = build_gpt_model(hf_dir)
        load_weights([model], hf_dir)
        model.eval()
        ids, labels = TOKENS[:, :-1], TOKENS[:, 1:]
        with torch.no_grad():
            shard = model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)
            masked = mask_vocab_padding(shard, VOCAB, ctx.tp_rank, ctx.tp)
            return {"masked": vocab_parallel_log_prob(masked, labels, ctx.tp_group),
                    "unmasked": vocab_parallel_log_prob(shard, labels, ctx.tp_group)}
    finally:
        destroy_model_parallel()


def _rope_rank(rank: int, world_size: int, tp: int, pp: int, hf_dir: str, tokens: torch.Tensor) -> dict[str, Any]:
    """Logits (last stage) and each chunk's rotary inverse frequencies of the megatron model of `hf_dir`."""
    from hybridrl.models.bridge import build_gpt_models, load_weights
    from hybridrl.parallel.state import destroy_model_parallel, initialize_model_parallel

    initialize_model_parallel(tp=tp, pp=pp, device="cpu")
    try:
        models = build_gpt_models(hf_dir)
        load_weights(models, hf_dir)
        return {"logits": pipeline_logits(models, tokens),
                "inv_freq": [model.rotary_pos_emb.inv_freq.clone() for model in models]}
    finally:
        destroy_model_parallel()


def _yarn_rank(rank: int, world_size: int, tp: int, hf_dirs: dict[str, str], tokens: torch.Tensor) -> dict[str, Any]:
    """For each YaRN model: logits (also with megatron's default softmax scale, the attention factor dropped) and the
    rotary angles megatron's YarnRotaryEmbedding gives the tokens' positions."""
    from hybridrl.models.bridge import build_gpt_models, load_weights
    from hybridrl.parallel.state import destroy_model_parallel, initialize_model_parallel

    initialize_model_parallel(tp=tp, device="cpu")
    out: dict[str, Any] = {}
    try:
        for name, hf_dir in hf_dirs.items():
            for suffix, overrides in (("", {}), (":no_softmax_scale", {"softmax_scale": None})):
                models = build_gpt_models(hf_dir, config_overrides=overrides)
                load_weights(models, hf_dir)
                out[name + suffix] = pipeline_logits(models, tokens)
            emb, mscale = models[0].rotary_pos_emb(tokens.shape[1])
            out[name + ":angles"], out[name + ":mscale"] = emb.cpu(), mscale
    finally:
        destroy_model_parallel()
    return out


def _bad_build_rank(rank: int, world_size: int, source: str, weights: str) -> str:
    """Build and load, returning the error message each rank raises (every rank must refuse)."""
    from hybridrl.models.bridge import build_gpt_models, load_weights
    from hybridrl.parallel.state import destroy_model_parallel, initialize_model_parallel

    initialize_model_parallel(tp=world_size, device="cpu")
    try:
        load_weights(build_gpt_models(source), weights)
    except Exception as exc:  # noqa: BLE001 - the message is what the test checks
        return f"{type(exc).__name__}: {exc}"
    finally:
        destroy_model_parallel()
    return "no error"


def _save_with_data_parallel_rank(rank: int, world_size: int, hf_dir: str, out: str) -> int:
    """TP=2 x DP=2: load, then save and export collectively (only DP rank 0 of each TP rank writes)."""
    from hybridrl.models.bridge import build_gpt_models, export_hf, load_weights, save_mcore_checkpoint
    from hybridrl.parallel.state import destroy_model_parallel, initialize_model_parallel

    ctx = initialize_model_parallel(tp=2, device="cpu")
    try:
        models = build_gpt_models(hf_dir)
        load_weights(models, hf_dir)
        save_mcore_checkpoint(models, Path(out) / "mcore")
        export_hf(models, Path(out) / "hf")
    finally:
        destroy_model_parallel()
    return ctx.dp




def _run(tp: int, pp: int, vpp: int | None, cases, **kwargs) -> dict[str, torch.Tensor]:
    results = run_ranks(_logits_rank, tp * pp, tp, pp, vpp, cases, timeout_s=300, **kwargs)
    last_stage = [r for r in results if any(v is not None for v in r.values())]
    assert len(last_stage) == tp, "every TP rank of the last stage returns logits"
    for other in last_stage[1:]:  # TP peers gathered the same full logits
        for key, value in other.items():
            assert torch.equal(value, last_stage[0][key]), key
    return last_stage[0]


# ---- parent side -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    return hf_model_dirs(tmp_path_factory.mktemp("logits_hf"), ARCHS, first_seed=10)


@pytest.fixture(scope="module")
def reference(hf_dirs) -> dict[str, torch.Tensor]:
    return {arch: hf_logits(path, TOKENS) for arch, path in hf_dirs.items()}




@pytest.mark.parametrize("tp, pp, vpp, split", [
    (1, 1, None, (None, None)), (2, 1, None, (None, None)), (1, 2, None, (None, None)), (2, 2, None, (None, None)),
    # uneven stages of the 4-layer models: 1 + 3 and 3 + 1 layers
    (1, 2, None, (1, None)), (1, 2, None, (None, 1)),
])
def test_logits_match_transformers(hf_dirs, reference, tp, pp, vpp, split):
    cases = [(arch, str(hf_dirs[arch]), str(hf_dirs[arch])) for arch in ARCHS]
    logits = _run(tp, pp, vpp, cases, split=split)
    errors = {arch: max_logit_error(logits[arch], reference[arch]) for arch in ARCHS}
    assert all(err <= TOLERANCE for err in errors.values()), errors


def test_logits_match_with_virtual_pipeline(hf_dirs, reference):
    cases = [(arch, str(hf_dirs[arch]), str(hf_dirs[arch])) for arch in ("llama", "qwen3")]
    logits = _run(1, 2, 2, cases)
    for arch in ("llama", "qwen3"):
        assert max_logit_error(logits[arch], reference[arch]) <= TOLERANCE


def test_logits_match_with_tp_above_kv_heads(hf_dirs, reference):
    """TP=4 over 2 KV heads: each KV head is shared by two TP ranks."""
    cases = [(arch, str(hf_dirs[arch]), str(hf_dirs[arch])) for arch in ("llama", "qwen2")]
    logits = _run(4, 1, None, cases)
    for arch in ("llama", "qwen2"):
        assert logits[arch].shape[-1] == 512  # vocab 200 padded to 128 * 4
        assert max_logit_error(logits[arch], reference[arch]) <= TOLERANCE


# Llama 3.2's RoPE scaling (3.1's with factor 8): with head_dim 16 and this base the frequencies fall in all
# three of its bands (kept, smoothed, divided by the factor).
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_llama3_rope_scaling_gives_transformers_logits(tmp_path, tp, pp):
    """`rope_type: llama3` (every Llama 3.1-3.3 checkpoint) runs as megatron's own `rope_scaling`: its inverse
    frequencies are transformers', and so are the logits over 200 positions, where plain RoPE's differ 40x more
    than the tolerance."""
    import transformers

    folder = make_hf_model(tmp_path / "llama3", "llama", rope_theta=None, rope_parameters=LLAMA3_ROPE,
                           max_position_embeddings=131072)
    tokens = sample_tokens(batch=1, seq=200)
    results = run_ranks(_rope_rank, tp * pp, tp, pp, str(folder), tokens)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for result in results:
        for inv_freq in result["inv_freq"]:
            torch.testing.assert_close(inv_freq, hf.model.rotary_emb.inv_freq, rtol=1e-6, atol=0)
    reference = hf_logits(folder, tokens)
    assert max_logit_error(results[-1]["logits"], reference) <= TOLERANCE
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "model.safetensors").symlink_to(folder / "model.safetensors")
    config = read_json(folder / "config.json")
    (plain / "config.json").write_text(json.dumps({**config, "rope_parameters": {"rope_type": "default",
                                                                                "rope_theta": 500000.0}}))
    assert max_logit_error(results[-1]["logits"], hf_logits(plain, tokens)) > 10 * TOLERANCE


# YaRN as Qwen2.5/Qwen3 ship it for long context (`factor` x `original_max_position_embeddings`), with the original
# context 32 tokens so that 100-token sequences run far past it; one of transformers' implicit attention factor
# (0.1 ln 4 + 1), one of an explicit attention factor with the ramp's bounds not rounded and another beta_fast, and one
# of the factor inferred from mscale / mscale_all_dim.
YARN_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2_yarn": ("qwen2", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                 "original_max_position_embeddings": 32},
                           "max_position_embeddings": 128}),
    "llama_yarn_explicit": ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                          "original_max_position_embeddings": 32,
                                                          "attention_factor": 1.3, "truncate": False,
                                                          "beta_fast": 16},
                                      "max_position_embeddings": 128}),
    "qwen3_yarn_mscale": ("qwen3", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                                                        "original_max_position_embeddings": 32, "mscale": 1.0,
                                                        "mscale_all_dim": 0.5},
                                    "max_position_embeddings": 256}),
}
YARN_SEQ = 100


def test_yarn_rope_gives_transformers_logits(tmp_path):
    """`rope_type: yarn` runs as megatron's YarnRotaryEmbedding with transformers' attention factor in the softmax
    scale: at TP2 the rotary angles are transformers' (cos and sin, times the attention factor, as its rotary module
    gives them), megatron's own rotary factor is 1, and the logits over 100 positions (past the original 32) equal
    transformers'. With megatron's default softmax scale (the attention factor dropped, as GPTModel drops it) they do
    not: the negative control."""
    import transformers

    folders = {name: make_hf_model(tmp_path / name, arch, seed=60 + i, rope_theta=None, **overrides)
               for i, (name, (arch, overrides)) in enumerate(YARN_MODELS.items())}
    tokens = sample_tokens(batch=1, seq=YARN_SEQ)
    results = run_ranks(_yarn_rank, 2, 2, {name: str(path) for name, path in folders.items()}, tokens,
                        timeout_s=300)
    errors, dropped = {}, {}
    for name, folder in folders.items():
        shape = ModelShape.from_hf_dir(folder)
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).model
        positions = torch.arange(YARN_SEQ)[None]
        hf_cos, hf_sin = hf.rotary_emb(torch.zeros(1, YARN_SEQ, 1), positions)
        assert hf.rotary_emb.attention_scaling == pytest.approx(shape.rope_yarn_attention_factor, rel=1e-12), name
        for result in results:
            angles = result[name + ":angles"][:, 0, 0]
            assert result[name + ":mscale"] == 1.0  # ModelShape.megatron_yarn_attributes: mscale == mscale_all_dim
            factor = shape.rope_yarn_attention_factor
            torch.testing.assert_close(angles.cos() * factor, hf_cos[0], rtol=0, atol=2e-6)
            torch.testing.assert_close(angles.sin() * factor, hf_sin[0], rtol=0, atol=2e-6)
        reference = hf_logits(folder, tokens)
        assert torch.equal(results[0][name], results[1][name])
        errors[name] = max_logit_error(results[0][name], reference)
        dropped[name] = max_logit_error(results[0][name + ":no_softmax_scale"], reference)
    print("yarn max |logit gap|:", errors, "attention factor dropped:", dropped)
    assert all(err <= TOLERANCE for err in errors.values()), errors
    assert all(err > 10 * TOLERANCE for err in dropped.values()), dropped


# config.json settings read as transformers reads them (each a tiny model of its own): Qwen2's window on no layer
# (max_window_layers = the layer count), linear RoPE scaling (megatron's seq_len_interpolation_factor) and dynamic NTK
# scaling (plain RoPE up to max_position_embeddings, 64 here).
READ_AS_TRANSFORMERS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2_window_on_no_layer": ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 4}),
    "llama_linear_rope": ("llama", {"rope_theta": None, "rope_parameters": {"rope_type": "linear",
                                                                         "rope_theta": 10000.0, "factor": 4.0}}),
    "llama_dynamic_rope": ("llama", {"rope_theta": None, "rope_parameters": {"rope_type": "dynamic",
                                                                          "rope_theta": 10000.0, "factor": 4.0}}),
}


def test_config_settings_read_as_transformers_give_its_logits(tmp_path):
    """At TP2 each model's logits over 12 tokens equal transformers' for the same config.json; and each setting
    changes them (against the model without it: Qwen2's 8-token window on every layer, plain RoPE), so reading it
    matters."""
    folders = {name: make_hf_model(tmp_path / name, arch, seed=40 + i, **overrides)
               for i, (name, (arch, overrides)) in enumerate(READ_AS_TRANSFORMERS.items())}
    logits = _run(2, 1, None, [(name, str(path), str(path)) for name, path in folders.items()])
    for name, path in folders.items():
        assert max_logit_error(logits[name], hf_logits(path, TOKENS)) <= TOLERANCE, name
    unlike = {"qwen2_window_on_no_layer": {"max_window_layers": 0, "layer_types": None},
              "llama_linear_rope": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}}
    for name, change in unlike.items():
        other = tmp_path / f"{name}_unlike"
        other.mkdir()
        (other / "model.safetensors").symlink_to(folders[name] / "model.safetensors")
        config = {**read_json(folders[name] / "config.json"), **change}
        (other / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
        assert max_logit_error(logits[name], hf_logits(other, TOKENS)) > 10 * TOLERANCE, name


def test_vllm_rotates_these_configs_as_transformers(tmp_path):
    """vLLM reads the same config.json for the rollout: its RoPE module for linear, dynamic and YaRN scaling (the one
    its Llama and Qwen attention builds, from the config vLLM loads; transformers 4's `rope_scaling` key too) rotates
    queries and keys as transformers' does (YaRN's attention factor included), at every position the plan allows."""
    import transformers
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.transformers_utils.config import get_config

    legacy = {"rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 4.0}}
    for name in ("llama_linear_rope", "llama_dynamic_rope", "legacy_linear", *YARN_MODELS):
        arch, overrides = {**READ_AS_TRANSFORMERS, **YARN_MODELS}.get(name, READ_AS_TRANSFORMERS["llama_linear_rope"])
        folder = make_hf_model(tmp_path / name, arch, **{"rope_theta": None, **overrides})
        if name == "legacy_linear":  # transformers 4's keys
            config = {k: v for k, v in read_json(folder / "config.json").items() if k != "rope_parameters"}
            (folder / "config.json").write_text(json.dumps({**config, **legacy}))
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).model
        vllm_config = get_config(str(folder), trust_remote_code=False)
        shape = ModelShape.from_hf_dir(folder)
        d, n = shape.head_dim, shape.max_exact_sequence_length
        with set_current_vllm_config(VllmConfig()):
            rope = get_rope(d, max_position=vllm_config.max_position_embeddings,
                            rope_parameters=vllm_config.rope_parameters, is_neox_style=True)
        positions = torch.arange(n)
        q, k = torch.randn(n, 4 * d), torch.randn(n, 2 * d)
        vllm_q, vllm_k = rope.forward_native(positions, q.clone(), k.clone())
        cos, sin = hf.rotary_emb(q[None], positions[None])
        hf_q, hf_k = apply_rotary_pos_emb(q.view(1, n, 4, d).transpose(1, 2), k.view(1, n, 2, d).transpose(1, 2),
                                          cos, sin)
        torch.testing.assert_close(vllm_q.view(n, 4, d), hf_q[0].transpose(0, 1), rtol=0, atol=1e-6)
        torch.testing.assert_close(vllm_k.view(n, 2, d), hf_k[0].transpose(0, 1), rtol=0, atol=1e-6)
        if name in YARN_MODELS:
            # the attention factor is in both (cos and sin scaled), and vLLM's table holds every exact position
            assert rope.mscale == pytest.approx(shape.rope_yarn_attention_factor, rel=1e-12) and rope.mscale != 1
            assert rope.cos_sin_cache.shape[0] >= shape.max_exact_sequence_length == 32 * shape.rope_yarn_factor
        else:
            assert shape.rope_linear_factor == (None if "dynamic" in name else 4.0)


@pytest.mark.parametrize("tp, corrupt", [(1, "plain_qkv_concat"), (2, "split_gate_up_concat")])
def test_wrong_layout_is_caught(hf_dirs, reference, tp, corrupt):
    logits = _run(tp, 1, None, [("llama", str(hf_dirs["llama"]), str(hf_dirs["llama"]))], corrupt=corrupt)
    assert max_logit_error(logits["llama:good"], reference["llama"]) <= TOLERANCE
    assert max_logit_error(logits["llama"], reference["llama"]) > 1e-2  # far outside fp32 noise


def test_export_from_sharded_model_and_reload(hf_dirs, reference, tmp_path):
    """A TP2xPP2 model exports HF bit-exactly and saves a checkpoint equal to the offline converter's;
    loading that checkpoint back, in the same or another layout, gives the same logits."""
    from hybridrl.models.convert_cli import main as convert_main

    arch = "qwen3"
    save_to = {"mcore": str(tmp_path / "mcore"), "hf": str(tmp_path / "hf")}
    _run(2, 2, None, [(arch, str(hf_dirs[arch]), str(hf_dirs[arch]))], save_to=save_to)
    assert_same_tensors(safetensors_state(tmp_path / "hf" / arch), safetensors_state(hf_dirs[arch]))
    offline = tmp_path / "offline"
    assert convert_main(["hf-to-mcore", "--hf", str(hf_dirs[arch]), "--out", str(offline),
                         "--tp", "2", "--pp", "2", "--quiet"]) == 0
    saved = tmp_path / "mcore" / arch
    assert_same_tensors(per_file_state(saved), per_file_state(offline))

    # Same layout (file -> parameters, checksums verified) and a different one (re-sliced).
    same = _run(2, 2, None, [("same", str(saved), str(saved))])
    other = _run(1, 2, None, [("other", str(saved), str(saved))])
    assert max_logit_error(same["same"], reference[arch]) <= TOLERANCE
    assert max_logit_error(other["other"], reference[arch]) <= TOLERANCE


def test_uneven_stages_save_export_and_resume_on_any_layout(hf_dirs, reference, tmp_path):
    """At uneven PP2 (1 + 3 layers) a model exports HF bit-exactly and saves what the offline converter
    writes for that layout; the checkpoint loads at PP1 and at even PP2 with HF's logits, and the
    converter re-shards it offline to PP1 and back to HF exactly."""
    from hybridrl.models.checkpoint import McoreMetadata
    from hybridrl.models.convert_cli import main as convert_main

    arch = "qwen3"  # tied embeddings: the last stage's copy of the embedding is on a 3-layer stage
    save_to = {"mcore": str(tmp_path / "mcore"), "hf": str(tmp_path / "hf")}
    _run(1, 2, None, [(arch, str(hf_dirs[arch]), str(hf_dirs[arch]))], save_to=save_to, split=(1, None))
    assert_same_tensors(safetensors_state(tmp_path / "hf" / arch), safetensors_state(hf_dirs[arch]))
    saved = tmp_path / "mcore" / arch
    meta = McoreMetadata.read(saved)
    assert meta.layout.first_stage_layers == 1
    assert [(c["pp_rank"], c["first_layer"], c["num_layers"]) for c in meta.raw["layer_chunks"]] == [
        (0, 0, 1), (1, 1, 3)]
    offline = tmp_path / "offline"
    assert convert_main(["hf-to-mcore", "--hf", str(hf_dirs[arch]), "--out", str(offline), "--pp", "2",
                         "--first-stage-layers", "1", "--quiet"]) == 0
    assert_same_tensors(per_file_state(saved), per_file_state(offline))

    pp1 = _run(1, 1, None, [("pp1", str(saved), str(saved))])
    even = _run(1, 2, None, [("even", str(saved), str(saved))])
    assert max_logit_error(pp1["pp1"], reference[arch]) <= TOLERANCE
    assert max_logit_error(even["even"], reference[arch]) <= TOLERANCE

    assert convert_main(["mcore-to-mcore", "--ckpt", str(saved), "--out", str(tmp_path / "to_pp1"), "--quiet"]) == 0
    assert convert_main(["hf-to-mcore", "--hf", str(hf_dirs[arch]), "--out", str(tmp_path / "pp1"), "--quiet"]) == 0
    assert_same_tensors(per_file_state(tmp_path / "to_pp1"), per_file_state(tmp_path / "pp1"))
    assert convert_main(["mcore-to-hf", "--ckpt", str(saved), "--out", str(tmp_path / "back"), "--quiet"]) == 0
    assert_same_tensors(safetensors_state(tmp_path / "back"), safetensors_state(hf_dirs[arch]))


def test_vocab_padding_must_be_masked_for_log_probs(hf_dirs, reference):
    """Padded vocab ids have logit 0: masked, the vocab-parallel log-probs equal HF's; unmasked, not."""
    out = run_ranks(_log_prob_rank, 2, str(hf_dirs["llama"]), timeout_s=300)
    expected = torch.log_softmax(reference["llama"][:, :-1], dim=-1).gather(-1, TOKENS[:, 1:, None])[..., 0]
    for rank_out in out:
        assert (rank_out["masked"] - expected).abs().max().item() <= TOLERANCE
        assert (rank_out["unmasked"] - expected).abs().max().item() > 1e-2


def test_live_model_refuses_bad_input(hf_dirs):
    mismatched = run_ranks(_bad_build_rank, 2, str(hf_dirs["qwen2"]), str(hf_dirs["llama"]), timeout_s=300)
    assert all("CheckpointError" in m and "Qwen2ForCausalLM" in m for m in mismatched), mismatched
    too_wide = run_ranks(_bad_build_rank, 3, str(hf_dirs["llama"]), str(hf_dirs["llama"]), timeout_s=300)
    assert all("tp=3 does not divide num_attention_heads=4" in m for m in too_wide), too_wide


def test_save_and_export_with_data_parallel_replicas(hf_dirs, tmp_path):
    from hybridrl.models.convert_cli import main as convert_main

    assert run_ranks(_save_with_data_parallel_rank, 4, str(hf_dirs["mistral"]), str(tmp_path)) == [2] * 4
    assert convert_main(["hf-to-mcore", "--hf", str(hf_dirs["mistral"]), "--out", str(tmp_path / "offline"),
                         "--tp", "2", "--quiet"]) == 0
    assert_same_tensors(per_file_state(tmp_path / "mcore"), per_file_state(tmp_path / "offline"))
    assert_same_tensors(safetensors_state(tmp_path / "hf"), safetensors_state(hf_dirs["mistral"]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "mcore", "offline"]  # no staging left


@pytest.mark.parametrize("arch, tp", [("llama", 4), ("qwen3", 2), ("qwen3", 4)])
def test_gradients_match_transformers(hf_dirs, tmp_path, arch, tp):
    """Training sees the same model: every weight gradient equals HF's, mapped back by the layout math
    (at TP=4 > 2 KV heads each KV head's gradient is summed over the ranks that share it)."""
    _assert_gradients_match_transformers(hf_dirs[arch], tmp_path, tp)


def test_yarn_gradients_match_transformers(tmp_path):
    """The same for a Qwen2 with YaRN (factor 4 over 4 original positions: every position past it), at TP2: the
    attention factor in the softmax scale reaches the gradients as transformers' scaled cos and sin do."""
    folder = make_hf_model(tmp_path / "qwen2_yarn", "qwen2", seed=70, rope_theta=None, max_position_embeddings=16,
                           rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                            "original_max_position_embeddings": 4})
    _assert_gradients_match_transformers(folder, tmp_path, 2)


def _assert_gradients_match_transformers(hf_dir: Path, tmp_path: Path, tp: int) -> None:
    import transformers

    from hybridrl.models.convert_cli import main as convert_main

    weights = torch.randn(*TOKENS.shape, VOCAB, generator=torch.Generator().manual_seed(3))
    run_ranks(grads_rank, tp, str(hf_dir), weights, str(tmp_path / "grads"), timeout_s=300)
    assert convert_main(["mcore-to-hf", "--ckpt", str(tmp_path / "grads"), "--out", str(tmp_path / "hf"),
                         "--quiet"]) == 0
    ours = safetensors_state(tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager")
    (model(TOKENS).logits * weights).sum().backward()
    theirs = {name: p.grad for name, p in model.named_parameters()}
    assert sorted(ours) == sorted(theirs)
    for name, grad in theirs.items():
        scale = grad.abs().max().item()
        assert (ours[name] - grad).abs().max().item() <= 1e-5 * max(scale, 1.0), name
