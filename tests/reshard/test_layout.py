"""`hybridrl.reshard.layout`: the HF -> vLLM per-rank layout, as pure math and against real vLLM.

The vLLM tests build engines in forked ranks (infer_tp=2 through external_launcher inside a gloo
group, as in a colocated trainer) and read back what vLLM's own loader put in its parameters. On CPU
vLLM repacks linear weights for oneDNN right after loading and empties the parameters; the engine's
`capture_loaded_weights=True` keeps the loaded tensors, held inside `process_weights_after_loading` just before
the repacking (see `hybridrl/rollout/vllm_patches.py`), which is what we compare with, bit for bit.
"""
from __future__ import annotations

import math

import pytest
import torch

from hybridrl.config.step_time import synced_tensors
from hybridrl.models.arch import ModelShape
from hybridrl.models.vllm_layout import vllm_padded_vocab, vllm_param_shapes
from hybridrl.parallel.digest import tensor_digest
from hybridrl.reshard.layout import hf_to_vllm_shards, vllm_shard_nbytes
from tests.support import rollout_scenarios
from tests.support.forked import run_ranks
from tests.support.rollout_models import (
    LLAMA_GQA1,
    QWEN2_TIED,
    QWEN3_QK_NORM,
    build_tiny_model,
    load_config,
    load_state_dict,
)

EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"  # HF's names, written here independently


def _config(**overrides) -> dict:
    config = dict(
        architectures=["LlamaForCausalLM"], hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=96, num_hidden_layers=2, vocab_size=100, tie_word_embeddings=False,
    )
    config.update(overrides)
    return config


def _indexed_state_dict(config: dict) -> dict[str, torch.Tensor]:
    """HF tensors whose entries encode (tensor id, row, column): any misplaced row is visible."""
    shape = ModelShape.from_hf_config(config)
    h, d = shape.hidden_size, shape.head_dim
    sizes = {
        EMBED: (shape.vocab_size, h), "model.norm.weight": (h,), LM_HEAD: (shape.vocab_size, h),
    }
    for i in range(shape.num_layers):
        p = f"model.layers.{i}"
        sizes.update({
            f"{p}.self_attn.q_proj.weight": (shape.num_attention_heads * d, h),
            f"{p}.self_attn.k_proj.weight": (shape.num_kv_heads * d, h),
            f"{p}.self_attn.v_proj.weight": (shape.num_kv_heads * d, h),
            f"{p}.self_attn.o_proj.weight": (h, shape.num_attention_heads * d),
            f"{p}.mlp.gate_proj.weight": (shape.ffn_hidden_size, h),
            f"{p}.mlp.up_proj.weight": (shape.ffn_hidden_size, h),
            f"{p}.mlp.down_proj.weight": (h, shape.ffn_hidden_size),
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.post_attention_layernorm.weight": (h,),
        })
        if shape.qkv_bias:
            for proj, rows in (("q", shape.num_attention_heads), ("k", shape.num_kv_heads), ("v", shape.num_kv_heads)):
                sizes[f"{p}.self_attn.{proj}_proj.bias"] = (rows * d,)
        if shape.qk_norm:
            sizes[f"{p}.self_attn.q_norm.weight"] = (d,)
            sizes[f"{p}.self_attn.k_norm.weight"] = (d,)
    if shape.tie_word_embeddings:
        del sizes[LM_HEAD]
    return {
        name: (1000 * tensor_id + torch.arange(math.prod(dims), dtype=torch.float64)).reshape(dims)
        for tensor_id, (name, dims) in enumerate(sorted(sizes.items()), start=1)
    }


def test_kv_heads_split_or_replicate_and_q_follows_rank():
    config = _config(num_attention_heads=4, num_key_value_heads=2)
    hf = _indexed_state_dict(config)
    q, k = hf["model.layers.0.self_attn.q_proj.weight"], hf["model.layers.0.self_attn.k_proj.weight"]
    v = hf["model.layers.0.self_attn.v_proj.weight"]
    d = 16
    # infer_tp=4 > 2 KV heads: ranks 0,1 hold KV head 0, ranks 2,3 hold KV head 1.
    for rank in range(4):
        qkv = hf_to_vllm_shards(hf, config, 4, rank)["model.layers.0.self_attn.qkv_proj.weight"]
        kv_head = rank // 2
        kv = slice(kv_head * d, (kv_head + 1) * d)
        expected = torch.cat([q[rank * d:(rank + 1) * d], k[kv], v[kv]])
        assert torch.equal(qkv, expected), rank
    # infer_tp=2 = KV heads: one each, no replication.
    qkv = hf_to_vllm_shards(hf, config, 2, 1)["model.layers.0.self_attn.qkv_proj.weight"]
    assert torch.equal(qkv, torch.cat([q[2 * d:], k[d:], v[d:]]))


