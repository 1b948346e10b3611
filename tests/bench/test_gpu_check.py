"""bench/gpu_check: its logic on CPU (tiny model, seconds), its FLOP count against a real megatron model,
and its shell wrapper's lint."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.forked import run_ranks

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_check  # noqa: E402


def _run_tiny(tmp_path: Path, *extra: str, timeout: int) -> dict:
    out = tmp_path / "gpu_check.json"
    result = subprocess.run([sys.executable, str(ROOT / "bench/gpu_check.py"), "--device", "cpu", "--tiny",
                             "--out", str(out), *extra],
                            capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "train tok/s" in result.stdout and "tiny-qwen2" in result.stdout
    return json.loads(out.read_text())


def test_tiny_cpu_run_measures_every_part(tmp_path):
    data = _run_tiny(tmp_path, "--skip-vllm", "--port", "29611", timeout=180)
    assert data["device"] == "cpu" and data["layer_spec"] == "local"
    assert data["memory_metric_ok"] and data["memory_metric_grew_gib"] >= 0.2  # the per-phase metric follows RSS
    row = data["models"]["tiny-qwen2"]
    assert row["train_tokens_per_s"] > 0 and row["logprob_tokens_per_s"] > 0 and 0 < row["mfu"] < 1
    assert row["reshard_shard_devices"] == "cpu" and row["reshard_buckets"] >= 1
    # every vLLM tensor of the tiny model came out, checksummed (embed, lm_head, final norm + 7 per layer)
    assert row["reshard_checksums"] == 3 + 7 * gpu_check.TINY["num_hidden_layers"]
    assert "vllm" not in row
    # issue 47's side by side: the update with the cuda defaults' fusions against megatron's dataclass defaults,
    # and which could not run here (no TransformerEngine, no Apex), each with why
    assert row["speed_on"] == ["bias_activation_fusion", "bias_dropout_fusion"]
    assert {"apply_rope_fusion", "gradient_accumulation_fusion"} <= set(row["speed_off"])
    assert row["hybridrl_defaults_train_tokens_per_s"] > 0 and row["megatron_defaults_train_tokens_per_s"] > 0
    # issue 46's calibration: the efficiencies that make the step-time model predict these passes, on the model's
    # own FLOP count (causal attention's half) where the MFU counts the whole s x s: the same seconds, fewer FLOPs
    from hybridrl.config.estimates import forward_flops
    from hybridrl.models.arch import ModelShape

    batch, seq = data["batch"], data["seq"]
    counted = forward_flops(ModelShape.from_hf_config(gpu_check.TINY), rows=batch, layer_tokens=seq,
                            head_tokens=seq, seq_len=seq, vocab_head=True)
    convention = gpu_check.flops_per_token(gpu_check.TINY, seq, training=False) * batch * seq
    assert counted < convention
    assert row["update_matmul_implied"] == pytest.approx(row["mfu"] * counted / convention, rel=1e-9)
    logprob_mfu = row["logprob_tflops"] / 989.0
    assert row["forward_matmul_implied"] == pytest.approx(logprob_mfu * counted / convention, rel=1e-9)
    assert row["hybridrl_defaults_update_matmul_implied"] > 0 and row["hybridrl_defaults_forward_matmul_implied"] > 0
    # the workers' own data path, fed a host batch as the controller sends it
    workers = data["workers"]
    assert workers["workers_result_devices"] == "cpu"
    assert workers["workers_packed"] is True  # the CPU default: the attention stand-in
    assert workers["workers_log_prob_max_abs_diff_vs_hf"] < 1e-4
    assert workers["workers_update_steps"] == 1 and workers["workers_update_skipped"] == 0
    assert workers["workers_update_log_prob_change"] > 1e-3  # the PPO step moved the policy
    assert workers["workers_values_finite"] and workers["workers_values_zero_off_mask"]
    assert workers["workers_values_abs_mean"] > 0
    # one critic step towards returns above the values raised them (the value head's gradient reached it)
    assert workers["workers_critic_grad_norm"] > 0 and workers["workers_critic_values_moved_up"] > 0
    # megatron's MoE layers (local spec) on the device against transformers, and their expert gradients
    moe = data["moe"]
    assert moe["moe_device"] == "cpu" and moe["moe_logits_max_abs_diff_vs_hf"] < 1e-4
    assert moe["moe_expert_grads"] > 0 and moe["moe_expert_grads_finite"]
    # a LoRA actor as a GPU builds it (local spec, bf16 base, fp32 adapters): B = 0 at the start, so the model is
    # the base (bf16's rounding against transformers in fp32); the update moved the policy and not the base, and the
    # reference pass (adapters off) gives the base's log-probs again, exactly
    lora = data["lora"]
    assert lora["lora_layer_spec"] == "local" and lora["lora_dtypes"] == "adapter float32,base bfloat16"
    assert lora["lora_adapters"] == 4 * gpu_check.TINY["num_hidden_layers"]
    assert lora["lora_log_prob_max_abs_diff_vs_hf"] < 2e-2 and lora["lora_update_log_prob_change"] > 1e-3
    assert lora["lora_base_unchanged"] and lora["lora_reference_max_abs_diff_vs_base"] == 0.0
    # the resharder's shards on the device, against the layout math's for the exported model
    assert row["reshard_layout_tensors"] == row["reshard_checksums"] and row["reshard_layout_mismatches"] == 0
    # what one machine cannot prove is listed for the first multi-GPU run
    unreached = " ".join(data["unreached"])
    assert "sequence parallelism" in unreached and "TransformerEngine" in unreached and "vLLM" in unreached


def _cut_short_run(rank: int, world: int, out: str) -> str:
    import argparse

    def cut_short(*args, **kwargs):
        raise RuntimeError("cut short")

    gpu_check.reshard_figures = cut_short  # the run stops inside the first model's figures
    args = argparse.Namespace(device="cpu", dtype=None, tiny=True, batch=2, seq=16, iters=1, matmul_size=64,
                              skip_vllm=True, skip_workers=False, peak_tflops=989.0, port=0)
    try:
        gpu_check.run(args, out)
    except RuntimeError as error:
        return str(error)
    return "finished"


def test_json_keeps_the_figures_of_a_run_cut_short(tmp_path):
    out = tmp_path / "gpu_check.json"
    assert run_ranks(_cut_short_run, 1, str(out)) == ["cut short"]
    data = json.loads(out.read_text())
    assert data["workers"]["workers_update_steps"] == 1 and data["matmul_tflops"] > 0
    assert data["models"] == {}  # the interrupted model's row was never written


@pytest.mark.slow
def test_tiny_cpu_run_with_vllm(tmp_path):
    row = _run_tiny(tmp_path, "--port", "29612", timeout=300)["models"]["tiny-qwen2"]
    assert row["vllm"] == "ran" and row["vllm_generated_tokens"] == 4 * 8  # ignore_eos: every token counted


def _linear_numel(rank: int, world: int) -> dict:
    from hybridrl.parallel.state import initialize_model_parallel

    initialize_model_parallel(device="cpu")
    (model,) = gpu_check.build_random_model(gpu_check.TINY, dtype="fp32")
    weights = {n: p.numel() for n, p in model.named_parameters() if p.dim() == 2}
    return {"matmul": sum(v for n, v in weights.items() if "word_embeddings" not in n)}


def test_flop_count_matches_the_built_model():
    (counted,) = run_ranks(_linear_numel, 1)
    seq, config = 64, gpu_check.TINY
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    attention = 4 * config["num_hidden_layers"] * seq * config["num_attention_heads"] * head_dim
    forward = gpu_check.flops_per_token(config, seq, training=False)
    assert forward == 2 * counted["matmul"] + attention
    assert gpu_check.flops_per_token(config, seq, training=True) == 3 * forward


def test_shell_wrapper_is_shellcheck_clean():
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    result = subprocess.run([shellcheck, str(ROOT / "bench/gpu_check.sh")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout
