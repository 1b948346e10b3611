"""The GPU check (issue 9): actor throughput/MFU, log-prob throughput, resharding and vLLM on one device.

For each Qwen2-shaped model (random weights, built by the bridge from a config dict: no HF download):
  - train: forward + backward of the megatron GPTModel with the per-token cross-entropy loss (the
    actor's update path without the optimizer), tokens/s and MFU = model FLOPs / time / peak, where
    model FLOPs per token = 6 x (non-embedding matmul params + lm_head) + 12 x layers x hidden x seq
    (attention scores and values, forward + backward), and peak is the device's dense bf16 figure
    (--peak-tflops; H200/H100 SXM: 989). The measured rate of a large bf16 matmul is printed beside it.
  - logprob: forward only under no_grad through megatron's vocab-parallel cross-entropy (the
    old/ref log-prob pass), tokens/s.
  - reshard: the resharder on this device's tensors (world 1, infer_tp 1): buckets, bytes, time,
    checksums of the produced vLLM shards; proves the CUDA path of bucketing and the shard layout.
  - vllm (first model only, when vLLM is importable): the megatron weights exported to an HF folder,
    loaded by vLLM, and generate tokens/s for a batch of random prompts.
  - workers (first, on the tiny shape in fp32): the workers' own data path on a *CPU-resident* batch,
    as the controller sends it: `MegatronActor.compute_log_prob` (checked against transformers on
    the same device), one `update_policy` step through megatron DDP + the distributed optimizer,
    `MegatronCritic.compute_values` (the value head) and one `update_critic` step. The other parts build
    their inputs on the device; this one proves the batch reaches it.
  - moe (tiny Qwen3-MoE in fp32): megatron's MoE layers on the local spec (router, token dispatcher,
    experts) on this device: logits against transformers on the same device, one backward with finite
    gradients for every expert.
  - reshard also checks its shards against the layout math (`hf_to_vllm_shards` of the exported model,
    checksums): the sync's producing side on this device, into a stand-in receiver that compares bytes.
  - unreached: the GPU-only paths this machine could not run (TransformerEngine, sequence parallelism
    at TP > 1 and every other multi-rank NCCL collective on one GPU, vLLM), so a first multi-GPU run
    knows what is still unproven.

    python bench/gpu_check.py --device cuda              # on one GPU (bench/gpu_check.sh wraps it)
    python bench/gpu_check.py --device cpu --tiny        # the same logic on a tiny model in seconds (CI)

Prints one table; writes JSON to --out (default: $OUT/gpu_check.json when OUT is set), rewritten after
every part, so a run cut short by a timeout still leaves the figures it had.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bounds import flops_per_token  # noqa: E402  (bench/ is the script's folder)

# Public Qwen2.5 shapes (config.json numbers); the 0.5B one is shipped under configs/models.
QWEN2_1_5B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 1536,
    "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "vocab_size": 151936,
}
# Small enough for two CPU cores, with a head_dim (32) that vLLM's CPU attention accepts.
TINY = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 1024, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "tie_word_embeddings": False, "torch_dtype": "float32", "vocab_size": 1024,
}
GIB = float(1 << 30)


def model_configs(tiny: bool) -> dict[str, dict[str, Any]]:
    if tiny:
        return {"tiny-qwen2": TINY}
    half_b = json.loads((ROOT / "configs/models/qwen2.5-0.5b/config.json").read_text())
    return {"qwen2.5-0.5b": half_b, "qwen2.5-1.5b": QWEN2_1_5B}


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str, iters: int, warmup: int) -> float:
    """Mean seconds per call after `warmup` calls."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    started = time.perf_counter()
    for _ in range(iters):
        fn()
    synchronize(device)
    return (time.perf_counter() - started) / iters


def matmul_tflops(device: str, dtype: torch.dtype, size: int) -> float:
    from hybridrl.parallel.device import rank_device

    a = torch.randn(size, size, device=rank_device(device), dtype=dtype)
    b = torch.randn(size, size, device=rank_device(device), dtype=dtype)
    seconds = timed(lambda: a @ b, device, iters=10, warmup=3)
    return 2 * size**3 / seconds / 1e12