def test_row_parallel_gate_up_and_vocab_padding():
    config = _config(vocab_size=100)  # pads to 128: rank 1 of 2 holds rows 64..99 + 28 zero rows
    hf = _indexed_state_dict(config)
    out = hf_to_vllm_shards(hf, config, 2, 1)
    embed = out[EMBED]
    assert embed.shape == (64, 64) and vllm_padded_vocab(100) == 128
    assert torch.equal(embed[:36], hf[EMBED][64:100]) and not embed[36:].any()
    assert torch.equal(out[LM_HEAD][:36], hf[LM_HEAD][64:100]) and not out[LM_HEAD][36:].any()
    gate, up = hf["model.layers.1.mlp.gate_proj.weight"], hf["model.layers.1.mlp.up_proj.weight"]
    assert torch.equal(out["model.layers.1.mlp.gate_up_proj.weight"], torch.cat([gate[48:], up[48:]]))
    for name, first_column in (("mlp.down_proj", 48), ("self_attn.o_proj", 32)):
        full = hf[f"model.layers.1.{name}.weight"]
        assert torch.equal(out[f"model.layers.1.{name}.weight"], full[:, first_column:])
    assert torch.equal(out["model.layers.1.input_layernorm.weight"], hf["model.layers.1.input_layernorm.weight"])


def test_shards_reassemble_the_hf_tensors_without_overlap():
    config = _config(architectures=["Qwen2ForCausalLM"], num_key_value_heads=4)
    hf = _indexed_state_dict(config)
    tp = 4
    shards = [hf_to_vllm_shards(hf, config, tp, r) for r in range(tp)]
    layer = "model.layers.0"
    q_rows, kv_rows = 16, 16
    for name, proj, offset in (("weight", "q", 0), ("weight", "k", q_rows), ("weight", "v", q_rows + kv_rows),
                               ("bias", "q", 0), ("bias", "k", q_rows), ("bias", "v", q_rows + kv_rows)):
        rows = q_rows if proj == "q" else kv_rows
        parts = [s[f"{layer}.self_attn.qkv_proj.{name}"][offset:offset + rows] for s in shards]
        assert torch.equal(torch.cat(parts), hf[f"{layer}.self_attn.{proj}_proj.{name}"]), (proj, name)
    assert torch.equal(torch.cat([s[EMBED] for s in shards])[:100], hf[EMBED])


def test_tied_qwen3_names_and_sizes():
    config = _config(architectures=["Qwen3ForCausalLM"], tie_word_embeddings=True, vocab_size=130)
    hf = _indexed_state_dict(config)
    out = hf_to_vllm_shards(hf, config, 2, 0)
    assert LM_HEAD not in out
    assert torch.equal(out["model.layers.0.self_attn.q_norm.weight"], hf["model.layers.0.self_attn.q_norm.weight"])
    shapes = vllm_param_shapes(config, 2, 0)
    assert {n: tuple(t.shape) for n, t in out.items()} == shapes
    assert shapes[EMBED] == (96, 64)  # 130 -> 192 padded, / 2
    assert vllm_shard_nbytes(config, 2, 0, torch.bfloat16) == 2 * sum(math.prod(s) for s in shapes.values())
    untied = _config(tie_word_embeddings=False, vocab_size=130)
    assert vllm_shard_nbytes(untied, 2) - vllm_shard_nbytes({**untied, "tie_word_embeddings": True}, 2) == 96 * 64 * 4


def test_outputs_do_not_alias_inputs():
    config = _config()
    hf = _indexed_state_dict(config)
    out = hf_to_vllm_shards(hf, config, 1, 0)
    for tensor in out.values():
        tensor.zero_()
    assert hf["model.norm.weight"].any() and hf["model.layers.0.self_attn.o_proj.weight"].any()


