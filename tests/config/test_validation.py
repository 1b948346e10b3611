"""Each validation rule: a config that breaks it is refused naming the field; its fix is accepted."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybridrl.config import ConfigError, plan_from_sources
from hybridrl.config.report import render_plan
from tests.support.models_fixtures import moe_model_dir

ROOT = Path(__file__).resolve().parents[2]
SEED = ROOT / "configs/examples/seed_6gpu_grpo.yaml"  # Qwen2.5-0.5B shape: 14 heads, 2 KV, 24 layers
A = "actor_rollout_ref.actor"
R = "actor_rollout_ref.rollout"
RC = "algorithm.rollout_correction"


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


CPU_CP2 = ("trainer.device=cpu", f"{A}.megatron.context_parallel_size=2")
MT = (f"{R}.multi_turn.enable=true",)  # multi-turn on (the seed config generates at inference TP 2)

# two pipeline stages on the seed's 6 GPUs (DP 3: micro-batches that divide its rows)
PP2 = (f"{A}.megatron.pipeline_model_parallel_size=2", f"{A}.ppo_micro_batch_size_per_gpu=4",
       f"{R}.log_prob_micro_batch_size_per_gpu=4", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4")

PP3 = (f"{A}.megatron.pipeline_model_parallel_size=3", *PP2[1:])

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
    "cp on cuda refused until wired": ([f"{A}.megatron.context_parallel_size=2"],
                                       f"{A}.megatron.context_parallel_size", "trainer.device=cpu only so far",
                                       [f"{A}.megatron.context_parallel_size=1"]),
    "cp x tp x pp divides world": (["trainer.device=cpu", f"{A}.megatron.context_parallel_size=4"],
                                   f"{A}.megatron.context_parallel_size", "CP × TP × PP × DP = world",
                                   ["trainer.device=cpu", f"{A}.megatron.context_parallel_size=2"]),
    "ref cp differs from actor": (["trainer.device=cpu", "actor_rollout_ref.ref.megatron.context_parallel_size=2"],
                                  "actor_rollout_ref.ref.megatron.context_parallel_size",
                                  f"must equal {A}.megatron.context_parallel_size=1",
                                  ["trainer.device=cpu", "actor_rollout_ref.ref.megatron.context_parallel_size=2",
                                   f"{A}.megatron.context_parallel_size=2"]),
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
                                     "max_position_embeddings=32768", ["data.max_response_length=3000"]),
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
    # greedy samples: a prompt's n answers are one, and every group-relative advantage is 0 (nothing trains)
    "group estimator needs sampling": ([f"{R}.temperature=0"], f"{R}.temperature",
                                       "with algorithm.adv_estimator=grpo each scores what the other samples of its "
                                       "prompt score: every advantage is 0", [f"{R}.temperature=0.6"]),
    "group estimator needs top_k above 1": ([f"{R}.top_k=1", "algorithm.adv_estimator=rloo"], f"{R}.top_k",
                                            "decodes greedily", [f"{R}.top_k=50", "algorithm.adv_estimator=rloo"]),
    "remax needs sampling": ([f"{R}.temperature=0", "algorithm.adv_estimator=remax"], f"{R}.temperature",
                             "each scores what the prompt's greedy baseline scores",
                             [f"{R}.temperature=1.0", "algorithm.adv_estimator=remax"]),
    "world size positive": (["trainer.nnodes=0"], "trainer.nnodes", ">= 1", ["trainer.nnodes=1"]),
    "torch threads positive": (["trainer.torch_threads_per_rank=0"], "trainer.torch_threads_per_rank", ">= 1",
                               ["trainer.torch_threads_per_rank=3"]),
    "nccl timeout positive": (["trainer.nccl_timeout_s=0"], "trainer.nccl_timeout_s", "must be in (0, 604800]",
                              ["trainer.nccl_timeout_s=600"]),
    "nccl timeout not negative": (["trainer.nccl_timeout_s=-30"], "trainer.nccl_timeout_s", "must be in (0,",
                              ["trainer.nccl_timeout_s=3600.5"]),
    "restarts not negative": (["trainer.max_restarts=-1"], "trainer.max_restarts", ">= 0",
                              ["trainer.max_restarts=2"]),
    "restart wait positive": (["trainer.restart_wait_s=0"], "trainer.restart_wait_s", "must be in (0, 604800]",
                              ["trainer.restart_wait_s=120"]),
    "vpp needs pp": ([f"{A}.megatron.virtual_pipeline_model_parallel_size=2"],
                     f"{A}.megatron.virtual_pipeline_model_parallel_size", "needs pipeline_model_parallel_size > 1",
                     [f"{A}.megatron.virtual_pipeline_model_parallel_size=2",
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
    "uneven stages need pp": ([f"{A}.megatron.num_layers_in_last_pipeline_stage=3"],
                              f"{A}.megatron.num_layers_in_last_pipeline_stage",
                              "needs pipeline_model_parallel_size > 1 (it is 1)",
                              [f"{A}.megatron.num_layers_in_last_pipeline_stage=3", *PP2]),
    "uneven stage at least one layer": ([f"{A}.megatron.num_layers_in_first_pipeline_stage=0", *PP2],
                                        f"{A}.megatron.num_layers_in_first_pipeline_stage", "integer >= 1",
                                        [f"{A}.megatron.num_layers_in_first_pipeline_stage=1", *PP2]),
    "dynamic sampling needs a group estimator": (
        ["algorithm.filter_groups.enable=true", "algorithm.adv_estimator=reinforce_plus_plus"],
        "algorithm.filter_groups.enable", "needs a group estimator",
        ["algorithm.filter_groups.enable=true", "algorithm.adv_estimator=grpo"]),
    "dynamic sampling's unbounded rounds (verl's 0)": (
        ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=0"],
        "algorithm.filter_groups.max_num_gen_batches", "is verl's 'no upper limit', which hybridrl does not offer",
        ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=10"]),
    "overlong buffer within response length": (
        ["algorithm.overlong_buffer.enable=true", "algorithm.overlong_buffer.len=2000"],
        "algorithm.overlong_buffer.len", "data.max_response_length=1024",
        ["algorithm.overlong_buffer.enable=true", "algorithm.overlong_buffer.len=256"]),
    "no param offload for the critic": (["algorithm.adv_estimator=gae", "critic.megatron.param_offload=true"],
                                        "critic.megatron.param_offload", "the colocated actor and the frozen roles",
                                        ["algorithm.adv_estimator=gae", "critic.megatron.optimizer_offload=true"]),
    "tis cap at least 1": ([f"{RC}.is_level=token", f"{RC}.is_cap=0.5"], f"{RC}.is_cap", "must be in [1, 1e+06]",
                           [f"{RC}.is_level=token", f"{RC}.is_cap=1.5"]),
    "mis band low below 1": ([f"{RC}.mask_level=token", f"{RC}.mask_low=1.2"], f"{RC}.mask_low", "must be in [0, 1)",
                             [f"{RC}.mask_level=token", f"{RC}.mask_low=0"]),
    "mis band high above 1": ([f"{RC}.mask_level=geometric", f"{RC}.mask_high=0.9"], f"{RC}.mask_high",
                              "must be in (1, 1e+06]", [f"{RC}.mask_level=geometric", f"{RC}.mask_high=1.1"]),
    "top_p in (0,1]": ([f"{R}.top_p=0"], f"{R}.top_p", "(0, 1]", [f"{R}.top_p=0.9"]),
    "gpu memory utilization": ([f"{R}.gpu_memory_utilization=1.5"], f"{R}.gpu_memory_utilization", "(0, 1]",
                               [f"{R}.gpu_memory_utilization=0.8"]),
    # numpy refuses a negative seed or one of 2**32 at the workers' start-up, after Ray and vLLM
    "trainer seed": (["trainer.seed=-1"], "trainer.seed", "must be in [0, 2**31)", ["trainer.seed=0"]),
    "rollout seed": ([f"{R}.seed=-5"], f"{R}.seed", "must be in [0, 2**31)", [f"{R}.seed=5"]),
    "megatron seed": ([f"{A}.megatron.seed={2**32}"], f"{A}.megatron.seed", "must be in [0, 2**31)",
                      [f"{A}.megatron.seed={2**31 - 1}"]),
    "critic megatron seed": (["algorithm.adv_estimator=gae", "critic.megatron.seed=-3"], "critic.megatron.seed",
                             "must be in [0, 2**31)", ["algorithm.adv_estimator=gae", "critic.megatron.seed=3"]),
    # settings that would do nothing: validation without validation data, tools without tool calling, a named
    # scorer beside a custom function that scores every row, a function name without its file
    "test_freq needs val files": (["trainer.test_freq=2", "data.val_files=[]"], "trainer.test_freq",
                                  "validates on data.val_files, which is empty", ["trainer.test_freq=2"]),
    "val_before_train needs val files": (["trainer.val_before_train=true", "data.val_files=[]"],
                                         "trainer.val_before_train", "data.val_files, which is empty",
                                         ["trainer.val_before_train=true"]),
    "tools need multi-turn": ([f"{R}.multi_turn.tools=[calculator]"], f"{R}.multi_turn.tools",
                              "multi_turn.enable=false", [f"{R}.multi_turn.tools=[calculator]", *MT]),
    "one scorer": (["algorithm.reward_fn=gsm8k", f"algorithm.custom_reward_function.path={ROOT / 'setup.py'}"],
                   "algorithm.reward_fn", "scores every row: keep one",
                   [f"algorithm.custom_reward_function.path={ROOT / 'setup.py'}"]),
    # the reward worker's deadline and the score of a sample past it: refused at plan, not a ValueError at train
    "reward timeout positive": (["algorithm.custom_reward_function.timeout_s=0"],
                                "algorithm.custom_reward_function.timeout_s", "must be in (0, 604800]",
                                ["algorithm.custom_reward_function.timeout_s=30"]),
    # the reward processes that score a batch at once: a count, and only beside the deadline that puts calls in them
    "reward workers at least one": (["algorithm.custom_reward_function.num_workers=0"],
                                    "algorithm.custom_reward_function.num_workers", "must be an integer in [1, 1024]",
                                    ["algorithm.custom_reward_function.num_workers=2"]),
    "reward workers not negative": (["algorithm.custom_reward_function.num_workers=-1"],
                                    "algorithm.custom_reward_function.num_workers", "must be an integer in [1, 1024]",
                                    ["algorithm.custom_reward_function.num_workers=1"]),
    "reward workers a number": (["algorithm.custom_reward_function.num_workers=x"],
                                "algorithm.custom_reward_function.num_workers", "must be int, got str",
                                ["algorithm.custom_reward_function.num_workers=4"]),
    "reward workers bounded": (["algorithm.custom_reward_function.num_workers=1025"],
                               "algorithm.custom_reward_function.num_workers", "the trainer holds a pipe to each",
                               ["algorithm.custom_reward_function.num_workers=1"]),
    "reward workers need the timeout": (["algorithm.custom_reward_function.num_workers=2",
                                         "algorithm.custom_reward_function.timeout_s=null"],
                                        "algorithm.custom_reward_function.num_workers",
                                        "timeout_s=null calls them in the trainer's process",
                                        ["algorithm.custom_reward_function.num_workers=1",
                                         "algorithm.custom_reward_function.timeout_s=null"]),
    "fallback score finite": (["algorithm.custom_reward_function.fallback_score=.nan"],
                              "algorithm.custom_reward_function.fallback_score", "must be a finite number",
                              ["algorithm.custom_reward_function.fallback_score=-1"]),
    "custom function name needs its file": (["algorithm.custom_reward_function.name=my_score"],
                                            "algorithm.custom_reward_function.name", "path (the file defining it)",
                                            ["algorithm.custom_reward_function.name=compute_score"]),
}


def assert_refused_then_fixed(bad: list[str], field: str, fragment: str, good: list[str]) -> None:
    """`bad` is refused naming `field` with `fragment` in the rule; `good` plans."""
    issues = issues_for(bad)
    named = [i for i in issues if i.field == field]
    assert named, f"no issue names {field}: {[str(i) for i in issues]}"
    assert any(fragment in str(i) for i in named), [str(i) for i in named]
    plan = plan_from_sources(SEED, good)  # the fix is accepted
    assert plan.sequences_per_step > 0


@pytest.mark.parametrize("name", sorted(CASES))
def test_rule_refuses_bad_and_accepts_fix(name):
    assert_refused_then_fixed(*CASES[name])


def test_the_plan_shows_the_reward_processes_and_warns_of_more_than_the_cores():
    """The Reward line says how many processes make the calls; more than this machine's cores is a warning (a CPU-bound
    function's calls would share them), not an error (a function that waits on a service gains from more)."""
    from hybridrl.parallel.device import usable_cores

    field = "algorithm.custom_reward_function.num_workers"
    plan = plan_from_sources(SEED, [f"{field}=2"])
    (line,) = [line for line in render_plan(plan).splitlines() if line.startswith("Reward: ")]
    assert "each call may take 300 s, in 2 processes of their own, 2 calls at once (algorithm.custom_reward_function" \
           ".timeout_s, num_workers)" in line, line
    one = plan_from_sources(SEED, [])
    assert "in a process of its own, one call after another" in render_plan(one)
    assert not [w for w in one.warnings if field in w]
    crowded = plan_from_sources(SEED, [f"{field}={usable_cores() + 1}"])
    assert [w for w in crowded.warnings if w.startswith(f"{field}={usable_cores() + 1} is more reward processes "
                                                        f"than the {usable_cores()} cores")], crowded.warnings


