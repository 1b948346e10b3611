"""Tiny HF models (random weights, built from configs) shared by the tests/test_models_* suites.

No tests here: helpers only. Models are small enough to build in milliseconds but exercise every
layout feature: GQA (4 query heads, 2 KV heads), a vocab (200) that megatron must pad, an explicit
head_dim different from hidden/heads (Qwen3), q/k norms (Qwen3), qkv bias (Qwen2), tied embeddings
(Qwen2, Qwen3) and 4 layers so PP=2 x VPP=2 splits evenly.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

VOCAB = 200
SEQ = 12

_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
)

# name -> (config class name, overrides)
ARCH_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {"rope_theta": 10000.0}),
    "mistral": ("MistralConfig", {"sliding_window": None, "rope_theta": 20000.0}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True, "rope_theta": 1000000.0, "rms_norm_eps": 1e-5}),
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": True, "head_dim": 32}),
}
ARCHS: tuple[str, ...] = tuple(ARCH_CONFIGS)

# Mixture-of-experts models, kept apart from ARCHS: vLLM resharding of experts is not built yet, so
# the dense suites' vLLM checks do not apply to them. Layer kinds differ between the two Qwen3-MoE
# models (a dense MLP in layer 2; experts only on every second layer) so that PP stages hold both.
MOE_ARCH_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 48, "norm_topk_prob": True,
                                     "mlp_only_layers": [2], "decoder_sparse_step": 1}),
    "qwen3_moe_unnormed": ("Qwen3MoeConfig", {"head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2,
                                              "moe_intermediate_size": 32, "norm_topk_prob": False,
                                              "mlp_only_layers": [], "decoder_sparse_step": 2}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 48,
                                  "rope_theta": 1000000.0, "sliding_window": None}),
}
MOE_ARCHS: tuple[str, ...] = tuple(MOE_ARCH_CONFIGS)


def make_hf_model(out_dir: Path, arch: str, seed: int = 0, **overrides: Any) -> Path:
    """Save a randomly initialized tiny HF model of `arch` to `out_dir` (fp32 safetensors)."""
    import transformers

    class_name, arch_overrides = {**ARCH_CONFIGS, **MOE_ARCH_CONFIGS}[arch]
    config_cls = getattr(transformers, class_name)
    kwargs = {**_COMMON, **arch_overrides, **overrides}
    theta = kwargs.pop("rope_theta", None)
    if theta is not None:
        kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # Random norm weights (HF initializes them to 1) so a misplaced norm shows in the logits.
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            if name.endswith("bias"):
                param.normal_(0, 0.1)
            # Router weights far from HF's 0.02 init: the experts' scores then differ by much more
            # than fp32 noise, so no top-k choice is a near tie that rounding could flip.
            if name.endswith("mlp.gate.weight"):
                param.normal_(0, 1.0)
    model.save_pretrained(out_dir)
    return out_dir


def hf_logits(hf_dir: Path, input_ids: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    with torch.no_grad():
        return model(input_ids).logits


def hf_model_dirs(root: Path, archs: Sequence[str], first_seed: int) -> dict[str, Path]:
    """One random HF model folder per architecture (seeds first_seed, first_seed + 1, ...)."""
    return {arch: make_hf_model(root / arch, arch, seed=first_seed + i) for i, arch in enumerate(archs)}


def max_logit_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """Largest gap between megatron's (vocabulary-padded) logits and transformers'."""
    assert ours.shape[:-1] == theirs.shape[:-1] and ours.shape[-1] >= VOCAB
    return (ours[..., :VOCAB] - theirs).abs().max().item()


def sample_tokens(batch: int = 2, seq: int = SEQ, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=gen)


def safetensors_state(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files directly in `folder`, by name."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        for key, value in load_file(path).items():
            assert key not in out, f"{key} stored twice"
            out[key] = value
    return out


def per_file_state(folder: Path) -> dict[str, torch.Tensor]:
    """Tensors of every safetensors file in `folder` keyed 'file:name' (megatron rank files repeat names)."""
    from safetensors.torch import load_file

    return {f"{path.name}:{key}": value for path in sorted(folder.glob("*.safetensors"))
            for key, value in load_file(path).items()}


def assert_same_tensors(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert a[key].shape == b[key].shape, key
        assert torch.equal(a[key], b[key]), f"{key} differs"


def tree_snapshot(folder: Path) -> dict[str, bytes]:
    """Relative path -> bytes of every file under `folder` (to prove it was left untouched)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def checkpoint_named_grads(model: Any, arch: str) -> dict[str, torch.Tensor]:
    """Each parameter gradient of a transformers model under its name in saved checkpoints (what `export_hf`
    writes): transformers 5 holds an MoE layer's experts fused (`experts.gate_up_proj` `[E, 2F, H]`,
    `experts.down_proj`) where checkpoints keep one tensor per expert and projection. A parameter the loss did not
    reach has a zero gradient."""
    module = "block_sparse_moe" if arch == "mixtral" else "mlp"  # an MoE layer's name in checkpoints
    gate_up, down = (("w1", "w3"), "w2") if arch == "mixtral" else (("gate_proj", "up_proj"), "down_proj")
    out = {}
    for name, param in model.named_parameters():
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        if name.endswith("experts.gate_up_proj"):
            base = name.removesuffix("gate_up_proj").replace("mlp.experts", module + ".experts")
            gate, up = grad.chunk(2, dim=1)
            for e in range(param.shape[0]):
                out[f"{base}{e}.{gate_up[0]}.weight"], out[f"{base}{e}.{gate_up[1]}.weight"] = gate[e], up[e]
        elif name.endswith("experts.down_proj"):
            base = name.removesuffix("down_proj").replace("mlp.experts", module + ".experts")
            for e in range(param.shape[0]):
                out[f"{base}{e}.{down}.weight"] = grad[e]
        else:
            out[name.replace("mlp.gate.", module + ".gate.")] = grad
    return out


def moe_model_dir(tmp_path: Path, experts: int = 8, top_k: int = 2, moe_ffn: int = 128) -> str:
    """An MoE model's shape (Qwen3-MoE, config.json only: the plan sizes it, nothing loads it) as the override that
    names it."""
    folder = tmp_path / f"moe_{experts}_{top_k}_{moe_ffn}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 768, "intermediate_size": 256,
        "num_hidden_layers": 6, "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64,
        "vocab_size": 1000, "max_position_embeddings": 4096, "num_experts": experts,
        "num_experts_per_tok": top_k, "moe_intermediate_size": moe_ffn, "norm_topk_prob": True,
    }))
    return f"actor_rollout_ref.model.path={folder}"
