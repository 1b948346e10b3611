"""The Plan's derived numbers, checked against hand arithmetic (the seeds' example and others)."""
import dataclasses
import json
from pathlib import Path

import pytest

from hybridrl.config import ConfigError, Plan, build_plan, load_config, plan_from_sources
from hybridrl.config.meshes import build_reshard_groups, build_training_mesh
from hybridrl.config.report import render_plan

ROOT = Path(__file__).resolve().parents[2]
SEED = ROOT / "configs/examples/seed_6gpu_grpo.yaml"


@pytest.fixture(scope="module")
def seed_plan() -> Plan:
    return plan_from_sources(SEED)


def test_seed_example_numbers_exactly(seed_plan):
    plan = seed_plan
    assert plan.rollout_mesh == ((0, 1), (2, 3), (4, 5))
    assert plan.prompts_per_rollout_replica == 20
    assert plan.sequences_per_rollout_replica == 240
    assert plan.sequences_per_step == 720
    actor = plan.update("actor")
    assert actor.sequences_per_rank_per_mini_batch == 120
    assert (actor.grad_accum_steps, actor.micro_batch_size) == (15, 8)
    assert actor.mini_batches_per_step == 1 and actor.optimizer_steps_per_step == 1
    for pass_name in ("old_log_prob", "ref_log_prob"):
        fwd = plan.forward(pass_name)
        assert (fwd.sequences_per_rank, fwd.micro_batches_per_rank, fwd.micro_batch_size) == (120, 15, 8)
    mesh = plan.layout("actor").mesh
    assert (mesh.tp, mesh.pp, mesh.cp, mesh.dp) == (1, 1, 1, 6)  # DP = world / (TP*PP*CP), not #GPUs/TP


