"""Each validation rule: a config that breaks it is refused naming the field; its fix is accepted."""
import json
from pathlib import Path

import pytest

from hybridrl.config import ConfigError, plan_from_sources

ROOT = Path(__file__).resolve().parents[1]
SEED = ROOT / "configs/examples/seed_6gpu_grpo.yaml"  # Qwen2.5-0.5B shape: 14 heads, 2 KV, 24 layers
A = "actor_rollout_ref.actor"
R = "actor_rollout_ref.rollout"


def model_dir(tmp_path: Path, heads: int = 12, kv: int = 4, layers: int = 6, vocab: int = 1000, ffn: int = 256) -> str:
    folder = tmp_path / f"m_{heads}_{kv}_{layers}_{vocab}_{ffn}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64 * heads, "intermediate_size": ffn,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
        "vocab_size": vocab, "max_position_embeddings": 4096,
    }))
    return f"actor_rollout_ref.model.path={folder}"


def issues_for(overrides):
    with pytest.raises(ConfigError) as info:
        plan_from_sources(SEED, overrides)
    return info.value.issues


# (bad overrides, field that must be named, text in the rule, overrides that fix it)
CASES = {
    "rollout tp divides world": ([f"{R}.tensor_model_parallel_size=4"], f"{R}.tensor_model_parallel_size",
                                 "must divide the 6 GPUs", [f"{R}.tensor_model_parallel_size=1"]),
    "actor tp divides world": ([f"{A}.megatron.tensor_model_parallel_size=4"],
                               f"{A}.megatron.tensor_model_parallel_size", "must divide the 6 GPUs",
                               [f"{A}.megatron.tensor_model_parallel_size=2"]),
    "actor pp divides world/tp": ([f"{A}.megatron.pipeline_model_parallel_size=4"],
                                  f"{A}.megatron.pipeline_model_parallel_size", "must divide the 6 GPUs",
                                  [f"{A}.megatron.pipeline_model_parallel_size=3"]),
    "cp divides world/(tp*pp)": ([f"{A}.megatron.context_parallel_size=4"], f"{A}.megatron.context_parallel_size",
                                 "must divide", [f"{A}.megatron.context_parallel_size=2"]),
    "update micro divides per-rank mini": ([f"{A}.ppo_micro_batch_size_per_gpu=7"],
                                           f"{A}.ppo_micro_batch_size_per_gpu", "120 sequences per GPU",
                                           [f"{A}.ppo_micro_batch_size_per_gpu=10"]),
    "log-prob micro divides per-rank batch": ([f"{R}.log_prob_micro_batch_size_per_gpu=7"],
                                              f"{R}.log_prob_micro_batch_size_per_gpu", "120 sequences",
                                              [f"{R}.log_prob_micro_batch_size_per_gpu=12"]),
    "ref micro divides per-rank batch": (["actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=9"],
                                         "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", "120",
                                         ["actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4"]),
    "mini <= train batch": ([f"{A}.ppo_mini_batch_size=120"], f"{A}.ppo_mini_batch_size",
                            "must divide data.train_batch_size=60", [f"{A}.ppo_mini_batch_size=20"]),
    "mini divides train batch": ([f"{A}.ppo_mini_batch_size=25"], f"{A}.ppo_mini_batch_size",
                                 "must divide data.train_batch_size=60", [f"{A}.ppo_mini_batch_size=20"]),
    "mini x n splits over DP": (
        [f"{R}.n=5", f"{A}.ppo_mini_batch_size=15", f"{A}.ppo_micro_batch_size_per_gpu=5",
         f"{R}.log_prob_micro_batch_size_per_gpu=10", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=10"],
        f"{A}.ppo_mini_batch_size", "data-parallel ranks",
        [f"{R}.n=5", f"{A}.ppo_mini_batch_size=30", f"{A}.ppo_micro_batch_size_per_gpu=5",
         f"{R}.log_prob_micro_batch_size_per_gpu=10", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=10"]),
    "train batch splits over rollout replicas": (
        ["data.train_batch_size=62", f"{A}.ppo_mini_batch_size=62", f"{A}.ppo_micro_batch_size_per_gpu=4",
         f"{R}.log_prob_micro_batch_size_per_gpu=4", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4"],
        "data.train_batch_size", "3 rollout replicas",
        ["data.train_batch_size=66", f"{A}.ppo_mini_batch_size=66", f"{A}.ppo_micro_batch_size_per_gpu=4",
         f"{R}.log_prob_micro_batch_size_per_gpu=4", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4"]),
    "actor tp divides attention heads": ([f"{A}.megatron.tensor_model_parallel_size=3"],
                                         f"{A}.megatron.tensor_model_parallel_size", "14 attention heads",
                                         [f"{A}.megatron.tensor_model_parallel_size=2"]),
    "rollout tp divides attention heads": ([f"{R}.tensor_model_parallel_size=3"], f"{R}.tensor_model_parallel_size",
                                           "14 attention heads", [f"{R}.tensor_model_parallel_size=1"]),
    "prompt length positive": (["data.max_prompt_length=0"], "data.max_prompt_length", ">= 1",
                               ["data.max_prompt_length=16"]),
    "lengths within max positions": (["data.max_response_length=40000"], "data.max_response_length",
                                     "max_position_embeddings=32768", ["data.max_response_length=30000"]),
    "rollout response within data limit": ([f"{R}.response_length=2048"], f"{R}.response_length",
                                           "must not exceed", [f"{R}.response_length=512"]),
    "lr in range": ([f"{A}.optim.lr=0"], f"{A}.optim.lr", "must be in (0, 1)", [f"{A}.optim.lr=3e-6"]),
    "lr not huge": ([f"{A}.optim.lr=2.0"], f"{A}.optim.lr", "must be in (0, 1)", [f"{A}.optim.lr=0.5"]),
    "clip low in range": ([f"{A}.clip_ratio_low=1.2"], f"{A}.clip_ratio_low", "(0, 1)", [f"{A}.clip_ratio_low=0.2"]),
    "clip high positive": ([f"{A}.clip_ratio_high=-0.1"], f"{A}.clip_ratio_high", "(0, 10]",
                           [f"{A}.clip_ratio_high=0.28"]),
    "dual clip above 1": ([f"{A}.clip_ratio_c=0.5"], f"{A}.clip_ratio_c", "(1,", [f"{A}.clip_ratio_c=3.0"]),
    "gamma in [0,1]": (["algorithm.gamma=1.5"], "algorithm.gamma", "[0, 1]", ["algorithm.gamma=0.99"]),
    "lam in [0,1]": (["algorithm.lam=-0.1"], "algorithm.lam", "[0, 1]", ["algorithm.lam=0.95"]),
    "unknown estimator": (["algorithm.adv_estimator=grop"], "algorithm.adv_estimator", "did you mean 'grpo'",
                          ["algorithm.adv_estimator=rloo"]),
    "unknown old log-prob mode": ([f"{A}.old_log_prob=always"], f"{A}.old_log_prob", "valid: auto, recompute",
                                  [f"{A}.old_log_prob=recompute"]),
    "unknown loss agg mode": ([f"{A}.loss_agg_mode=token_mean"], f"{A}.loss_agg_mode", "did you mean 'token-mean'",
                              [f"{A}.loss_agg_mode=seq-mean-token-sum-norm"]),
    "unknown kl type": ([f"{A}.kl_loss_type=k5"], f"{A}.kl_loss_type", "KL estimator", [f"{A}.kl_loss_type=k3"]),
    "group estimator needs n >= 2": ([f"{R}.n=1"], f"{R}.n", "must be >= 2", [f"{R}.n=4"]),
    "world size positive": (["trainer.nnodes=0"], "trainer.nnodes", ">= 1", ["trainer.nnodes=1"]),
    "torch threads positive": (["trainer.torch_threads_per_rank=0"], "trainer.torch_threads_per_rank", ">= 1",
                               ["trainer.torch_threads_per_rank=3"]),
    "vpp needs pp": ([f"{A}.megatron.virtual_pipeline_model_parallel_size=2"],
                     f"{A}.megatron.virtual_pipeline_model_parallel_size", "needs pipeline_model_parallel_size > 1",
                     [f"{A}.megatron.virtual_pipeline_model_parallel_size=2",
    "nccl timeout positive": (["trainer.nccl_timeout_s=0"], "trainer.nccl_timeout_s", "must be in (0, 604800]",
                              ["trainer.nccl_timeout_s=600"]),
    "nccl timeout a number": (["trainer.nccl_timeout_s=-30"], "trainer.nccl_timeout_s", "must be in (0,",
                              ["trainer.nccl_timeout_s=3600.5"]),
                      f"{A}.megatron.pipeline_model_parallel_size=3",
                      f"{A}.ppo_micro_batch_size_per_gpu=4", f"{R}.log_prob_micro_batch_size_per_gpu=4",
                      "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4"]),
    "trained vpp needs pp > 2": ([f"{A}.megatron.virtual_pipeline_model_parallel_size=2",
                                  f"{A}.megatron.pipeline_model_parallel_size=2",
                                  f"{A}.ppo_micro_batch_size_per_gpu=4", f"{R}.log_prob_micro_batch_size_per_gpu=4",
                                  "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4"],
                                 f"{A}.megatron.virtual_pipeline_model_parallel_size", "> 2 for a trained role",
                                 [f"{A}.megatron.pipeline_model_parallel_size=2",
                                  f"{A}.ppo_micro_batch_size_per_gpu=4", f"{R}.log_prob_micro_batch_size_per_gpu=4",
                                  "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4"]),
    "dynamic sampling needs a group estimator": (
        ["algorithm.filter_groups.enable=true", "algorithm.adv_estimator=reinforce_plus_plus"],
        "algorithm.filter_groups.enable", "needs a group estimator",
        ["algorithm.filter_groups.enable=true", "algorithm.adv_estimator=grpo"]),
    "overlong buffer within response length": (
        ["algorithm.overlong_buffer.enable=true", "algorithm.overlong_buffer.len=2000"],
        "algorithm.overlong_buffer.len", "data.max_response_length=1024",
        ["algorithm.overlong_buffer.enable=true", "algorithm.overlong_buffer.len=256"]),
    "no param offload for a trained role": ([f"{A}.megatron.param_offload=true"], f"{A}.megatron.param_offload",
                                            "frozen roles", [f"{A}.megatron.optimizer_offload=true"]),
    "top_p in (0,1]": ([f"{R}.top_p=0"], f"{R}.top_p", "(0, 1]", [f"{R}.top_p=0.9"]),
    "gpu memory utilization": ([f"{R}.gpu_memory_utilization=1.5"], f"{R}.gpu_memory_utilization", "(0, 1]",
                               [f"{R}.gpu_memory_utilization=0.9"]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_rule_refuses_bad_and_accepts_fix(name):
    bad, field, fragment, good = CASES[name]
    issues = issues_for(bad)
    named = [i for i in issues if i.field == field]
    assert named, f"no issue names {field}: {[str(i) for i in issues]}"
    assert any(fragment in str(i) for i in named), [str(i) for i in named]
    plan = plan_from_sources(SEED, good)  # the fix is accepted
    assert plan.sequences_per_step > 0


# Model-shape rules on custom shapes (heads, KV heads, layers, vocab).
SHAPE_CASES = {
    "actor tp vs kv heads": (dict(heads=12, kv=4), [f"{A}.megatron.tensor_model_parallel_size=6"],
                             f"{A}.megatron.tensor_model_parallel_size", "4 KV heads",
                             [f"{A}.megatron.tensor_model_parallel_size=2"]),
    "actor tp vs intermediate size": (dict(heads=12, kv=12, ffn=256), [f"{A}.megatron.tensor_model_parallel_size=3"],
                                      f"{A}.megatron.tensor_model_parallel_size", "intermediate_size=256",
                                      [f"{A}.megatron.tensor_model_parallel_size=2"]),
    "rollout tp vs kv heads": (dict(heads=12, kv=4), [f"{R}.tensor_model_parallel_size=6"],
                               f"{R}.tensor_model_parallel_size", "4 KV heads", [f"{R}.tensor_model_parallel_size=2"]),
    "rollout tp vs padded vocab": (dict(heads=12, kv=12, vocab=1000), [f"{R}.tensor_model_parallel_size=3"],
                                   f"{R}.tensor_model_parallel_size", "1000 -> 1024",
                                   [f"{R}.tensor_model_parallel_size=2"]),
    "layers vs pp": (dict(layers=4), [f"{A}.megatron.pipeline_model_parallel_size=3",
                                      f"{A}.ppo_micro_batch_size_per_gpu=4",
                                      f"{R}.log_prob_micro_batch_size_per_gpu=4",
                                      "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4"],
                     f"{A}.megatron.pipeline_model_parallel_size", "must divide the model's 4 layers",
                     [f"{A}.megatron.pipeline_model_parallel_size=2", f"{A}.ppo_micro_batch_size_per_gpu=4",
                      f"{R}.log_prob_micro_batch_size_per_gpu=4",
                      "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4"]),
    "layers vs pp x vpp": (dict(layers=6), [f"{A}.megatron.pipeline_model_parallel_size=3",
                                            f"{A}.megatron.virtual_pipeline_model_parallel_size=3",
                                            f"{A}.ppo_micro_batch_size_per_gpu=4",
                                            f"{R}.log_prob_micro_batch_size_per_gpu=4",
                                            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4"],
                           f"{A}.megatron.virtual_pipeline_model_parallel_size", "PP×VPP=9",
                           [f"{A}.megatron.pipeline_model_parallel_size=3",
                            f"{A}.megatron.virtual_pipeline_model_parallel_size=2",
                            f"{A}.ppo_micro_batch_size_per_gpu=4", f"{R}.log_prob_micro_batch_size_per_gpu=4",
                            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4"]),
}


@pytest.mark.parametrize("name", sorted(SHAPE_CASES))
def test_shape_rule_refuses_bad_and_accepts_fix(name, tmp_path):
    shape, bad, field, fragment, good = SHAPE_CASES[name]
    model = model_dir(tmp_path, **shape)
    issues = issues_for([model, *bad])
    named = [i for i in issues if i.field == field]
    assert named and any(fragment in str(i) for i in named), [str(i) for i in issues]
    plan_from_sources(SEED, [model, *good])


def test_all_errors_reported_at_once_with_valid_values():
    issues = issues_for([f"{R}.tensor_model_parallel_size=4", f"{A}.ppo_micro_batch_size_per_gpu=7",
                         "algorithm.gamma=2", "data.train_batch_sze=3"])
    text = [str(i) for i in issues]
    assert "actor_rollout_ref.rollout.tensor_model_parallel_size=4 must divide the 6 GPUs; valid: 1, 2, 3, 6" in text
    assert any(t.startswith("data.train_batch_sze=3 unknown key; did you mean 'train_batch_size'") for t in text)
    assert any(t.startswith("algorithm.gamma=2") for t in text)
    micro = next(i for i in issues if i.field == f"{A}.ppo_micro_batch_size_per_gpu")
    assert all(120 % v == 0 for v in micro.valid) and 8 in micro.valid


def test_sliding_window_caps_sequence_length(tmp_path):
    folder = tmp_path / "mistral"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["MistralForCausalLM"], "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
        "max_position_embeddings": 32768, "sliding_window": 1024,
    }))
    model = f"actor_rollout_ref.model.path={folder}"
    issues = issues_for([model, "data.max_prompt_length=512", "data.max_response_length=1024"])
    assert any(i.field == "data.max_response_length" and "sliding_window=1024" in str(i) and i.valid == (512,)
               for i in issues), [str(i) for i in issues]
    plan_from_sources(SEED, [model, "data.max_prompt_length=512", "data.max_response_length=512"])


def test_unsupported_architecture_is_an_error(tmp_path):
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_layer": 2}))
    issues = issues_for([f"actor_rollout_ref.model.path={folder}"])
    assert any(i.field == "actor_rollout_ref.model.path" and "GPT2LMHeadModel" in str(i) for i in issues)


def test_missing_model_folder_skips_shape_checks_with_a_warning():
    plan = plan_from_sources(SEED, ["actor_rollout_ref.model.path=/nonexistent/model"])
    assert plan.model is None and plan.training_memory == ()
    assert any("no config.json" in w for w in plan.warnings)