# Model-shape rules on custom shapes (heads, KV heads, layers, vocab).
SHAPE_CASES = {
    # vLLM refuses a stop id outside [0, vocab_size) at the first generation: the ids index its logits
    "stop token ids inside the vocabulary": (dict(vocab=1000), [f"{R}.stop_token_ids=[5,1000]"],
                                             f"{R}.stop_token_ids", "[1000]; each must be in [0, 1000) (the model's "
                                             "vocab_size is 1000)", [f"{R}.stop_token_ids=[5,999]"]),
    "stop token ids are never negative": (dict(vocab=1000), [f"{R}.stop_token_ids=[-1]"], f"{R}.stop_token_ids",
                                          "[-1]; each must be in [0, 1000)", [f"{R}.stop_token_ids=[0]"]),
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
    # uneven stages (megatron's num_layers_in_first/last_pipeline_stage) against the model's layers
    "uneven stages add up at pp 2": (dict(layers=6), [f"{A}.megatron.num_layers_in_first_pipeline_stage=2",
                                                      f"{A}.megatron.num_layers_in_last_pipeline_stage=2", *PP2],
                                     f"{A}.megatron.num_layers_in_first_pipeline_stage",
                                     "must add up to the 6 layers at pp=2; valid: 4",
                                     [f"{A}.megatron.num_layers_in_first_pipeline_stage=4",
                                      f"{A}.megatron.num_layers_in_last_pipeline_stage=2", *PP2]),
    "uneven stages leave a layer per stage": (
        dict(layers=6), [f"{A}.megatron.num_layers_in_last_pipeline_stage=6", *PP2],
        f"{A}.megatron.num_layers_in_last_pipeline_stage", "every stage needs at least 1; valid: 1, 2, 3, 4, 5",
        [f"{A}.megatron.num_layers_in_last_pipeline_stage=5", *PP2]),
    "uneven stages divide the middle": (
        dict(layers=6), [f"{A}.megatron.num_layers_in_last_pipeline_stage=1", *PP3],
        f"{A}.megatron.num_layers_in_last_pipeline_stage",
        "leave 5 layers, not divisible by the other 2 stage(s); valid: 2, 4",
        [f"{A}.megatron.num_layers_in_last_pipeline_stage=2", *PP3]),
}


@pytest.mark.parametrize("name", sorted(SHAPE_CASES))
def test_shape_rule_refuses_bad_and_accepts_fix(name, tmp_path):
    shape, bad, field, fragment, good = SHAPE_CASES[name]
    model = model_dir(tmp_path, **shape)
    issues = issues_for([model, *bad])
    named = [i for i in issues if i.field == field]
    assert named and any(fragment in str(i) for i in named), [str(i) for i in issues]
    plan_from_sources(SEED, [model, *good])


def test_a_negative_stop_token_is_refused_without_the_model():
    """No config.json to read the vocabulary from (the seed config names no folder here): a negative id is wrong
    whatever the model."""
    issues = issues_for([f"{R}.stop_token_ids=[-1,7]", "actor_rollout_ref.model.path=/no/such/model"])
    named = [str(i) for i in issues if i.field == f"{R}.stop_token_ids"]
    assert named == [f"{R}.stop_token_ids=[-1, 7] holds token ids outside the vocabulary: [-1]; each must be 0 or "
                     "more (token ids count from 0)"], [str(i) for i in issues]