def test_data_parallel_size_is_world_over_tp_pp():
    # CP is refused until the workers implement it (test_config_validation); the mesh math with CP
    # is checked against megatron-core's RankGenerator below.
    cfg = load_config(SEED, [
        "trainer.n_gpus_per_node=8", "trainer.nnodes=2",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
        "actor_rollout_ref.model.path=",  # no model: only the mesh arithmetic is under test
        "data.train_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    ])
    plan = build_plan(cfg)
    mesh = plan.layout("actor").mesh
    assert mesh.dp == 16 // (2 * 2) == 4
    up = plan.update("actor")
    # 16 prompts x 12 samples / 4 DP ranks = 48 sequences per rank; / micro 4 = 12 accumulation steps
    assert (up.sequences_per_rank_per_mini_batch, up.grad_accum_steps) == (48, 12)
    assert up.mini_batches_per_step == 4 and up.optimizer_steps_per_step == 4
    assert plan.forward("old_log_prob").sequences_per_rank == 64 * 12 // 4


def test_megatron_rank_order_tp_fastest_then_cp_dp_pp():
    mesh = build_training_mesh(16, tp=2, pp=2, cp=2)
    assert mesh.dp == 2
    assert mesh.tp_groups[:2] == ((0, 1), (2, 3))
    assert (0, 2) in mesh.cp_groups and (0, 4) in mesh.dp_groups and (0, 8) in mesh.pp_groups
    for rank in range(16):
        c = mesh.coord(rank)
        assert mesh.rank_of(tp=c.tp, cp=c.cp, dp=c.dp, pp=c.pp) == rank
    # every axis partitions the world
    for groups in (mesh.tp_groups, mesh.pp_groups, mesh.dp_groups, mesh.cp_groups):
        assert sorted(r for g in groups for r in g) == list(range(16))
    assert mesh.output_ranks() == (8, 12)  # last stage, tp 0, cp 0, for dp 0 and 1


def test_megatron_groups_match_megatron_core_rank_generator():
    """Our mesh math must equal megatron-core's own RankGenerator for the default order."""
    from megatron.core.parallel_state import RankGenerator

    for world, tp, pp, cp in [(8, 2, 2, 1), (16, 2, 2, 2), (12, 3, 2, 1), (8, 1, 4, 2)]:
        mesh = build_training_mesh(world, tp, pp, cp)
        gen = RankGenerator(tp=tp, ep=1, dp=mesh.dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
        assert sorted(map(tuple, gen.get_ranks("tp"))) == list(mesh.tp_groups)
        assert sorted(map(tuple, gen.get_ranks("pp"))) == list(mesh.pp_groups)
        assert sorted(map(tuple, gen.get_ranks("dp"))) == list(mesh.dp_groups)
        assert sorted(map(tuple, gen.get_ranks("cp"))) == list(mesh.cp_groups)


def test_expert_groups_match_megatron_core_expert_rank_generator():
    """The EP and expert-DP groups `hybridrl plan` prints equal megatron-core's expert RankGenerator's
    (what `initialize_model_parallel` builds), and the plan shows them."""
    from megatron.core.parallel_state import RankGenerator

    from hybridrl.config.meshes import expert_groups

    for world, tp, pp, cp, ep, etp in [(8, 1, 1, 1, 2, 1), (16, 2, 2, 1, 4, 2), (16, 1, 2, 2, 4, 1),
                                       (32, 1, 2, 1, 8, 1), (12, 1, 3, 1, 2, 1), (4, 1, 1, 1, 1, 2),
                                       (8, 1, 1, 1, 2, 2), (16, 2, 2, 1, 2, 1), (16, 1, 2, 2, 2, 4)]:
        mesh = build_training_mesh(world, tp, pp, cp)
        gen = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
        ep_groups, edp_groups = expert_groups(mesh, ep, etp)
        assert list(ep_groups) == sorted(map(tuple, gen.get_ranks("ep"))), (world, tp, pp, cp, ep, etp)
        assert list(edp_groups) == sorted(map(tuple, gen.get_ranks("dp"))), (world, tp, pp, cp, ep, etp)
    with pytest.raises(ValueError, match="ep=3 does not divide dp"):
        expert_groups(build_training_mesh(8, 1, 1), 3)
    example = ROOT / "configs/examples/qwen3_30b_a3b_grpo_4x8.yaml"
    report = render_plan(plan_from_sources(example))
    assert "actor experts (megatron order etp-ep-edp-pp, expert TP = TP): EP 8 × expert-DP 2; EP groups " \
           "[[0,1,2,3,4,5,6,7], [8,9,10,11,12,13,14,15]" in report
    report = render_plan(plan_from_sources(example, ["actor_rollout_ref.actor.megatron.expert_model_parallel_size=4",
                                                     "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=2"]))
    assert "actor experts (megatron order etp-ep-edp-pp, expert TP 2): EP 4 × expert-DP 2; EP groups " \
           "[[0,2,4,6], [1,3,5,7]" in report


def test_reshard_groups_strided_contain_training_shard():
    # Training TP=4 on 8 ranks, inference TP=2: each TP group hosts 2 replicas at stride 2.
    mesh = build_training_mesh(8, tp=4, pp=1)
    groups = build_reshard_groups(mesh, 2)
    assert groups.strategy == "strided"
    assert groups.rollout.replicas == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert groups.micro_dp_groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    for rank in range(8):
        tp_rank = mesh.coord(rank).tp
        j = groups.gen_tp_index[rank]
        # training shard [tp/4, (tp+1)/4) lies inside generation shard [j/2, (j+1)/2)
        assert j / 2 <= tp_rank / 4 and (tp_rank + 1) / 4 <= (j + 1) / 2


def test_reshard_groups_with_pipeline_stages():
    mesh = build_training_mesh(4, tp=2, pp=2)  # ranks 0,1 stage 0; 2,3 stage 1
    groups = build_reshard_groups(mesh, 1)
    assert groups.rollout.replicas == ((0,), (1,), (2,), (3,))
    assert groups.micro_dp_groups == ((0, 1, 2, 3),)  # each needs all layers, all of TP
    assert groups.micro_dp_size == 4


def test_reshard_traffic_matches_hybridflow_formula(seed_plan):
    """Received bytes per rank = |generation shard| - |generation shard ∩ own training shard|."""
    from hybridrl.config.estimates import reshard_traffic

    # Table 2 counts every weight once: untie, so the last stage holds no copy of the embedding.
    shape = dataclasses.replace(seed_plan.model, tie_word_embeddings=False)
    for world, tp, pp, itp in [(8, 4, 1, 2), (8, 2, 2, 2), (4, 2, 1, 1), (8, 2, 4, 2)]:
        mesh = build_training_mesh(world, tp, pp)
        groups = build_reshard_groups(mesh, itp)
        if shape.num_layers % pp:
            continue
        traffic = reshard_traffic(shape, mesh, groups, "bf16")
        assert traffic.bytes_received == traffic.lower_bound
        # HybridFlow Table 2, per rank on average: (1/t_g - 1/(t*p)) * M (stages differ in size:
        # the embedding lives on the first one, so only the mean over ranks equals it; norms,
        # replicated on every TP rank, make the small difference)
        model = traffic.model_bytes
        expected = model / itp - model / (tp * pp)
        mean = sum(traffic.bytes_received) / world
        assert abs(mean - expected) / model < 0.01
        assert all(n >= r for n, r in zip(traffic.naive_gather_all, traffic.bytes_received))


def test_reshard_groups_split_when_inference_tp_is_larger():
    # Training PP=4, inference TP=4: each rank's generation shard j of its own stage, the rest from its
    # pipeline peers. Training TP=2 x PP=2, inference TP=4: generation rank j would best sit on training tp
    # rank j // 2, but vLLM numbers the replica's ranks in ascending order (tp fastest): the plan takes
    # that order (vLLM's real TP ranks are checked against it in tests/workers/test_colocated.py).
    groups = build_reshard_groups(build_training_mesh(4, tp=1, pp=4), 4)
    assert groups.strategy == "split"
    assert groups.rollout.replicas == ((0, 1, 2, 3),) and groups.gen_tp_index == (0, 1, 2, 3)
    mesh = build_training_mesh(4, tp=2, pp=2)  # rank = tp + 2 * pp
    groups = build_reshard_groups(mesh, 4)
    assert groups.strategy == "split"
    assert groups.rollout.replicas == ((0, 1, 2, 3),)
    assert groups.gen_tp_index == (0, 1, 2, 3)
    assert groups.micro_dp_groups == ((0, 2), (1, 3))  # pipeline peers
    for world, tp, pp, infer_tp in ((8, 2, 2, 4), (8, 4, 2, 8), (16, 2, 2, 4), (8, 1, 2, 4), (8, 4, 1, 2)):
        groups = build_reshard_groups(build_training_mesh(world, tp=tp, pp=pp), infer_tp)
        assert all(list(r) == sorted(r) for r in groups.rollout.replicas)
        assert all(groups.gen_tp_index[rank] == j for r in groups.rollout.replicas for j, rank in enumerate(r))


def test_reshard_traffic_counts_tied_copy_and_virtual_stages(seed_plan):
    from hybridrl.config.estimates import reshard_traffic

    tied = dataclasses.replace(seed_plan.model, tie_word_embeddings=True, num_layers=8)
    untied = dataclasses.replace(tied, tie_word_embeddings=False)
    mesh = build_training_mesh(2, tp=1, pp=2)
    groups = build_reshard_groups(mesh, 1)
    with_copy = reshard_traffic(tied, mesh, groups, "bf16")
    embedding = tied.vocab_size * tied.hidden_size * 2
    # the last stage keeps megatron's copy of the tied embedding: it does not receive it
    untied_received = reshard_traffic(untied, mesh, groups, "bf16").bytes_received
    assert with_copy.bytes_received[1] == untied_received[1] - embedding  # untied: it needs the embedding
    # VPP=2 interleaves layers (stage 0: 0-1, 4-5); the same count per stage, so the same bytes
    vpp_mesh = build_training_mesh(2, tp=1, pp=2, vpp=2)
    assert reshard_traffic(untied, vpp_mesh, groups, "bf16") == reshard_traffic(untied, mesh, groups, "bf16")


def test_plan_json_round_trips(seed_plan):
    text = seed_plan.to_json()
    again = Plan.from_json(text)
    assert again == seed_plan
    assert again.to_json() == text
    assert json.loads(text)["config"]["actor_rollout_ref"]["rollout"]["n"] == 12


def test_plan_does_not_mutate_user_config():
    cfg = load_config(SEED)
    before = repr(cfg)
    plan = build_plan(cfg)
    assert repr(cfg) == before
    assert plan.config is not cfg
    # resolved defaults live in the plan, not written back into the config
    assert cfg.actor_rollout_ref.actor.clip_ratio_low is None
    assert plan.resolved.clip_ratio_low == cfg.actor_rollout_ref.actor.clip_ratio


def test_memory_estimate_flags_what_cannot_fit():
    ok = plan_from_sources(ROOT / "configs/examples/qwen2.5_7b_grpo_8gpu.yaml")
    assert all(m.fits for m in ok.training_memory) and ok.gpu_memory.fits
    actor = next(m for m in ok.training_memory if m.role == "actor")
    # Params of the actor at TP=2: 7.6e9 / 2 * 2 bytes (bf16) ~ 7.1 GiB
    assert actor.params_gib == pytest.approx(ok.model.param_count() / 2 * 2 / 1024**3, rel=0.05)
    # distributed optimizer divides Adam states by DP=4
    assert actor.optimizer_gib == pytest.approx(actor.optimizer_gib_without_distributed / 4, rel=1e-2)
    with pytest.raises(ConfigError, match=r"trainer\.gpu_memory_gib=24 is too small for this job"):
        plan_from_sources(ROOT / "configs/examples/qwen2.5_7b_grpo_8gpu.yaml", ["trainer.gpu_memory_gib=24"])


def test_a_gpu_plan_that_does_not_fit_is_refused_with_ways_that_do():
    example = ROOT / "configs/examples/qwen2.5_7b_grpo_8gpu.yaml"
    resident = ["actor_rollout_ref.actor.megatron.grad_offload=false",
                "actor_rollout_ref.actor.megatron.optimizer_offload=false"]
    fitting = plan_from_sources(example)
    actor = next(m for m in fitting.training_memory if m.role == "actor")
    # generation with nothing offloaded: the actor's params, grads and Adam (master weights and moments) next
    # to vLLM's share, one process's CUDA context and its NCCL communicators (world, TP, DP, TP x PP for the
    # grad norm; vLLM's TP group), and the 5 % margin
    generation = actor.params_gib + actor.grads_gib + actor.optimizer_gib + 0.6 * 80 + 0.75 + 5 * 0.5
    assert generation + 4 > 80
    with pytest.raises(ConfigError) as refused:
        plan_from_sources(example, resident)
    message = str(refused.value)
    assert f"generation, holds {generation:.1f} GiB" in message and "trainer.gpu_memory_gib=80" in message
    # each named way is overrides written whole, joined by " and ": pasted, it plans and fits
    ways = ["actor_rollout_ref.actor.megatron.grad_offload=true and "
            "actor_rollout_ref.actor.megatron.optimizer_offload=true (",
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.5 ("]
    for named in ways:
        assert named in message, message
        overrides = named.removesuffix(" (").split(" and ")
        assert plan_from_sources(example, [*resident, *overrides]).gpu_memory.fits   # the named way does fit
    # optimizer_offload alone leaves the fp32 master weights and is not named: it does not fit
    named_ways = [way.rsplit(" (", 1)[0] for way in message.split("would fit with: ", 1)[1].split("; or ")]
    assert "actor_rollout_ref.actor.megatron.optimizer_offload=true" not in named_ways, named_ways
    with pytest.raises(ConfigError):
        plan_from_sources(example, [*resident, "actor_rollout_ref.actor.megatron.optimizer_offload=true"])


def test_every_shipped_example_plans(tmp_path):
    for path in sorted((ROOT / "configs/examples").glob("*.yaml")):
        plan = plan_from_sources(path)
        assert plan.sequences_per_step == plan.prompts_per_step * plan.config.actor_rollout_ref.rollout.n


def test_base_config_is_generated_from_the_schema():
    from hybridrl.config.docs import render_base_yaml

    assert (ROOT / "configs/base.yaml").read_text() == render_base_yaml()
    cfg = load_config(ROOT / "configs/base.yaml")
    assert cfg == load_config(None)


@pytest.mark.parametrize("overrides, runs_pass", [
    ([], False),  # one mini-batch, one epoch: the update's forward is the old policy
    (["actor_rollout_ref.actor.ppo_mini_batch_size=20"], True),  # 3 optimizer steps: the 2nd and 3rd are off-policy
    (["actor_rollout_ref.actor.ppo_epochs=2"], True),
    (["algorithm.use_kl_in_reward=true"], True),  # the reward needs old log-probs before the update
    (["actor_rollout_ref.actor.old_log_prob=recompute"], True),
])
def test_old_log_prob_pass_runs_only_when_the_update_is_off_policy(overrides, runs_pass):
    plan = build_plan(load_config(SEED, overrides))
    assert plan.resolved.old_log_prob_pass is runs_pass
    assert Plan.from_dict(json.loads(plan.to_json())).resolved.old_log_prob_pass is runs_pass


CPU_TINY = ROOT / "configs/examples/cpu_tiny_grpo.yaml"


def cpu_tiny_plan(overrides: list[str]) -> Plan:
    """The CPU demo's config on the tiny-demo model's shape (its config.json: no weights needed)."""
    return plan_from_sources(CPU_TINY, ["actor_rollout_ref.model.path=configs/models/tiny-demo", *overrides])


@pytest.mark.parametrize("overrides,sequences,bytes_per_token", [
    # tiny-demo: 4 layers x 2 KV heads x head_dim 32; 8 prompts x n=8 over 2 replicas = 32 per replica
    ([], 32, 2 * 4 * 2 * 32 * 4),
    (["actor_rollout_ref.rollout.dtype=bf16"], 32, 2 * 4 * 2 * 32 * 2),
    (["trainer.n_gpus_per_node=1"], 64, 2 * 4 * 2 * 32 * 4),
    (["actor_rollout_ref.rollout.max_num_seqs=10"], 10, 2 * 4 * 2 * 32 * 4),  # vLLM runs 10 at once
    # infer TP 2 splits the 2 KV heads; one replica of 2 ranks takes all 64 sequences
    (["actor_rollout_ref.rollout.tensor_model_parallel_size=2"], 64, 2 * 4 * 1 * 32 * 4),
])
def test_cpu_kv_cache_is_sized_for_one_wave(overrides, sequences, bytes_per_token):
    plan = cpu_tiny_plan(overrides)
    memory = plan.rollout_memory
    # 32 prompt + 16 response tokens = 2 blocks of 32, one spare block each, vLLM's null block
    assert memory.on_cpu and memory.kv_cache_bytes == (sequences * 3 + 1) * 32 * bytes_per_token
    assert memory.kv_bytes_per_token == bytes_per_token
    assert memory.one_wave == (sequences == plan.sequences_per_rollout_replica)


def test_cpu_kv_cache_set_by_hand_warns_or_refuses():
    plan = cpu_tiny_plan(["actor_rollout_ref.rollout.cpu_kv_cache_gib=0.001"])
    assert plan.rollout_memory.kv_cache_bytes == int(0.001 * 2**30)
    assert any("cpu_kv_cache_gib=0.001" in w and "waves" in w for w in plan.warnings)
    from hybridrl.config import ConfigError

    with pytest.raises(ConfigError, match=r"cpu_kv_cache_gib=1e-05 holds 5 tokens, less than one 48-token"):
        cpu_tiny_plan(["actor_rollout_ref.rollout.cpu_kv_cache_gib=0.00001"])


def test_gpu_kv_cache_comes_from_memory_utilization():
    plan = cpu_tiny_plan(["trainer.device=cuda"])
    memory = plan.rollout_memory
    assert not memory.on_cpu
    assert memory.kv_cache_gib == pytest.approx(8 * 0.5 - memory.weights_gib, abs=2e-3)


@pytest.mark.parametrize("overrides,expected", [
    ([], 1e-4),                                                      # fp32 training and rollout on cpu
    (["actor_rollout_ref.rollout.dtype=bf16"], 0.5),                 # a half-precision side: bf16 round-off
    (["actor_rollout_ref.actor.megatron.dtype=bf16"], 0.5),
    (["actor_rollout_ref.rollout.dtype=bf16", "actor_rollout_ref.rollout.probe_tolerance=0.25"], 0.25),
])
def test_probe_tolerance_follows_the_dtypes_unless_set(overrides, expected):
    plan = plan_from_sources("configs/examples/cpu_tiny_grpo.yaml", overrides)
    assert plan.resolved.probe_tolerance == expected
    assert Plan.from_json(plan.to_json()).resolved.probe_tolerance == expected


@pytest.mark.parametrize("value", ["0", "-1", "true"])
def test_probe_tolerance_must_be_positive(value):
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.rollout\.probe_tolerance="):
        plan_from_sources("configs/examples/cpu_tiny_grpo.yaml", [f"actor_rollout_ref.rollout.probe_tolerance={value}"])


@pytest.mark.parametrize("overrides,expected", [
    ([], 512 << 20),
    (["actor_rollout_ref.rollout.update_weights_bucket_megabytes=64"], 64 << 20),
])
def test_the_sync_bucket_is_in_the_plan(overrides, expected):
    plan = plan_from_sources("configs/examples/cpu_tiny_grpo.yaml", overrides)
    assert plan.resolved.sync_bucket_bytes == expected
    assert Plan.from_json(plan.to_json()).resolved.sync_bucket_bytes == expected


@pytest.mark.parametrize("value", ["0", "-3", "1.5", "true"])
def test_the_sync_bucket_must_be_a_positive_number_of_mib(value):
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.rollout\.update_weights_bucket_megabytes="):
        plan_from_sources("configs/examples/cpu_tiny_grpo.yaml",
                          [f"actor_rollout_ref.rollout.update_weights_bucket_megabytes={value}"])


MULTI_TURN = ["actor_rollout_ref.rollout.multi_turn.enable=true",
              "actor_rollout_ref.rollout.multi_turn.tools=[calculator]"]


def test_multi_turn_token_budget_counts_the_model_turns_and_the_observations_in_the_response():
    """A multi-turn job: the response budget holds every model turn and tool answer; the sequence
    (prompt + all turns) is what the KV cache and the estimates are sized for; the report says so."""
    plan = cpu_tiny_plan([*MULTI_TURN, "actor_rollout_ref.rollout.multi_turn.max_turns=3",
                          "actor_rollout_ref.rollout.multi_turn.max_observation_chars=100",
                          "data.max_response_length=48", "actor_rollout_ref.rollout.response_length=40"])
    budget = plan.token_budget
    # prompts of 32 tokens; the rollout's 40 of data.max_response_length 48 after them
    assert (budget.prompt_tokens, budget.response_tokens, budget.sequence_tokens) == (32, 40, 72)
    assert budget.multi_turn and (budget.max_turns, budget.max_tool_rounds) == (3, 2)
    assert (budget.max_model_tokens, budget.max_observation_tokens, budget.max_observation_chars) == (40, 39, 100)
    # one replica's rollout step is 32 sequences of the whole 72 tokens, prompt and every turn
    assert plan.rollout_memory.tokens_per_replica_step == 32 * 72
    assert Plan.from_dict(json.loads(plan.to_json())).token_budget == budget
    report = render_plan(plan)
    for line in ("response (model turns + tool observations)", "actor_rollout_ref.rollout.response_length",
                 "tool answers per sample, at most", "observation tokens per sample, at most",
                 "40 - 1 (a model turn writes >= 1 token)", "share the 40-token response budget"):
        assert line in report, line
    assert [row.split()[-1] for row in report.splitlines() if row.startswith(("sequence ", "one tool answer"))] == \
        ["72", "100"]

    single = cpu_tiny_plan([]).token_budget  # single-turn: the response is the answer alone
    assert (single.multi_turn, single.max_turns, single.max_tool_rounds) == (False, 1, 0)
    assert (single.max_observation_tokens, single.max_observation_chars, single.sequence_tokens) == (0, 0, 48)
    assert "tool answers" not in render_plan(cpu_tiny_plan([]))
    # one model turn: no tool answer can be read, so no observation token
    one = cpu_tiny_plan([*MULTI_TURN, "actor_rollout_ref.rollout.multi_turn.max_turns=1"]).token_budget
    assert (one.max_tool_rounds, one.max_observation_tokens) == (0, 0)


def test_a_multi_turn_conversation_longer_than_the_model_is_refused_naming_the_turns():
    with pytest.raises(ConfigError) as info:
        cpu_tiny_plan([*MULTI_TURN, "data.max_response_length=500"])
    [issue] = [i for i in info.value.issues if i.field == "data.max_response_length"]
    assert "max_position_embeddings=512" in str(issue) and "every model turn and tool answer" in str(issue)
    assert list(issue.valid) == [480]