def build_random_model(config: dict[str, Any], dtype: torch.dtype,
                       overrides: dict[str, Any] | None = None) -> list[Any]:
    from hybridrl.models.bridge import build_gpt_models

    models = build_gpt_models(config, dtype=dtype, config_overrides=overrides)
    # The bridge builds for a checkpoint (no init); random normal weights keep the numerics finite.
    generator = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        for model in models:
            for name, param in model.named_parameters():
                values = torch.randn(param.shape, generator=generator) * 0.02
                if name.endswith("layernorm.weight") or "norm" in name.split(".")[-2]:
                    values = torch.ones(param.shape)
                param.copy_(values.to(param.dtype))
    return models


def actor_figures(model: Any, config: dict[str, Any], device: str, batch: int, seq: int, iters: int,
                  peak_tflops: float) -> dict[str, float]:
    from hybridrl.parallel.device import rank_device

    # where the model's inputs go (on a CPU rank under strict-device mode: tagged as the GPU's)
    tokens = torch.randint(0, config["vocab_size"], (batch, seq + 1), device=rank_device(device))
    input_ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    position_ids = torch.arange(seq, device=rank_device(device)).unsqueeze(0).expand(batch, -1)

    def train_step() -> None:
        loss = model(input_ids, position_ids, None, labels=labels)  # [b, s] per-token cross-entropy
        loss.float().mean().backward()

    def log_prob_pass() -> None:
        with torch.no_grad():
            model(input_ids, position_ids, None, labels=labels)

    model.train()
    train_s = timed(train_step, device, iters, warmup=2)
    model.zero_grad(set_to_none=True)
    model.eval()
    logprob_s = timed(log_prob_pass, device, iters, warmup=2)
    n_tokens = batch * seq
    train_tflops = flops_per_token(config, seq, training=True) * n_tokens / train_s / 1e12
    return {
        "train_tokens_per_s": n_tokens / train_s,
        "train_tflops": train_tflops,
        "mfu": train_tflops / peak_tflops,
        "logprob_tokens_per_s": n_tokens / logprob_s,
        "logprob_tflops": flops_per_token(config, seq, training=False) * n_tokens / logprob_s / 1e12,
        **implied_efficiencies(config, batch, seq, train_s, logprob_s, peak_tflops),
    }


def implied_efficiencies(config: dict[str, Any], batch: int, seq: int, train_s: float, logprob_s: float,
                         peak_tflops: float) -> dict[str, float]:
    """The step-time model's `update_matmul` and `forward_matmul` (hybridrl.config.hardware.Efficiency) that would
    predict these measured passes exactly: its own FLOP count of them (`forward_flops`: causal attention's half,
    where the MFU convention above counts the whole s x s) over the seconds at the device's peak. At TP1, PP1 on one
    GPU the model's update compute is 3 forwards' FLOPs / (peak x update_matmul) and a log-prob pass is one forward's
    / (peak x forward_matmul), with nothing else (no fixed costs on a shipped GPU, no TP traffic), so these are the
    calibration of those two numbers on this device."""
    from hybridrl.config.estimates import forward_flops
    from hybridrl.models.arch import ModelShape

    forward = forward_flops(ModelShape.from_hf_config(config), rows=batch, layer_tokens=seq, head_tokens=seq,
                            seq_len=seq, vocab_head=True)
    peak = peak_tflops * 1e12
    return {"update_matmul_implied": 3 * forward / peak / train_s, "forward_matmul_implied": forward / peak / logprob_s}