def test_multi_turn_plans_at_inference_tp2():
    """The seed config's replicas are infer_tp 2: their TP rank 0 runs the tools and broadcasts the
    answers (tests/rollout/test_engine.py), so the agent loop is not refused there."""
    plan = plan_from_sources(SEED, [*MT, f"{R}.multi_turn.tools=[calculator]"])
    assert plan.config.actor_rollout_ref.rollout.tensor_model_parallel_size == 2


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


def test_yarn_is_shown_by_the_plan_and_caps_at_vllms_table(tmp_path):
    """A Qwen2 with YaRN plans, its note naming the factor, original length and attention factor; sequences beyond
    original_max_position_embeddings x factor (vLLM's cos/sin table) are refused when max_position_embeddings is
    larger still."""
    folder = tmp_path / "qwen2"
    folder.mkdir()
    config = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 256, "intermediate_size": 512,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
              "max_position_embeddings": 32768, "rope_theta": 1e6,
              "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    (folder / "config.json").write_text(json.dumps(config))
    model = f"actor_rollout_ref.model.path={folder}"
    text = render_plan(plan_from_sources(SEED, [model, "data.max_prompt_length=512", "data.max_response_length=512"]))
    assert ("config.json: YaRN RoPE scaling x4 of original_max_position_embeddings=32768 (beta_fast 32, beta_slow 1: "
            "megatron's YarnRotaryEmbedding), attention factor 1.13863") in text, text
    config["rope_scaling"] = {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 512}
    (folder / "config.json").write_text(json.dumps(config))
    issues = issues_for([model, "data.max_prompt_length=512", "data.max_response_length=1024"])
    assert any(i.field == "data.max_response_length" and "YaRN table of 1024 positions" in str(i)
               and i.valid == (512,) for i in issues), [str(i) for i in issues]


def test_qwen_window_and_rope_scaling_are_checked_and_shown_by_the_plan(tmp_path):
    """A Qwen2 with use_sliding_window: true is capped at its window (vLLM windows every layer), named in the plan
    with its linear RoPE scaling, and its attention_dropout in a warning; one whose layers mix windowed and full
    attention is refused at plan time, naming max_window_layers and what is valid."""
    folder = tmp_path / "qwen2"
    folder.mkdir()
    config = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 256, "intermediate_size": 512,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
              "max_position_embeddings": 32768, "use_sliding_window": True, "sliding_window": 1024,
              "max_window_layers": 2, "rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 1e6}
    (folder / "config.json").write_text(json.dumps(config))
    model = f"actor_rollout_ref.model.path={folder}"
    issues = issues_for([model, "data.max_prompt_length=512", "data.max_response_length=1024"])
    assert any(i.field == "data.max_response_length" and "sliding_window=1024" in str(i) and i.valid == (512,)
               for i in issues), [str(i) for i in issues]
    text = render_plan(plan_from_sources(SEED, [model, "data.max_prompt_length=512", "data.max_response_length=512"]))
    assert ("config.json: linear RoPE scaling x2 (positions / 2: megatron's seq_len_interpolation_factor); sliding "
            "window 1024 (vLLM windows every layer, megatron none: sequences up to 1024 tokens)") in text
    (folder / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.1}))
    plan = plan_from_sources(SEED, [model, "data.max_prompt_length=512", "data.max_response_length=512"])
    assert any("attention_dropout=0.1: hybridrl trains without dropout" in w for w in plan.warnings), plan.warnings
    (folder / "config.json").write_text(json.dumps({**config, "max_window_layers": 1}))
    issues = issues_for([model, "data.max_prompt_length=512", "data.max_response_length=512"])
    assert any(i.field == "actor_rollout_ref.model.path" and "max_window_layers=1" in str(i)
               and "vLLM 0.32 refuses" in str(i) for i in issues), [str(i) for i in issues]


@pytest.mark.parametrize("head_dim, device, refused", [(24, "cpu", True), (16, "cpu", True), (32, "cpu", False),
                                                       (24, "cuda", False)])
def test_head_dim_without_a_vllm_kernel_is_refused(tmp_path, head_dim, device, refused):
    """vLLM's CPU attention has kernels for some head sizes only: a model of another passed the plan and stopped
    every rollout worker at start-up ("Unsupported CPU attention configuration: head_dim=24")."""
    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": head_dim, "vocab_size": 1000,
    }))
    model = f"actor_rollout_ref.model.path={folder}"
    # checked with the folders the workers load (plan and train check them; `--layout-only` and the trainer-side
    # pieces a plan sizes do not build vLLM)
    try:
        plan_from_sources(SEED, [model, f"trainer.device={device}"], check_files=True)
        issues = []
    except ConfigError as error:
        issues = error.issues
    mine = [i for i in issues if i.field == "actor_rollout_ref.model.path" and "of head_dim=" in i.rule]
    assert bool(mine) == refused, [str(i) for i in issues]
    if refused:
        assert f"head_dim={head_dim}" in str(mine[0]) and 32 in mine[0].valid and head_dim not in mine[0].valid


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


# Settings the workers would not honour are refused by the plan, one message each, before any process.
MEGATRON_SECTIONS = (f"{A}.megatron", "actor_rollout_ref.ref.megatron", "critic.megatron", "reward_model.megatron")


def _layout_overrides(section: str, field: str, value: str) -> list[str]:
    """`field=value` in `section`, on a TP2 layout for every role (the ref must match the actor's)."""
    tp = [f"{section}.tensor_model_parallel_size=2"]
    if section.startswith("actor_rollout_ref.ref"):
        tp.append(f"{A}.megatron.tensor_model_parallel_size=2")
    return [*tp, f"{section}.{field}={value}"]


REFUSED_IN_EVERY_SECTION = {
    # field: (refused value, as read, text in the rule, accepted value, extra overrides)
    "make_vocab_size_divisible_by": ("64", 64, "only 128 is supported", "128", []),
}


@pytest.mark.parametrize("section", MEGATRON_SECTIONS)
@pytest.mark.parametrize("field", sorted(REFUSED_IN_EVERY_SECTION))
def test_unsupported_layout_setting_refused_in_every_role(section, field):
    bad, value, fragment, good, extra = REFUSED_IN_EVERY_SECTION[field]
    issues = issues_for([*extra, *_layout_overrides(section, field, bad)])
    assert [i.field for i in issues] == [f"{section}.{field}"], [str(i) for i in issues]  # one mistake, one message
    assert issues[0].value == value and fragment in issues[0].rule, str(issues[0])
    plan_from_sources(SEED, [*extra, *_layout_overrides(section, field, good)])


@pytest.mark.parametrize("section", MEGATRON_SECTIONS)
def test_context_parallel_refused_on_cuda_in_every_role(section):
    issues = issues_for([f"{section}.context_parallel_size=2"])
    assert [i.field for i in issues] == [f"{section}.context_parallel_size"], [str(i) for i in issues]
    assert issues[0].value == 2 and "trainer.device=cpu only so far" in issues[0].rule, str(issues[0])
    ref_too = [f"{A}.megatron.context_parallel_size=2"] if section.startswith("actor_rollout_ref.ref") else []
    plan_from_sources(SEED, ["trainer.device=cpu", *ref_too, f"{section}.context_parallel_size=2"])


def test_sequence_parallel_runs_on_either_spec_without_a_warning():
    """On GPUs Transformer Engine's norms run it, and megatron's local spec (a GPU without TE, a LoRA actor, the
    CPU) runs it with torch's norm tagged as TE's (`sequence_parallel_norm`; tests/training/test_ranks.py trains
    with it): kept as set, with nothing to warn of, on either device."""
    overrides = [f"{A}.megatron.tensor_model_parallel_size=2", f"{A}.megatron.sequence_parallel=true"]
    for device in ("cuda", "cpu"):
        plan = plan_from_sources(SEED, [f"trainer.device={device}", *overrides])
        assert plan.layout("actor").megatron.sequence_parallel is True
        assert not any("sequence_parallel" in w for w in plan.warnings), device