@pytest.mark.parametrize(
    ("overrides", "tp", "message"),
    [
        ({}, 3, "num_attention_heads=4 is not divisible"),
        ({"num_key_value_heads": 4, "num_attention_heads": 8}, 8, None),
        ({"num_key_value_heads": 4, "num_attention_heads": 12}, 3, "one must divide the other"),
        ({"intermediate_size": 90}, 4, "intermediate_size=90"),
    ],
)
def test_unshardable_layouts_are_refused(overrides, tp, message):
    config = _config(**overrides)
    if message is None:
        assert vllm_param_shapes(config, tp, tp - 1)
        return
    with pytest.raises(ValueError, match=message):
        vllm_param_shapes(config, tp, 0)


def test_wrong_hf_shapes_and_missing_tensors_are_named():
    config = _config()
    hf = _indexed_state_dict(config)
    with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight"):
        hf_to_vllm_shards({k: v for k, v in hf.items() if k != "model.layers.1.mlp.up_proj.weight"}, config, 1, 0)
    bad = dict(hf)
    bad["model.layers.0.input_layernorm.weight"] = torch.zeros(65)
    with pytest.raises(ValueError, match="input_layernorm"):
        hf_to_vllm_shards(bad, config, 1, 0)
    with pytest.raises(ValueError, match="rank=2"):
        hf_to_vllm_shards(hf, config, 2, 2)


def test_tensor_digest_is_bit_exact_and_dtype_shape_aware():
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert tensor_digest(base) == tensor_digest(base.clone())
    assert tensor_digest(base.t()) == tensor_digest(base.t().contiguous())  # layout in memory is irrelevant
    nudged = base.clone()
    nudged[2, 3] = torch.nextafter(nudged[2, 3], torch.tensor(100.0))
    assert tensor_digest(nudged) != tensor_digest(base)
    assert tensor_digest(base.reshape(4, 3)) != tensor_digest(base)
    assert tensor_digest(base.to(torch.float64)) != tensor_digest(base)
    assert tensor_digest(base.to(torch.bfloat16)) == tensor_digest(base.to(torch.bfloat16).clone())


def _reference_sums(tensor: torch.Tensor) -> list[int]:
    """The digest's two lane sums, in plain Python integers mod 2**64 (the documented construction:
    the bytes zero-padded to whole little-endian int64 words)."""
    import struct

    mask = (1 << 64) - 1

    def mix(z: int) -> int:  # splitmix64's finalizer
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    from hybridrl.parallel.digest import DIGEST_CHUNK

    raw = bytes(tensor.contiguous().reshape(-1).view(torch.uint8).tolist())
    raw += bytes(-len(raw) % 8)
    words = struct.unpack(f"<{len(raw) // 8}q", raw)
    sums = [0, 0]
    for position, word in enumerate(words):
        chunk, offset = divmod(position, DIGEST_CHUNK)
        for lane in (0, 1):
            multiplier = mix((chunk * 0x9E3779B97F4A7C15 + 3 + lane) & mask) | 1
            weight = mix((offset * 0x9E3779B97F4A7C15 + lane + 1) & mask) | 1
            sums[lane] = (sums[lane] + word * weight * multiplier) & mask
    return [struct.unpack("<q", struct.pack("<Q", v))[0] for v in sums]