def speed_figures(config: dict[str, Any], device: str, dtype: torch.dtype, batch: int, seq: int, iters: int,
                  peak_tflops: float) -> dict[str, Any]:
    """issue 47: the update's forward + backward with hybridrl's cuda defaults (`speed_settings`: the fusions
    megatron serves here) against megatron-core's dataclass defaults (every fusion off), side by side on the
    same shape; which fusions could not run on this machine (no TransformerEngine, no Apex) and why. The DDP
    overlaps need DP > 1: one GPU cannot measure them."""
    from hybridrl.parallel.device import apex_wgrad_available, layer_spec_kind
    from hybridrl.parallel.speed_settings import speed_settings, transformer_values

    settings = speed_settings(cuda=True, trainable=True, data_parallel=1,  # what a cuda job gets
                              distributed_optimizer=True, te=layer_spec_kind(device) == "te",
                              apex_wgrad=apex_wgrad_available())
    fused = transformer_values(settings)
    if device == "cpu":
        fused["apply_rope_fusion"] = False  # the CPU check runs the same logic; megatron's CPU RoPE slot is not TE's
    row: dict[str, Any] = {"speed_on": sorted(n for n, on in fused.items() if on),
                           "speed_off": {s.name: s.why for s in settings if not s.on}}
    for label, overrides in (("megatron_defaults", {name: False for name in fused}), ("hybridrl_defaults", fused)):
        models = build_random_model(config, dtype, overrides)
        figures = actor_figures(models[0], config, device, batch, seq, iters, peak_tflops)
        row[f"{label}_train_tokens_per_s"] = figures["train_tokens_per_s"]
        row[f"{label}_mfu"] = figures["mfu"]
        row[f"{label}_update_matmul_implied"] = figures["update_matmul_implied"]
        row[f"{label}_forward_matmul_implied"] = figures["forward_matmul_implied"]
        del models
    row["speedup"] = row["hybridrl_defaults_train_tokens_per_s"] / row["megatron_defaults_train_tokens_per_s"]
    return row


def reshard_figures(models: list[Any], dtype: torch.dtype) -> dict[str, Any]:
    from hybridrl.config.meshes import build_reshard_groups, build_training_mesh
    from hybridrl.reshard.resharder import ReshardConfig, Resharder

    groups = build_reshard_groups(build_training_mesh(1, 1, 1), 1)
    resharder = Resharder(models, groups, config=ReshardConfig(bucket_bytes=256 << 20, output_dtype=dtype))
    for _ in resharder.shards():  # warm-up (allocator, first kernels)
        pass
    devices: set[str] = set()
    shard_bytes = 0
    for _, tensor in resharder.shards():
        devices.add(tensor.device.type)
        shard_bytes += tensor.numel() * tensor.element_size()
    report = resharder.last_report
    return {"reshard_s": report.seconds, "reshard_checksum_s": report.checksum_seconds,
            "reshard_checksum_s_per_gib": report.checksum_seconds / max(shard_bytes / GIB, 1e-12),
            "reshard_buckets": report.buckets, "reshard_shard_gib": shard_bytes / GIB,
            "reshard_gbps": shard_bytes / max(report.seconds, 1e-9) / 1e9,
            "reshard_shard_devices": ",".join(sorted(devices)), "reshard_checksums": len(report.checksums)}