REF = "actor_rollout_ref.ref.megatron"
REFUSED = {
    # name: (bad overrides, field named, text in the rule, overrides that fix it)
    "ref tp differs from actor": ([f"{REF}.tensor_model_parallel_size=2"], f"{REF}.tensor_model_parallel_size",
                                  f"must equal {A}.megatron.tensor_model_parallel_size=1",
                                  [f"{REF}.tensor_model_parallel_size=2",
                                   f"{A}.megatron.tensor_model_parallel_size=2"]),
    "ref pp differs from actor": ([f"{REF}.pipeline_model_parallel_size=2"], f"{REF}.pipeline_model_parallel_size",
                                  "the reference policy runs in the actor's processes",
                                  [f"{REF}.pipeline_model_parallel_size=1"]),
    "ref vpp differs from actor": (
        [f"{REF}.pipeline_model_parallel_size=3", f"{A}.megatron.pipeline_model_parallel_size=3",
         f"{REF}.virtual_pipeline_model_parallel_size=2"],
        f"{REF}.virtual_pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size=None",
        [f"{REF}.pipeline_model_parallel_size=3", f"{A}.megatron.pipeline_model_parallel_size=3",
         f"{REF}.virtual_pipeline_model_parallel_size=1"]),  # 1 and null both mean no interleaving
    "ref stage split differs from actor": (
        [*PP2, f"{REF}.pipeline_model_parallel_size=2", f"{REF}.num_layers_in_first_pipeline_stage=20"],
        f"{REF}.num_layers_in_first_pipeline_stage",
        f"must equal {A}.megatron.num_layers_in_first_pipeline_stage=None",
        [*PP2, f"{REF}.pipeline_model_parallel_size=2", f"{REF}.num_layers_in_first_pipeline_stage=20",
         f"{A}.megatron.num_layers_in_first_pipeline_stage=20"]),
    "ref seed differs from actor": ([f"{REF}.seed=7"], f"{REF}.seed", f"{A}.megatron.seed=1234",
                                    [f"{REF}.seed=7", f"{A}.megatron.seed=7"]),
    "ref dtype checked": ([f"{REF}.dtype=bf17"], f"{REF}.dtype", "did you mean 'bf16'", [f"{REF}.dtype=bf16"]),
    "reward model dtype checked": (["reward_model.megatron.dtype=fp33"], "reward_model.megatron.dtype", "dtype",
                                   ["reward_model.megatron.dtype=fp32"]),
    "ref optimizer offload": ([f"{REF}.optimizer_offload=true"], f"{REF}.optimizer_offload",
                              "the reference policy is frozen (no optimizer)", [f"{REF}.param_offload=true"]),
    "reward model grad offload": (["reward_model.megatron.grad_offload=true"], "reward_model.megatron.grad_offload",
                                  "the reward model is frozen (no gradients)",
                                  ["reward_model.megatron.param_offload=true"]),
    "hybrid engine off": (["actor_rollout_ref.hybrid_engine=false"], "actor_rollout_ref.hybrid_engine",
                          "actor_rollout_ref.rollout.mode decides where vLLM runs",
                          ["actor_rollout_ref.hybrid_engine=true"]),
    "rollout log-probs off": ([f"{R}.calculate_log_probs=false"], f"{R}.calculate_log_probs", "cannot be turned off",
                              [f"{R}.calculate_log_probs=true"]),
    "multi-turn without tools": ([*MT], f"{R}.multi_turn.tools", "at least one tool",
                                 [*MT, f"{R}.multi_turn.tools=[calculator]"]),
    "multi-turn user tool without a file": ([*MT, f"{R}.multi_turn.tools=[lookup]"],
                                            f"{R}.multi_turn.tools", "set actor_rollout_ref.rollout.multi_turn."
                                            "tools_file", [*MT,
                                                           f"{R}.multi_turn.tools=[python]"]),
    "multi-turn missing tools file": ([*MT, f"{R}.multi_turn.tools=[calculator]",
                                       f"{R}.multi_turn.tools_file=/no/such/tools.py"], f"{R}.multi_turn.tools_file",
                                      "is not a file", [*MT,
                                                        f"{R}.multi_turn.tools=[calculator]"]),
    "multi-turn parser": ([*MT, f"{R}.multi_turn.tools=[calculator]",
                           f"{R}.multi_turn.tool_parser=hermess"], f"{R}.multi_turn.tool_parser",
                          "registered tool-call parser", [*MT,
                                                          f"{R}.multi_turn.tools=[calculator]"]),
    "multi-turn max turns": ([*MT, f"{R}.multi_turn.tools=[calculator]",
                              f"{R}.multi_turn.max_turns=0"], f"{R}.multi_turn.max_turns", ">= 1",
                             [*MT, f"{R}.multi_turn.tools=[calculator]",
                              f"{R}.multi_turn.max_turns=1"]),
    "multi-turn sandbox limit": ([*MT, f"{R}.multi_turn.tools=[python]",
                                  f"{R}.multi_turn.sandbox.memory_mb=0"], f"{R}.multi_turn.sandbox.memory_mb",
                                 "positive", [*MT, f"{R}.multi_turn.tools=[python]"]),
    "turn reward penalty below 0": ([*MT, f"{R}.multi_turn.tools=[python]",
                                     f"{R}.multi_turn.turn_reward.tool_error_penalty=-0.1"],
                                    f"{R}.multi_turn.turn_reward.tool_error_penalty", ">= 0",
                                    [*MT, f"{R}.multi_turn.tools=[python]",
                                     f"{R}.multi_turn.turn_reward.tool_error_penalty=0.1"]),
    "turn reward file missing": ([*MT, f"{R}.multi_turn.tools=[python]",
                                  f"{R}.multi_turn.turn_reward.path=/no/such/turns.py"],
                                 f"{R}.multi_turn.turn_reward.path", "is not a file",
                                 [*MT, f"{R}.multi_turn.tools=[python]"]),
    "turn reward without multi-turn": ([f"{R}.multi_turn.turn_reward.tool_error_penalty=0.1"],
                                       f"{R}.multi_turn.turn_reward.tool_error_penalty",
                                       "no effect while actor_rollout_ref.rollout.multi_turn.enable=false",
                                       [*MT, f"{R}.multi_turn.tools=[python]",
                                        f"{R}.multi_turn.turn_reward.tool_error_penalty=0.1"]),
    "critic tokenizer": (["critic.model.tokenizer_path=/tok"], "critic.model.tokenizer_path",
                         "uses the policy's tokenizer", ["critic.model.tokenizer_path=null"]),
    "reward model tokenizer": (["reward_model.model.tokenizer_path=/tok"], "reward_model.model.tokenizer_path",
                               "reads the policy's token ids", []),
    "critic remote code": (["critic.model.trust_remote_code=true"], "critic.model.trust_remote_code",
                           "runs no code from the model folder", []),
    "reward model remote code": (["reward_model.model.trust_remote_code=true"], "reward_model.model.trust_remote_code",
                                 "runs no code from the model folder", []),
    "reward model recompute": (["reward_model.model.enable_gradient_checkpointing=true"],
                               "reward_model.model.enable_gradient_checkpointing", "frozen",
                               ["critic.model.enable_gradient_checkpointing=true"]),
    "cpu kv cache on cuda": ([f"{R}.cpu_kv_cache_gib=2"], f"{R}.cpu_kv_cache_gib", "trainer.device=cpu only",
                             ["trainer.device=cpu", f"{R}.cpu_kv_cache_gib=2"]),
    "cpu step budget under a sequence": (
        ["trainer.device=cpu", "data.max_prompt_length=512", "data.max_response_length=512",
         f"{R}.max_num_batched_tokens=1000"], f"{R}.max_num_batched_tokens", "at least data.max_prompt_length + "
        "data.max_response_length = 1024",
        ["trainer.device=cpu", "data.max_prompt_length=512", "data.max_response_length=512",
         f"{R}.max_num_batched_tokens=1024"]),
    "eager off on cpu": (["trainer.device=cpu", f"{R}.enforce_eager=false"], f"{R}.enforce_eager",
                         "no effect on trainer.device=cpu", [f"{R}.enforce_eager=false"]),
    "greedy validation temperature": ([f"{R}.val_kwargs.temperature=0.7"], f"{R}.val_kwargs.temperature",
                                      "do_sample=false", [f"{R}.val_kwargs.temperature=0.7",
                                                          f"{R}.val_kwargs.do_sample=true"]),
    "greedy validation n": ([f"{R}.val_kwargs.n=4"], f"{R}.val_kwargs.n", "one sample per prompt",
                            [f"{R}.val_kwargs.n=4", f"{R}.val_kwargs.do_sample=true", f"{R}.val_kwargs.temperature=1"]),
    "greedy validation top_p": ([f"{R}.val_kwargs.top_p=0.9"], f"{R}.val_kwargs.top_p", "leave it at 1",
                                [f"{R}.val_kwargs.top_p=1.0"]),
    "greedy validation top_k": ([f"{R}.val_kwargs.top_k=20"], f"{R}.val_kwargs.top_k", "leave it at -1",
                                [f"{R}.val_kwargs.top_k=-1"]),
    "sampled validation at temperature 0": ([f"{R}.val_kwargs.do_sample=true"], f"{R}.val_kwargs.temperature",
                                            "must be > 0", [f"{R}.val_kwargs.do_sample=false"]),
    "tis cap without tis": ([f"{RC}.is_cap=3"], f"{RC}.is_cap", "has no effect while algorithm.rollout_correction."
                            "is_level=none", [f"{RC}.is_cap=3", f"{RC}.is_level=sequence"]),
    "mis band without mis": ([f"{RC}.mask_high=3"], f"{RC}.mask_high", "has no effect while algorithm."
                             "rollout_correction.mask_level=none", [f"{RC}.mask_high=3", f"{RC}.mask_level=token"]),
    "correction of a top-p rollout": ([f"{RC}.is_level=token", f"{R}.top_p=0.9"], f"{RC}.is_level",
                                      "kept mass", [f"{RC}.is_level=token", f"{R}.top_p=1.0"]),
    "correction of a top-k rollout": ([f"{RC}.mask_level=token", f"{R}.top_k=4"], f"{RC}.mask_level",
                                      "top_k=4", [f"{RC}.mask_level=token", f"{R}.top_k=-1"]),
    "correction of a truncated rollout, matched": ([f"{RC}.is_level=sequence", f"{R}.top_p=0.9", f"{R}.top_k=20"],
                                                   f"{RC}.is_level", f"set {RC}.match_truncation=true",
                                                   [f"{RC}.is_level=sequence", f"{R}.top_p=0.9", f"{R}.top_k=20",
                                                    f"{RC}.match_truncation=true"]),
    "shared prompts where the attention has no tree mask": (
        ["actor_rollout_ref.model.shared_prefix=true"], "actor_rollout_ref.model.shared_prefix",
        "is served by the CPU layer's attention stand-in only", ["actor_rollout_ref.model.shared_prefix=false"]),
    "shared prompts without packing": (
        ["trainer.device=cpu", "critic.model.use_remove_padding=false", "critic.model.shared_prefix=true"],
        "critic.model.shared_prefix", "needs packed micro-batches",
        ["trainer.device=cpu", "critic.model.use_remove_padding=false"]),
    "shared prompts with context parallelism": (
        ["trainer.device=cpu", f"{A}.megatron.context_parallel_size=2", "actor_rollout_ref.model.shared_prefix=true"],
        "actor_rollout_ref.model.shared_prefix", "with context_parallel_size=2 is not served",
        ["trainer.device=cpu", f"{A}.megatron.context_parallel_size=2"]),
    "truncation matched without a correction": ([f"{RC}.match_truncation=true", f"{R}.top_k=4"],
                                                f"{RC}.match_truncation", "has no effect while algorithm."
                                                "rollout_correction.is_level and mask_level are none",
                                                [f"{RC}.match_truncation=true", f"{R}.top_k=4",
                                                 f"{RC}.mask_level=token"]),
    "truncation matched without a truncation": ([f"{RC}.is_level=token", f"{RC}.match_truncation=true"],
                                                f"{RC}.match_truncation", "samples without truncation "
                                                f"({R}.top_p=1.0, top_k=-1)",
                                                [f"{RC}.is_level=token", f"{RC}.match_truncation=false"]),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unhonoured_setting_refused_and_fix_accepted(name):
    bad, field, fragment, good = REFUSED[name]
    issues = issues_for(bad)
    assert [i.field for i in issues] == [field], [str(i) for i in issues]  # one mistake, one message
    assert fragment in str(issues[0]), str(issues[0])
    plan_from_sources(SEED, good)


def test_rollout_correction_plan_line_and_no_warning():
    from hybridrl.config.report import render_plan

    plan = plan_from_sources(SEED, [f"{RC}.is_level=token"])
    assert "+ rollout correction (token TIS, cap 2)" in render_plan(plan)
    assert not any(RC in w for w in plan.warnings)
    assert "rollout correction" not in render_plan(plan_from_sources(SEED, []))
    matched = plan_from_sources(SEED, [f"{RC}.is_level=token", f"{R}.top_k=20", f"{RC}.match_truncation=true"])
    assert "+ rollout correction (token TIS, cap 2; target under top-k 20, top-p 1)" in render_plan(matched)


def test_cp2_on_cpu_plans_with_activations_divided_by_cp():
    """CP2 on CPU is planned: DP = world ÷ (TP·PP·CP), the ref shares the actor's CP, and the estimate's
    per-layer activations halve while the logits (computed whole on every CP rank) do not."""
    from hybridrl.config.estimates import training_memory

    cpu = ["trainer.device=cpu"]
    one, two = plan_from_sources(SEED, cpu), plan_from_sources(SEED, [*cpu, f"{A}.megatron.context_parallel_size=2"])
    assert (two.layout("actor").mesh.cp, two.layout("actor").mesh.dp) == (2, 3)
    assert (two.layout("ref").mesh.cp, two.layout("ref").mesh.dp) == (2, 3)
    assert one.layout("actor").mesh.dp == 6
    shape = two.model
    kwargs = dict(dtype="fp32", distributed_optimizer=False, trainable=True, micro_batch=4, seq_len=1024,
                  sequence_parallel=False, gpu_gib=80.0)
    act = {cp: training_memory("actor", shape, lay.mesh, **kwargs).activations_gib_per_micro_batch
           for cp, lay in ((1, one.layout("actor")), (2, two.layout("actor")))}
    layers = shape.num_layers
    per_layer_cp1 = 34 * 4 * 1024 * shape.hidden_size * 4 / 2 * (10 + 24) / 34  # tp 1, no SP
    logits = 4 * 1024 * shape.vocab_size * 4 * 2
    gib = 1024 ** 3
    assert act[1] == pytest.approx((layers * per_layer_cp1 + logits) / gib, abs=2e-3)
    assert act[2] == pytest.approx((layers * per_layer_cp1 / 2 + logits) / gib, abs=2e-3)


def test_cp2_with_packing_plans_on_cpu():
    """CP > 1 with packed micro-batches (each row's segment cut into 2 × CP chunks) is no longer
    refused: explicitly on for the actor and the critic, and by the CPU default."""
    gae = ["algorithm.adv_estimator=gae", "critic.megatron.context_parallel_size=2"]
    for packing in ([], ["actor_rollout_ref.model.use_remove_padding=true", "critic.model.use_remove_padding=true"]):
        plan = plan_from_sources(SEED, [*CPU_CP2, *gae, *packing])
        for role in ("actor", "ref", "critic"):
            assert plan.layout(role).mesh.cp == 2 and plan.resolved.packed(role), (role, packing)


def test_refused_setting_stops_train_before_any_process():
    """`hybridrl train` plans first: context parallelism on cuda is refused with exit 2 before Ray,
    torch or megatron is even imported (validation is pure)."""
    code = (f"import sys; from hybridrl.cli import main; "
            f"rc = main(['train', {str(SEED)!r}, '{A}.megatron.context_parallel_size=2']); "
            "heavy = [m for m in ('torch', 'ray', 'megatron', 'vllm') if m in sys.modules]; print(rc, heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.stdout.strip().splitlines()[-1] == "2 []", out.stdout[-500:] + out.stderr[-2000:]
    assert f"{A}.megatron.context_parallel_size=2 is implemented on trainer.device=cpu only so far" in out.stderr


def _closed_vocabulary_fields() -> list[tuple[str, tuple[str, ...]]]:
    import typing

    from hybridrl.config.schema import JobConfig, choice_fields

    # every Literal-typed field (an unset dtype shown as its first value), list items as path[0]
    config = JobConfig()
    for section in (config.actor_rollout_ref.actor.megatron, config.critic.megatron, config.reward_model.megatron):
        section.dtype = "fp32"
    config.actor_rollout_ref.rollout.dtype = "fp32"
    return [(path, typing.get_args(literal)) for path, literal, _ in choice_fields(config)]


CLOSED = _closed_vocabulary_fields()


def test_every_closed_vocabulary_field_is_covered():
    """The schema's Literal fields, found by walking it: a new one is checked without a new rule."""
    paths = {path for path, _ in CLOSED}
    assert {"trainer.device", "trainer.logger[0]", "algorithm.adv_estimator", "data.truncation",
            "actor_rollout_ref.actor.megatron.dtype", "actor_rollout_ref.rollout.dtype", "critic.optim.optimizer",
            "algorithm.kl_ctrl.type", "actor_rollout_ref.actor.old_log_prob"} <= paths, sorted(paths)


@pytest.mark.parametrize("path,valid", CLOSED, ids=[p for p, _ in CLOSED])
def test_a_value_outside_a_closed_vocabulary_is_refused_naming_the_valid_ones(path, valid):
    bogus = valid[0] + "x"  # close to a valid value: a did-you-mean is offered
    override = f"trainer.logger=[{bogus}]" if path == "trainer.logger[0]" else f"{path}={bogus}"
    issues = [i for i in issues_for([override]) if i.field == path]
    assert len(issues) == 1, issues_for([override])
    assert issues[0].value == bogus and tuple(issues[0].valid) == valid
    assert f"did you mean '{valid[0]}'" in str(issues[0]), str(issues[0])


def test_the_device_vocabulary_is_the_device_policies():
    import typing

    from hybridrl.config.schema import Device
    from hybridrl.parallel.device_policy import DEVICE_POLICIES

    assert typing.get_args(Device) == tuple(DEVICE_POLICIES)


# ---- mixture-of-experts layouts ----------------------------------------------------------------------

EP = f"{A}.megatron.expert_model_parallel_size"
ETP = f"{A}.megatron.expert_tensor_parallel_size"
CAP = f"{A}.megatron.moe_expert_capacity_factor"
EAGER = "actor_rollout_ref.rollout.enforce_eager=true"
DISPATCH = f"{A}.megatron.moe_token_dispatcher_type"

# (model arguments, bad overrides, field, text in the rule, overrides that fix it); on 6 GPUs, DP = 6 / TP
MOE_CASES = {
    "ep divides the experts": ({}, [f"{EP}=3"], EP, "must divide the model's 8 experts", [f"{EP}=2"]),
    "ep within dp x cp x tp": (dict(experts=12), [f"{A}.megatron.pipeline_model_parallel_size=2", f"{EP}=2"], EP,
                               "must divide DP × CP × TP = 3×1×1", [f"{A}.megatron.pipeline_model_parallel_size=2",
                                                                   f"{EP}=3"]),
    # TP2 x ETP1 (verl's MoE layout) plans; its expert mesh must still tile the stage: EP 4 x ETP 1 over DP x TP = 3 x 2
    "etp other than tp tiles the stage": ({}, [f"{A}.megatron.tensor_model_parallel_size=2", f"{ETP}=1", f"{EP}=4",
                                               f"{A}.megatron.sequence_parallel=true", "trainer.device=cuda"], EP,
                                          "× expert_tensor_parallel_size=1 must divide DP × CP × TP = 3×1×2",
                                          [f"{A}.megatron.tensor_model_parallel_size=2", f"{ETP}=1", f"{EP}=2",
                                           f"{A}.megatron.sequence_parallel=true", "trainer.device=cuda"]),
    "etp divides the experts' width": (dict(moe_ffn=100), [f"{ETP}=3"], ETP, "must divide the experts' intermediate "
                                       "size 100", [f"{ETP}=2"]),
    "ep x etp within dp x cp x tp": (dict(experts=12), [f"{EP}=2", f"{ETP}=4"], EP,
                                     "× expert_tensor_parallel_size=4 must divide DP × CP × TP = 6×1×1",
                                     [f"{EP}=3", f"{ETP}=2"]),
    "etp with routing replay": ({}, [f"{ETP}=2", f"{A}.router_replay=rollout", EAGER], ETP,
                                "with actor_rollout_ref.actor.router_replay=rollout has not been tested",
                                [f"{A}.router_replay=rollout", EAGER]),
    "etp with a disaggregated rollout": ({}, [f"{ETP}=2", f"{R}.mode=disaggregated", f"{R}.nnodes=1",
                                              f"{R}.n_gpus_per_node=2"], ETP, "the cross-pool weight sync",
                                         [f"{R}.mode=disaggregated", f"{R}.nnodes=1", f"{R}.n_gpus_per_node=2"]),
    "tp divides the experts' width": (dict(moe_ffn=100), [f"{A}.megatron.tensor_model_parallel_size=3",
                                                          f"{A}.megatron.sequence_parallel=true"],
                                      f"{A}.megatron.tensor_model_parallel_size",
                                      "must divide the experts' intermediate size 100",
                                      [f"{A}.megatron.tensor_model_parallel_size=1"]),
    "infer tp divides the experts' width": (dict(moe_ffn=99), [f"{R}.tensor_model_parallel_size=2"],
                                            f"{R}.tensor_model_parallel_size",
                                            "must divide the experts' intermediate size 99",
                                            [f"{R}.tensor_model_parallel_size=1"]),
    "moe training at tp > 1 needs sp": ({}, [f"{A}.megatron.tensor_model_parallel_size=2", "trainer.device=cuda"],
                                        f"{A}.megatron.sequence_parallel", "megatron's MoE layer refuses TP",
                                        [f"{A}.megatron.tensor_model_parallel_size=2", "trainer.device=cuda",
                                         f"{A}.megatron.sequence_parallel=true"]),
    "capacity factor is positive": ({}, [f"{CAP}=-1"], CAP, "must be in (0, 1000]", [f"{CAP}=1.25"]),
    "padding to capacity needs one": ({}, [f"{A}.megatron.moe_pad_expert_input_to_capacity=true"],
                                      f"{A}.megatron.moe_pad_expert_input_to_capacity",
                                      "needs actor_rollout_ref.actor.megatron.moe_expert_capacity_factor",
                                      [f"{A}.megatron.moe_pad_expert_input_to_capacity=true", f"{CAP}=1.0"]),
    "a drop policy needs a capacity": ({}, [f"{A}.megatron.moe_token_drop_policy=position"],
                                       f"{A}.megatron.moe_token_drop_policy", "no token is dropped",
                                       [f"{A}.megatron.moe_token_drop_policy=position", f"{CAP}=1.0"]),
    "a drop policy is a known one": ({}, [f"{A}.megatron.moe_token_drop_policy=random"],
                                     f"{A}.megatron.moe_token_drop_policy", "is not a known MoE token drop policy",
                                     [f"{A}.megatron.moe_token_drop_policy=probs"]),
    "allgather needs pp 1": ({}, [f"{DISPATCH}=allgather", f"{A}.megatron.pipeline_model_parallel_size=2"], DISPATCH,
                             "refuses variable_seq_lengths", [f"{DISPATCH}=alltoall",
                                                              f"{A}.megatron.pipeline_model_parallel_size=2"]),
    "allgather over dp ranks needs fixed micro-batches": (
        {}, [f"{DISPATCH}=allgather", f"{EP}=2", f"{A}.use_dynamic_bsz=true"], f"{A}.use_dynamic_bsz",
        "token-budget micro-batches differ in rows", [f"{DISPATCH}=allgather", f"{EP}=2"]),
    "padding to capacity over dp ranks needs padded micro-batches": (
        {}, [f"{CAP}=1.0", f"{A}.megatron.moe_pad_expert_input_to_capacity=true", f"{EP}=2",
             "actor_rollout_ref.model.use_remove_padding=true"], "actor_rollout_ref.model.use_remove_padding",
        "packed micro-batches differ in length", [f"{CAP}=1.0", f"{A}.megatron.moe_pad_expert_input_to_capacity=true",
                                                  f"{EP}=2"]),
    "shared prompts need a dense model": ({}, ["trainer.device=cpu", "actor_rollout_ref.model.shared_prefix=true"],
                                          "actor_rollout_ref.model.shared_prefix", "with a mixture-of-experts model",
                                          ["trainer.device=cpu"]),
    "capacity with routing replay": ({}, [f"{CAP}=1.0", f"{A}.router_replay=rollout", EAGER], CAP,
                                     "the replayed routing would still lose the tokens",
                                     [f"{A}.router_replay=rollout", EAGER]),
    # the routing is recorded by a hook on vLLM's runner, which CUDA graphs captured at build would bypass
    "routing replay on cuda runs vLLM eagerly": ({}, [f"{A}.router_replay=rollout"], f"{R}.enforce_eager",
                                                 "CUDA graphs captured at start-up would bypass",
                                                 [f"{A}.router_replay=rollout", EAGER]),
}


@pytest.mark.parametrize("name", sorted(MOE_CASES))
def test_moe_layout_rule_refuses_bad_and_accepts_fix(name, tmp_path):
    """Each expert-parallel rule names its field; with the fix the job plans."""
    shape, bad, field, fragment, good = MOE_CASES[name]
    model = moe_model_dir(tmp_path, **shape)
    issues = issues_for([model, *bad])
    named = [i for i in issues if i.field == field]
    assert named and any(fragment in str(i) for i in named), [str(i) for i in issues]
    plan = plan_from_sources(SEED, [model, *good])
    assert plan.model is not None and plan.model.num_experts == shape.get("experts", 8)


@pytest.mark.parametrize("dispatch", [[f"{DISPATCH}=allgather"],
                                      [f"{CAP}=1.0", f"{A}.megatron.moe_pad_expert_input_to_capacity=true"]])
def test_packing_left_unset_resolves_off_where_the_dispatcher_needs_equal_widths(dispatch, tmp_path):
    """On CPU packing defaults on; an expert group spanning DP ranks with equal-share dispatch turns
    the default off (the explicit true is refused above), and the plan says why. EP1 keeps it on."""
    model = moe_model_dir(tmp_path)
    spanning = plan_from_sources(SEED, [model, *dispatch, f"{EP}=2"])
    assert not spanning.resolved.packed("actor") and not spanning.resolved.packed("ref")
    assert "the MoE dispatcher needs equal-width micro-batches" in render_plan(spanning)
    within = plan_from_sources(SEED, [model, *dispatch, f"{EP}=1"])
    assert within.resolved.packed("actor")
    assert plan_from_sources(SEED, [model, f"{EP}=2"]).resolved.packed("actor")  # alltoall: any width


def test_expert_parallelism_with_a_dense_model_is_refused():
    issues = issues_for([f"{EP}=2"])
    assert any(i.field == EP and "needs a mixture-of-experts model" in str(i) and i.valid == (1,)
               for i in issues), [str(i) for i in issues]
    plan_from_sources(SEED, [f"{EP}=1"])


def test_moe_dispatch_settings_with_a_dense_model_are_refused():
    settings = {DISPATCH: "allgather", CAP: 1.0, f"{A}.megatron.moe_pad_expert_input_to_capacity": True,
                f"{A}.megatron.moe_token_drop_policy": "position"}
    issues = issues_for([f"{k}={v}" for k, v in settings.items()])
    for field in settings:
        assert any(i.field == field and "acts on mixture-of-experts models only" in str(i) for i in issues), \
            (field, [str(i) for i in issues])


def test_a_capacity_factor_warns_of_the_rollout_gap(tmp_path):
    model = moe_model_dir(tmp_path)
    plan = plan_from_sources(SEED, [model, f"{CAP}=1.5"])
    assert any(w.startswith(f"{CAP}=1.5: megatron drops the tokens") for w in plan.warnings), plan.warnings
    assert not any(CAP in w for w in plan_from_sources(SEED, [model]).warnings)


def test_moe_top_k_above_the_experts_is_refused(tmp_path):
    issues = issues_for([moe_model_dir(tmp_path, experts=4, top_k=6)])
    assert any(i.field == "actor_rollout_ref.model.path" and "num_experts_per_tok=6 must be in 1..4" in str(i)
               for i in issues), [str(i) for i in issues]


def test_reference_expert_layout_must_equal_the_actors():
    issues = issues_for(["actor_rollout_ref.ref.megatron.expert_model_parallel_size=2"])
    assert any(i.field == "actor_rollout_ref.ref.megatron.expert_model_parallel_size" and "must equal" in str(i)
               for i in issues), [str(i) for i in issues]


def test_moe_router_loss_settings_are_checked(tmp_path):
    model = moe_model_dir(tmp_path)
    issues = issues_for([model, f"{A}.megatron.moe_aux_loss_coeff=-0.1"])
    assert any(i.field == f"{A}.megatron.moe_aux_loss_coeff" and "-0.1" in str(i) for i in issues), \
        [str(i) for i in issues]
    issues = issues_for([model, f"{A}.megatron.moe_aux_loss_coeff=0.01",
                         f"{A}.megatron.moe_router_load_balancing_type=none"])
    assert any(i.field == f"{A}.megatron.moe_aux_loss_coeff" and "has no effect" in str(i) for i in issues), \
        [str(i) for i in issues]
    plan = plan_from_sources(SEED, [model, f"{A}.megatron.moe_aux_loss_coeff=0.01"])
    assert plan.config.actor_rollout_ref.actor.megatron.moe_aux_loss_coeff == 0.01


@pytest.mark.parametrize("output_router_logits, job, expected, said", [
    (True, [], 0.02, "config.json's router_aux_loss_coef=0.02 with output_router_logits=true"),
    (False, [], 0.0, "config.json's output_router_logits=false leaves its router_aux_loss_coef=0.02 unused"),
    (True, [f"{A}.megatron.moe_aux_loss_coeff=0.005"], 0.005, "the job's moe_aux_loss_coeff"),
    (True, [f"{A}.megatron.moe_aux_loss_coeff=0"], 0.0, "the job's moe_aux_loss_coeff"),
    (True, [f"{A}.megatron.moe_router_load_balancing_type=none"], 0.0, "moe_router_load_balancing_type=none"),
])
def test_moe_aux_loss_is_config_jsons_unless_the_job_sets_it(tmp_path, output_router_logits, job, expected, said):
    """With no moe_aux_loss_coeff of its own, the actor trains with the load-balancing loss transformers would: its
    config.json's router_aux_loss_coef when output_router_logits is true, none when false; the plan says which
    one it uses and why, and the workers' TransformerConfig gets that number."""
    from hybridrl.config.megatron_verdict import role_transformer_settings

    model = moe_model_dir(tmp_path)
    config_file = Path(model.split("=", 1)[1]) / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "router_aux_loss_coef": 0.02,
                                       "output_router_logits": output_router_logits}))
    plan = plan_from_sources(SEED, [model, *job])
    (line,) = [line for line in render_plan(plan).splitlines() if "MoE load-balancing loss" in line]
    assert line.startswith(f"actor MoE load-balancing loss: {f'aux_loss × {expected:g}' if expected else 'off'} (")
    assert said in line and f"{A}.megatron.moe_aux_loss_coeff sets it" in line
    settings = role_transformer_settings(plan.layout("actor").megatron, plan.model, gradient_checkpointing=False,
                                         router_replay=False)
    assert settings["moe_aux_loss_coeff"] == expected