@pytest.mark.parametrize("matrix_vector", [True, False], ids=["cpu_mv", "elementwise_as_on_cuda"])
def test_tensor_digest_sums_are_the_documented_construction(monkeypatch, matrix_vector):
    import hashlib

    from hybridrl.parallel import digest as digest_module

    monkeypatch.setattr(digest_module, "DIGEST_CHUNK", 5)  # several chunks from a small tensor
    monkeypatch.setattr(digest_module, "MATRIX_VECTOR_DEVICES", frozenset({"cpu"} if matrix_vector else ()))
    monkeypatch.setattr(digest_module, "_lane_weights", {})
    gen = torch.Generator().manual_seed(0)
    whole = torch.randn(64, generator=gen)
    cases = {
        "fp32 3x4 (whole words, several chunks)": torch.randn(3, 4, generator=gen),
        "fp32 odd count (a padded last word)": torch.randn(7, generator=gen),
        "bf16 5 (2-byte elements, padded)": torch.randn(5, generator=gen).to(torch.bfloat16),
        "int8 13": torch.randint(-128, 128, (13,), generator=gen, dtype=torch.int8),
        "fp64 9": torch.randn(9, generator=gen, dtype=torch.float64),
        "bool 11": torch.rand(11, generator=gen) > 0.5,
        "fp32 view off a word boundary": whole[1:25],
        "fp32 transposed (not contiguous)": torch.randn(4, 6, generator=gen).t(),
    }
    for name, tensor in cases.items():
        digest = hashlib.blake2b(digest_size=16)
        digest.update(f"{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(torch.tensor(_reference_sums(tensor), dtype=torch.int64).numpy().tobytes())
        assert digest_module.tensor_digest(tensor) == digest.hexdigest(), name


def test_tensor_digest_sees_every_single_change_and_swaps_across_chunks():
    from hybridrl.parallel.digest import DIGEST_CHUNK

    base = torch.randn(DIGEST_CHUNK + 1000)
    reference = tensor_digest(base)
    for position in (0, 1, 999, DIGEST_CHUNK - 1, DIGEST_CHUNK, DIGEST_CHUNK + 999):
        flipped = base.clone()
        flipped.view(torch.int32)[position] ^= 1  # the lowest mantissa bit
        assert tensor_digest(flipped) != reference, position
    swapped = base.clone()
    swapped[[7, DIGEST_CHUNK + 7]] = base[[DIGEST_CHUNK + 7, 7]]  # same offset, different chunks
    assert tensor_digest(swapped) != reference
    for small in (torch.randn(13).to(torch.bfloat16), torch.randint(0, 200, (13,), dtype=torch.uint8)):
        for position in (0, 3, 4, 12):  # inside a word, at a word's start, in the padded last word
            changed = small.clone()
            changed.view(torch.uint8)[position * small.element_size()] ^= 1
            assert tensor_digest(changed) != tensor_digest(small), (small.dtype, position)
    signed = torch.zeros(4)
    negative = signed.clone()
    negative[2] = -0.0  # equal as floats, different bits
    assert tensor_digest(negative) != tensor_digest(signed)


def test_layout_and_rollout_modules_do_not_import_megatron_or_vllm():
    import subprocess
    import sys

    code = (
        "import sys, hybridrl.reshard.layout, hybridrl.rollout.engine, hybridrl.rollout.sampling; "
        "heavy = [m for m in ('megatron', 'vllm', 'transformers') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ------------------------------------------------------------------------------ against real vLLM
@pytest.mark.slow
# infer_tp 2 only: each rank's names and shapes there are the whole-tensor (infer_tp 1) layout's plus
# the split, and the tiny-demo hybrid runs load infer_tp 1 replicas through the same table.
@pytest.mark.parametrize("spec, infer_tp", [
    (LLAMA_GQA1, 2), (QWEN2_TIED, 2), (QWEN3_QK_NORM, 2),
], ids=["llama_kv1-2", "qwen2_tied_bias-2", "qwen3_qk_norm-2"])
def test_layout_equals_what_vllm_loads(tmp_path, spec, infer_tp):
    """vLLM's own loader, on each infer-TP rank, holds exactly `hf_to_vllm_shards`, i.e. the family
    weight table's vLLM side (llama_kv1 at infer_tp=2 replicates its single KV head; qwen3 has the
    per-head q/k norms). Also: RNG kept, TP peers agree, default group survives."""
    model_dir = build_tiny_model(tmp_path / "model", spec, seed=11)
    results = run_ranks(rollout_scenarios.layout_snapshot, infer_tp, str(model_dir), infer_tp, timeout_s=500)
    hf, config = load_state_dict(model_dir), load_config(model_dir)
    for rank, result in enumerate(results):
        expected = hf_to_vllm_shards(hf, config, infer_tp, rank)
        held = result["snapshot"]
        assert sorted(held) == sorted(expected)
        # the plan's count of the tensors a sync writes (its per-tensor fixed cost) is vLLM's
        assert len(held) == synced_tensors(ModelShape.from_hf_config(config))
        for name, tensor in expected.items():
            assert held[name].dtype == torch.float32 and torch.equal(held[name], tensor), (rank, name)
        assert result["rng_kept"], "building the engine changed the caller's torch RNG state"
        assert result["tp_rank"] == rank
        assert result["default_group_sum"] == sum(range(1, infer_tp + 1))
        assert torch.equal(result["responses"], results[0]["responses"])