def reshard_layout_check(models: list[Any], config: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """The resharder's shards on this device against the layout math's: the model exported to an HF
    folder, `hf_to_vllm_shards` of it (on the host), both checksummed and compared tensor by tensor."""
    from safetensors.torch import load_file

    from hybridrl.config.meshes import build_reshard_groups, build_training_mesh
    from hybridrl.models.bridge import export_hf
    from hybridrl.reshard.checksums import compare_checksums, shard_checksums
    from hybridrl.reshard.layout import hf_to_vllm_shards
    from hybridrl.reshard.resharder import ReshardConfig, Resharder

    groups = build_reshard_groups(build_training_mesh(1, 1, 1), 1)
    produced = shard_checksums(Resharder(models, groups, config=ReshardConfig(output_dtype=dtype)).shards())
    with tempfile.TemporaryDirectory() as tmp:
        folder = export_hf(models, Path(tmp) / "hf", dtype=dtype)
        state = {}
        for file in sorted(folder.glob("*.safetensors")):
            state.update(load_file(str(file)))
        expected = shard_checksums(hf_to_vllm_shards(state, config, 1, 0).items())
    mismatches = compare_checksums(expected, produced, 0)
    return {"reshard_layout_tensors": len(expected), "reshard_layout_mismatches": len(mismatches)}


TINY_MOE = json.loads((ROOT / "configs/models/tiny-demo-moe/config.json").read_text())


def moe_figures(device: str) -> dict[str, Any]:
    """megatron's MoE layers (local spec) on this device against transformers: logits, then a backward."""
    import transformers

    from hybridrl.models.bridge import export_hf
    from hybridrl.parallel.device import rank_device

    place = rank_device(device)  # where the rank's model and inputs live (tagged as the GPU's under strict mode)
    models = build_random_model(TINY_MOE, torch.float32)
    model = models[0]
    tokens = torch.randint(1, TINY_MOE["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with tempfile.TemporaryDirectory() as tmp:
        folder = export_hf(models, Path(tmp) / "hf", dtype=torch.float32)
        reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                                      attn_implementation="eager").to(place)
        with torch.no_grad():
            expected = reference(input_ids=tokens.to(place)).logits.float()
    model.train()
    logits = model(tokens.to(place), positions.to(place), None)  # [b, s, vocab (padded)]
    logits = logits[..., :TINY_MOE["vocab_size"]].float()
    logits.logsumexp(-1).mean().backward()
    experts = [p.grad for n, p in model.named_parameters() if ".experts." in n]
    return {"moe_logits_max_abs_diff_vs_hf": float((logits.detach() - expected).abs().max()),
            "moe_expert_grads": len(experts),
            "moe_expert_grads_finite": all(g is not None and bool(torch.isfinite(g).all()) for g in experts),
            "moe_device": logits.device.type}


def unreached_paths(device: str, result: dict[str, Any]) -> list[str]:
    """The GPU-only paths this run could not exercise (one GPU, what the lent image lacks)."""
    from hybridrl.parallel.device import layer_spec_kind

    paths = ["sequence parallelism and every other TP/PP/DP/EP collective over NCCL (one GPU: world 1)",
             "the colocated critic and reward model processes next to vLLM (Ray, several processes a GPU)"]
    if device != "cuda" or layer_spec_kind(device) != "te":
        paths.append("TransformerEngine's layer spec (fused norms + linears, packed THD attention, TE's norms "
                      "under sequence parallelism)")
    if not any(r.get("vllm") == "ran" for r in result.get("models", {}).values()):
        paths.append("vLLM on this device (generation, sleep/wake, the weight sync's receiving side, the probe)")
    return paths


def vllm_figures(models: list[Any], config: dict[str, Any], device: str, dtype: torch.dtype, prompts: int,
                 new_tokens: int) -> dict[str, Any]:
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        return {"vllm": f"skipped: vllm not importable ({exc.name})"}
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process, as in the hybrid engine
    from vllm import LLM, SamplingParams

    from hybridrl.models.bridge import export_hf

    with tempfile.TemporaryDirectory() as tmp:
        folder = export_hf(models, Path(tmp) / "hf", dtype=dtype)
        kwargs: dict[str, Any] = dict(model=str(folder), dtype=str(dtype).removeprefix("torch."),
                                      skip_tokenizer_init=True, max_model_len=512, seed=0)
        if device == "cuda":
            kwargs.update(gpu_memory_utilization=0.3)
        else:
            kwargs.update(enforce_eager=True, kv_cache_memory_bytes=64 << 20, block_size=32)
        started = time.perf_counter()
        llm = LLM(**kwargs)
        build_s = time.perf_counter() - started
        generator = torch.Generator().manual_seed(1)
        requests = [{"prompt_token_ids": torch.randint(0, config["vocab_size"], (64,), generator=generator).tolist()}
                    for _ in range(prompts)]
        sampling = SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=1.0, seed=0, detokenize=False)
        llm.generate(requests[:2], sampling, use_tqdm=False)  # warm-up
        started = time.perf_counter()
        outputs = llm.generate(requests, sampling, use_tqdm=False)
        seconds = time.perf_counter() - started
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"vllm": "ran", "vllm_build_s": build_s, "vllm_generate_tokens_per_s": generated / seconds,
            "vllm_generated_tokens": generated}


WORKER_PROMPT, WORKER_RESPONSE, WORKER_ROWS = 12, 8, 8