def test_an_moe_actor_without_a_dense_critic_is_refused_for_gae(tmp_path):
    issues = issues_for([moe_model_dir(tmp_path), "algorithm.adv_estimator=gae"])
    assert any(i.field == "critic.model.path" and "not supported as a critic yet" in str(i) for i in issues), \
        [str(i) for i in issues]


RR = f"{A}.router_replay"


def test_router_replay_is_refused_for_a_dense_model_naming_the_field():
    issues = [i for i in issues_for([f"{RR}=rollout"]) if i.field == RR]  # the seed's model is dense Qwen2
    assert len(issues) == 1 and "needs a mixture-of-experts model" in str(issues[0]), [str(i) for i in issues]
    assert issues[0].value == "rollout" and tuple(issues[0].valid) == ("none",)


def test_router_replay_rollout_plans_for_an_moe_model_and_refuses_what_it_cannot_replay(tmp_path):
    model = moe_model_dir(tmp_path)
    itp1 = "actor_rollout_ref.rollout.tensor_model_parallel_size=1"
    plan = plan_from_sources(SEED, [model, EAGER, f"{RR}=rollout", itp1])
    assert plan.config.actor_rollout_ref.actor.router_replay == "rollout"
    # inference TP 2 replays exactly (tests/training/test_router_replay.py::test_routing_vllm_reports_at_infer_tp2_...)
    itp2 = plan_from_sources(SEED, [model, EAGER, f"{RR}=rollout",
                                    "actor_rollout_ref.rollout.tensor_model_parallel_size=2"])
    assert itp2.config.actor_rollout_ref.rollout.tensor_model_parallel_size == 2
    # each setting the replay cannot follow exactly is one issue naming its own field and value
    refused = {
        "actor_rollout_ref.rollout.multi_turn.enable": ("true", True),
        f"{A}.megatron.context_parallel_size": ("2", 2),
        "actor_rollout_ref.model.enable_gradient_checkpointing": ("true", True),
    }
    for field, (text, value) in refused.items():
        issues = [i for i in issues_for([model, EAGER, itp1, f"{RR}=rollout", f"{field}={text}"]) if i.field == field
                  and f"{RR}=rollout" in str(i)]
        assert len(issues) == 1 and issues[0].value == value, (field, [str(i) for i in issues])
        try:  # without replay the setting is fine or refused for its own reasons, never the replay's
            without = plan_from_sources(SEED, [model, itp1, f"{field}={text}"]).config and []
        except ConfigError as error:
            without = [i for i in error.issues if f"{RR}=rollout" in str(i)]
        assert not without, field
    # the default plans, unchanged from a config that does not name the field
    (tmp_path / "b").mkdir()
    model = moe_model_dir(tmp_path / "b")
    named, unnamed = plan_from_sources(SEED, [model, f"{RR}=none"]), plan_from_sources(SEED, [model])
    assert named.config.actor_rollout_ref.actor.router_replay == "none"
    assert named.config == unnamed.config