def worker_batch(vocab: int, seed: int = 0) -> Any:
    """A rollout-shaped `Batch` on the host: left-padded prompts, right-padded responses, PPO inputs."""
    from hybridrl.data.batch import Batch

    gen = torch.Generator().manual_seed(seed)
    rows, prompt, response = WORKER_ROWS, WORKER_PROMPT, WORKER_RESPONSE
    prompts = torch.zeros(rows, prompt, dtype=torch.long)
    responses = torch.zeros(rows, response, dtype=torch.long)
    prompt_mask = torch.zeros(rows, prompt, dtype=torch.long)
    response_mask = torch.zeros(rows, response, dtype=torch.long)
    for i in range(rows):
        p = prompt if i == 0 else int(torch.randint(1, prompt + 1, (1,), generator=gen))
        r = response if i == 0 else int(torch.randint(1, response + 1, (1,), generator=gen))
        prompts[i, prompt - p:] = torch.randint(1, vocab, (p,), generator=gen)
        prompt_mask[i, prompt - p:] = 1
        responses[i, :r] = torch.randint(1, vocab, (r,), generator=gen)
        response_mask[i, :r] = 1
    positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    mask = response_mask.float()
    return Batch({
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": torch.cat([prompt_mask, response_mask], 1),
        "position_ids": torch.cat([positions, positions[:, -1:] + 1 + torch.arange(response).unsqueeze(0)], 1),
        "responses": responses,
        "response_mask": response_mask,
        "advantages": torch.randn(rows, response, generator=gen) * mask,
    }, {"uid": [i // 2 for i in range(rows)]})


def worker_config(model_dir: Path, device: str) -> Any:
    """One rank, one PPO mini-batch of the whole batch in micro-batches of 2, distributed optimizer, GAE critic."""
    from hybridrl.config.schema import JobConfig

    c = JobConfig()
    c.trainer.device = device
    c.trainer.nnodes, c.trainer.n_gpus_per_node = 1, 1
    c.actor_rollout_ref.model.path = str(model_dir)
    c.data.max_prompt_length, c.data.max_response_length = WORKER_PROMPT, WORKER_RESPONSE
    c.data.train_batch_size = WORKER_ROWS // 2
    c.actor_rollout_ref.rollout.n = 2
    actor = c.actor_rollout_ref.actor
    actor.megatron.dtype = "fp32"
    actor.megatron.use_distributed_optimizer = True
    actor.ppo_mini_batch_size, actor.ppo_micro_batch_size_per_gpu = WORKER_ROWS // 2, 2
    actor.optim.lr = 1e-2
    c.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu = 2
    c.algorithm.adv_estimator = "gae"
    c.critic.model.path = str(model_dir)
    c.critic.megatron.dtype = "fp32"
    c.critic.ppo_micro_batch_size_per_gpu = 2
    from hybridrl.parallel.device import layer_spec_kind

    if layer_spec_kind(device) == "local" and device != "cpu":
        # packed sequences (the default) need TE's attention on cuda; the lent image has no TE
        c.actor_rollout_ref.model.use_remove_padding = c.critic.model.use_remove_padding = False
    return c


def reference_log_probs(model_dir: Path, batch: Any, device: str) -> torch.Tensor:
    """transformers' log-probs of the response tokens, computed on `device` (fp32)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                              attn_implementation="eager").to(device)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
                       position_ids=batch["position_ids"].to(device)).logits.float()
    width = batch["input_ids"].shape[1]
    picked = logits[:, width - WORKER_RESPONSE - 1: width - 1].log_softmax(-1)
    log_probs = picked.gather(-1, batch["responses"].to(device).unsqueeze(-1)).squeeze(-1).cpu()
    return log_probs * batch["response_mask"]


def worker_figures(config: dict[str, Any], device: str) -> dict[str, Any]:
    """The workers' data path on a host batch (see the module docstring); fp32, one rank."""
    from hybridrl.config.plan import build_plan
    from hybridrl.models.bridge import export_hf
    from hybridrl.training.actor import MegatronActor
    from hybridrl.training.backend import MegatronBackend, role_spec
    from hybridrl.training.critic import MegatronCritic

    batch = worker_batch(config["vocab_size"])
    with tempfile.TemporaryDirectory() as tmp:
        folder = export_hf(build_random_model(config, torch.float32), Path(tmp) / "hf", dtype=torch.float32)
        reference = reference_log_probs(folder, batch, device)
        plan = build_plan(worker_config(folder, device))
        started = time.perf_counter()
        actor = MegatronActor(MegatronBackend(role_spec(plan, "actor")), plan)
        critic = MegatronCritic(MegatronBackend(role_spec(plan, "critic")), plan)
        build_s = time.perf_counter() - started
    started = time.perf_counter()
    before = actor.compute_log_prob(batch)["old_log_probs"]
    log_prob_s = time.perf_counter() - started
    batch["old_log_probs"] = before
    started = time.perf_counter()
    update = actor.update_policy(batch)
    update_s = time.perf_counter() - started
    after = actor.compute_log_prob(batch)["old_log_probs"]
    values = critic.compute_values(batch)["values"]
    mask = batch["response_mask"].bool()
    # one critic step towards returns one unit from the values, on the response tokens
    batch["values"] = values
    batch["returns"] = (values + 1.0) * mask
    critic_update = critic.update_critic(batch)
    values_after = critic.compute_values(batch)["values"]
    return {
        "workers_packed": plan.resolved.packed("actor"),
        "workers_build_s": build_s, "workers_log_prob_s": log_prob_s, "workers_update_s": update_s,
        "workers_result_devices": ",".join(sorted({t.device.type for t in (before, after, values)})),
        "workers_log_prob_max_abs_diff_vs_hf": float((before - reference).abs().max()),
        "workers_update_steps": update.optimizer_steps, "workers_update_skipped": update.skipped_steps,
        "workers_update_grad_norm": update.grad_norm,
        "workers_update_log_prob_change": float((after - before).abs().max()),
        "workers_values_finite": bool(torch.isfinite(values).all()),
        "workers_values_zero_off_mask": bool((values[~mask] == 0).all()),
        "workers_values_abs_mean": float(values[mask].abs().mean()),
        "workers_critic_grad_norm": critic_update.grad_norm,
        "workers_critic_values_moved_up": float((values_after - values)[mask].mean()),
    }


def lora_figures(config: dict[str, Any], device: str) -> dict[str, Any]:
    """A LoRA actor as a GPU runs it: megatron's local layer spec (`layer_spec_kind(adapters=True)`), the base in
    bf16 and fresh fp32 adapters (B = 0: the model is the base), one GRPO update on a host batch; then the
    reference pass (the adapters off) must give the base's log-probs again."""
    from hybridrl.config.plan import build_plan
    from hybridrl.models.bridge import export_hf
    from hybridrl.models.lora import adapters_disabled, lora_adapters
    from hybridrl.training.actor import MegatronActor
    from hybridrl.training.backend import MegatronBackend, role_spec

    batch = worker_batch(config["vocab_size"], seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = export_hf(build_random_model(config, torch.float32), Path(tmp) / "hf", dtype=torch.float32)
        reference = reference_log_probs(folder, batch, device)
        job = worker_config(folder, device)
        job.algorithm.adv_estimator = "grpo"
        job.actor_rollout_ref.actor.megatron.dtype = "bf16"
        lora = job.actor_rollout_ref.model.lora
        lora.rank, lora.alpha = 8, 16.0
        plan = build_plan(job)
        backend = MegatronBackend(role_spec(plan, "actor"))
        actor = MegatronActor(backend, plan)
    base = {n: p.detach().clone() for c in backend.chunks for n, p in c.named_parameters() if not p.requires_grad}
    before = actor.compute_log_prob(batch)["old_log_probs"]
    batch["old_log_probs"] = before
    started = time.perf_counter()
    update = actor.update_policy(batch)
    update_s = time.perf_counter() - started
    after = actor.compute_log_prob(batch)["old_log_probs"]
    with torch.no_grad(), adapters_disabled(backend.chunks):
        reference_pass = actor.compute_log_prob(batch)["old_log_probs"]
    params = {n: p for c in backend.chunks for n, p in c.named_parameters()}
    return {
        "lora_layer_spec": backend.spec_kind, "lora_packed": plan.resolved.packed("actor"),
        "lora_update_s": update_s, "lora_update_grad_norm": update.grad_norm,
        "lora_log_prob_max_abs_diff_vs_hf": float((before - reference).abs().max()),
        "lora_update_log_prob_change": float((after - before).abs().max()),
        "lora_reference_max_abs_diff_vs_base": float((reference_pass - before).abs().max()),
        "lora_base_unchanged": all(torch.equal(params[n].detach(), t) for n, t in base.items()),
        "lora_dtypes": ",".join(sorted({f"{'adapter' if p.requires_grad else 'base'} {str(p.dtype)[6:]}"
                                        for n, p in params.items() if "layernorm" not in n})),
        "lora_adapters": len(lora_adapters(backend.chunks)),
    }


def memory_gib(device: str) -> float:
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / GIB
    from hybridrl.parallel.memory import cpu_memory_bytes

    return cpu_memory_bytes()[1] / GIB


def memory_metric_check(device: str) -> dict[str, Any]:
    """The per-phase memory metric follows a 256 MiB allocation (CUDA allocator on GPU, RSS on CPU)."""
    from hybridrl.parallel.memory import memory_metrics

    key = "memory/check_allocated_gib"
    before = memory_metrics("check", device)[key]
    held = torch.ones(256 << 20, dtype=torch.uint8, device=device)  # ones: the pages are really touched
    grown = memory_metrics("check", device)[key] - before
    del held
    return {"memory_metric_grew_gib": round(grown, 3), "memory_metric_ok": grown >= 0.2}


def save(result: dict[str, Any], out: str | None) -> None:
    """Write the figures so far (every part rewrites the file: a timeout keeps what was measured)."""
    if out:
        Path(out).write_text(json.dumps(result, indent=2, default=str))


def run(args: argparse.Namespace, out: str | None = None) -> dict[str, Any]:
    from hybridrl.parallel.device import default_dtype_for, layer_spec_kind, resolve_device
    from hybridrl.parallel.state import destroy_model_parallel, init_distributed, initialize_model_parallel
    from hybridrl.parallel.versions import collect_versions, summary_line

    device = resolve_device(args.device)
    dtype = default_dtype_for(device, args.dtype)
    versions = collect_versions()
    print(summary_line(versions))
    init_distributed(0, 1, master_port=args.port, device=device)
    initialize_model_parallel(device=device)
    result: dict[str, Any] = {"device": device, "dtype": str(dtype), "versions": versions,
                              "layer_spec": layer_spec_kind(device), "batch": args.batch, "seq": args.seq,
                              "models": {}}
    if device == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
    save(result, out)
    try:
        if not args.skip_workers:
            # First: the one part whose inputs start on the host, as the controller's batches do.
            result["workers"] = worker_figures(TINY, device)
            save(result, out)
            result["moe"] = moe_figures(device)
            save(result, out)
            result["lora"] = lora_figures(TINY, device)
            save(result, out)
        result["matmul_tflops"] = matmul_tflops(device, dtype, args.matmul_size)
        result.update(memory_metric_check(device))
        save(result, out)
        for index, (name, config) in enumerate(model_configs(args.tiny).items()):
            started = time.perf_counter()
            models = build_random_model(config, dtype)
            row: dict[str, Any] = {"params_m": sum(p.numel() for p in models[0].parameters()) / 1e6}
            row.update(actor_figures(models[0], config, device, args.batch, args.seq, args.iters, args.peak_tflops))
            row.update(reshard_figures(models, dtype))
            if index == 0:
                row.update(reshard_layout_check(models, config, dtype))
            row.update(speed_figures(config, device, dtype, args.batch, args.seq, args.iters, args.peak_tflops))
            if index == 0 and not args.skip_vllm:
                row.update(vllm_figures(models, config, device, dtype, args.vllm_prompts, args.vllm_tokens))
            row["peak_memory_gib"] = memory_gib(device)
            row["seconds"] = time.perf_counter() - started
            result["models"][name] = row
            save(result, out)
            del models
            if device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
        result["unreached"] = unreached_paths(device, result)
        save(result, out)
    finally:
        # The default process group stays: vLLM's engine destroys its own groups at exit and needs it.
        destroy_model_parallel()
    return result


def render(result: dict[str, Any]) -> str:
    from hybridrl.config.hardware import Efficiency

    lines = [f"device {result.get('gpu', result['device'])}, {result['dtype']}, layer spec {result['layer_spec']}, "
             f"batch {result['batch']} x seq {result['seq']}; measured matmul {result['matmul_tflops']:.3g} TFLOP/s"]
    workers = result.get("workers")
    if workers:
        lines.append(f"workers on a host batch: results on {workers['workers_result_devices']}, log-prob gap vs HF "
                     f"{workers['workers_log_prob_max_abs_diff_vs_hf']:.2e}, update grad norm "
                     f"{workers['workers_update_grad_norm']:.3g} ({workers['workers_update_steps']} step, "
                     f"{workers['workers_update_skipped']} skipped), values finite {workers['workers_values_finite']}, "
                     f"critic step grad norm {workers['workers_critic_grad_norm']:.3g}")
    moe = result.get("moe")
    if moe:
        lines.append(f"MoE (local spec) on {moe['moe_device']}: logits gap vs HF "
                     f"{moe['moe_logits_max_abs_diff_vs_hf']:.2e}, {moe['moe_expert_grads']} expert grads finite "
                     f"{moe['moe_expert_grads_finite']}")
    lora = result.get("lora")
    if lora:
        lines.append(f"LoRA actor ({lora['lora_layer_spec']} spec, {lora['lora_dtypes']}): log-prob gap vs HF "
                     f"{lora['lora_log_prob_max_abs_diff_vs_hf']:.2e}, update moved log-probs by "
                     f"{lora['lora_update_log_prob_change']:.2e}, base unchanged {lora['lora_base_unchanged']}, "
                     f"reference pass vs base {lora['lora_reference_max_abs_diff_vs_base']:.2e}")
    header = ("model", "params M", "train tok/s", "TFLOP/s", "MFU", "logprob tok/s", "reshard s", "buckets",
              "vLLM tok/s", "peak GiB")
    rows = [header]
    for name, r in result["models"].items():
        vllm = f"{r['vllm_generate_tokens_per_s']:.0f}" if r.get("vllm") == "ran" else "-"
        rows.append((name, f"{r['params_m']:.1f}", f"{r['train_tokens_per_s']:.0f}", f"{r['train_tflops']:.3g}",
                     f"{r['mfu']:.1%}", f"{r['logprob_tokens_per_s']:.0f}", f"{r['reshard_s']:.3f}",
                     str(r["reshard_buckets"]), vllm, f"{r['peak_memory_gib']:.2f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    lines += [f"{name}: vllm {r['vllm']}" for name, r in result["models"].items()
              if "vllm" in r and r["vllm"] != "ran"]
    lines += [f"{name}: resharded {r['reshard_layout_tensors']} tensors, {r['reshard_layout_mismatches']} differ "
              "from the layout math" for name, r in result["models"].items() if "reshard_layout_tensors" in r]
    lines += [f"{name}: update tok/s with hybridrl's cuda defaults {r['hybridrl_defaults_train_tokens_per_s']:.0f} "
              f"(MFU {r['hybridrl_defaults_mfu']:.1%}) vs megatron's dataclass defaults "
              f"{r['megatron_defaults_train_tokens_per_s']:.0f} (MFU {r['megatron_defaults_mfu']:.1%}): "
              f"x{r['speedup']:.2f}; on {', '.join(r['speed_on'])}; off here {', '.join(r['speed_off'])}"
              for name, r in result["models"].items() if "speedup" in r]
    stated = Efficiency()
    lines += [f"{name}: the step-time model's efficiencies this device implies (hybridrl's cuda defaults): "
              f"update_matmul {r['hybridrl_defaults_update_matmul_implied']:.3f} (stated {stated.update_matmul}), "
              f"forward_matmul {r['hybridrl_defaults_forward_matmul_implied']:.3f} (stated {stated.forward_matmul})"
              for name, r in result["models"].items() if "hybridrl_defaults_update_matmul_implied" in r]
    lines += [f"not reached here: {path}" for path in result.get("unreached", [])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu", "auto"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="one tiny model, small batch (CPU logic check)")
    parser.add_argument("--dtype", default=None, help="default: bf16 on cuda, fp32 on cpu")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default 8; tiny 2)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 2048; tiny 64)")
    parser.add_argument("--iters", type=int, default=None, help="timed iterations (default 5; tiny 2)")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H100/H200 SXM)")
    parser.add_argument("--matmul-size", type=int, default=None, help="default 8192; tiny 256")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--skip-workers", action="store_true", help="skip the workers' data path on a host batch")
    parser.add_argument("--vllm-prompts", type=int, default=None, help="default 256; tiny 4")
    parser.add_argument("--vllm-tokens", type=int, default=None, help="new tokens per prompt (default 256; tiny 8)")
    parser.add_argument("--port", type=int, default=29517, help="TCP port for the world-1 process group")
    parser.add_argument("--out", default=None, help="JSON output (default $OUT/gpu_check.json when OUT is set)")
    args = parser.parse_args(argv)
    defaults = {"batch": (8, 2), "seq": (2048, 64), "iters": (5, 2), "matmul_size": (8192, 256),
                "vllm_prompts": (256, 4), "vllm_tokens": (256, 8)}
    for key, (full, tiny) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, tiny if args.tiny else full)
    out = args.out or (str(Path(os.environ["OUT"]) / "gpu_check.json") if os.environ.get("OUT") else None)
    result = run(args, out)
    print(render(result))
    save(result, out)
    if out:
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