# ---- rollout placement and async modes (rollout.mode, async_mode) -----------------------------------
DIS = (f"{R}.mode=disaggregated", f"{R}.n_gpus_per_node=4")  # the seed's 6 trainer GPUs + 4 for vLLM

PLACEMENT_CASES = {
    "disaggregated needs its pool size": (
        [f"{R}.mode=disaggregated"], f"{R}.n_gpus_per_node", "is required with", [*DIS]),
    "pool size only when disaggregated": (
        [f"{R}.n_gpus_per_node=4"], f"{R}.n_gpus_per_node", "sizes a disaggregated rollout pool", []),
    "pool machines only when disaggregated": (
        [f"{R}.nnodes=2"], f"{R}.nnodes", "sizes a disaggregated rollout pool", []),
    "rollout tp divides the pool, not the trainer": (
        [*DIS[:1], f"{R}.n_gpus_per_node=3"], f"{R}.tensor_model_parallel_size",
        "must divide the rollout pool's 3 GPUs", [*DIS]),
    "batch splits over the pool's replicas": (
        [*DIS[:1], f"{R}.n_gpus_per_node=16"], "data.train_batch_size", "8 rollout replicas",
        [*DIS[:1], f"{R}.n_gpus_per_node=12"]),
    "async needs a pool of its own": (
        [f"{R}.async_mode=one_step_off"], f"{R}.async_mode", "needs actor_rollout_ref.rollout.mode=disaggregated",
        [*DIS, f"{R}.async_mode=one_step_off"]),
    "staleness only with fully_async": (
        [*DIS, f"{R}.async_mode=one_step_off", f"{R}.max_staleness=2"], f"{R}.max_staleness",
        "applies to actor_rollout_ref.rollout.async_mode=fully_async only", [*DIS, f"{R}.async_mode=fully_async",
                                                                           f"{R}.max_staleness=2"]),
    "staleness of at least one version": (
        [*DIS, f"{R}.async_mode=fully_async", f"{R}.max_staleness=0"], f"{R}.max_staleness", "integer >= 1",
        [*DIS, f"{R}.async_mode=fully_async", f"{R}.max_staleness=1"]),
    "partial rollouts only with fully_async": (
        [*DIS, f"{R}.partial_rollout=false"], f"{R}.partial_rollout", "fully_async only",
        [*DIS, f"{R}.async_mode=fully_async", f"{R}.partial_rollout=false"]),
    "stale-sample policy is a known one": (
        [*DIS, f"{R}.async_mode=fully_async", f"{R}.stale_samples=skip"], f"{R}.stale_samples",
        "is not a known stale-sample policy", [*DIS, f"{R}.async_mode=fully_async", f"{R}.stale_samples=keep"]),
    "a disaggregated rollout never sleeps": (
        [*DIS, f"{R}.free_cache_engine=true"], f"{R}.free_cache_engine", "applies to actor_rollout_ref.rollout."
        "mode=colocated only", [*DIS]),
    "remax's greedy baseline is not built ahead": (
        [*DIS, f"{R}.async_mode=one_step_off", "algorithm.adv_estimator=remax"], "algorithm.adv_estimator",
        "greedy baseline", [*DIS, f"{R}.async_mode=one_step_off"]),
    "dynamic sampling is not built ahead": (
        [*DIS, f"{R}.async_mode=fully_async", "algorithm.filter_groups.enable=true"],
        "algorithm.filter_groups.enable", "not built for a rollout that runs ahead",
        [*DIS, f"{R}.async_mode=sync", "algorithm.filter_groups.enable=true"]),
    "multi-turn is not paused mid-turn": (
        [*DIS, f"{R}.async_mode=fully_async", *MT, f"{R}.multi_turn.tools=[calculator]"],
        f"{R}.multi_turn.enable", "resume mid-turn",
        [*DIS, f"{R}.async_mode=one_step_off", *MT, f"{R}.multi_turn.tools=[calculator]"]),
}


@pytest.mark.parametrize("name", sorted(PLACEMENT_CASES))
def test_rollout_placement_rules(name):
    assert_refused_then_fixed(*PLACEMENT_CASES[name])


def test_a_disaggregated_plan_has_two_pools_and_the_cross_pool_traffic():
    from hybridrl.config.report import render_plan

    plan = plan_from_sources(SEED, [*DIS, f"{R}.async_mode=fully_async", f"{R}.max_staleness=2"])
    res = plan.resolved
    assert (res.world_size, res.rollout_world, res.disaggregated) == (6, 4, True)
    assert (res.async_mode, res.max_staleness, res.stale_samples, res.partial_rollout) == ("fully_async", 2, "drop",
                                                                                            True)
    assert res.free_cache_engine is False  # nothing to sleep for on a pool of its own
    # vLLM's replicas are the pool's ranks, consecutive (its own TP groups), numbered within the pool
    assert plan.reshard.groups.rollout.replicas == ((0, 1), (2, 3))
    assert plan.prompts_per_rollout_replica == 30 and plan.gpu_memory is not None
    # a replica holds up to max_staleness + 1 batches in flight: its KV cache estimate counts them all
    assert plan.rollout_memory.tokens_per_replica_step == 3 * 30 * 12 * (512 + 1024)
    # every rollout rank receives its whole TP-2 shard; the 6 trainer ranks share the sending
    cross = plan.reshard.cross_pool
    model = plan.model
    shard = (model.param_count() - model.num_layers * 2 * model.hidden_size - model.hidden_size) / 2 \
        + model.num_layers * 2 * model.hidden_size + model.hidden_size
    assert cross.bytes_received == (round(shard * 2),) * 4  # bf16
    assert cross.bytes_sent_even == -(-4 * round(shard * 2) // 6)
    assert plan.reshard.traffic is None
    text = render_plan(plan)
    assert "Rollout pool (vLLM, disaggregated): 1 node(s) × 4 = 4 ranks" in text
    assert "fully_async" in text and "2 version(s)" in text and "Weight sync across the pools" in text
    # the JSON plan round-trips with the new fields
    from hybridrl.config.plan import Plan

    assert Plan.from_json(plan.to_json()) == plan


def test_colocated_plans_are_unchanged_by_the_new_fields():
    plan = plan_from_sources(SEED)
    res = plan.resolved
    assert (res.disaggregated, res.rollout_world, res.async_mode, res.free_cache_engine) == (False, 6, "sync", True)
    assert plan.reshard.cross_pool is None and plan.reshard.traffic is not None


def test_a_critic_of_its_own_is_laid_out_by_its_own_shape(tmp_path):
    """The critic's TP must divide the critic's heads, not the actor's: a 9-head critic at TP 2 is refused, where
    the actor's 16-head shape (the critic's when it names no folder of its own) is laid out there."""
    common = [model_dir(tmp_path, heads=16, kv=8), "algorithm.adv_estimator=gae",
              "critic.megatron.tensor_model_parallel_size=2"]
    plan_from_sources(SEED, common)
    critic = model_dir(tmp_path, heads=9, kv=3).split("=", 1)[1]
    issues = issues_for([*common, f"critic.model.path={critic}"])
    assert [i.field for i in issues] == ["critic.megatron.tensor_model_parallel_size"], [str(i) for i in issues]
    assert "9" in str(issues[0]), str(issues[0])
