"""The plan's model of inter-node traffic (`hybridrl.config.internode`) against hand arithmetic; its figures against
a real link are in tests/e2e/test_multi_host.py, and docs/performance.md's table is the bench's result file."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hybridrl.config.internode import RoleTraffic, internode_traffic, plan_internode_traffic
from hybridrl.config.meshes import build_reshard_groups, build_training_mesh
from hybridrl.models.arch import ModelShape
from hybridrl.names import Phase

ROOT = Path(__file__).resolve().parents[2]
DEMO = json.loads((ROOT / "configs/models/tiny-demo/config.json").read_text())
H, FFN, LAYERS, VOCAB = 128, 256, 4, 96  # the demo model (Llama, untied, 4 q heads and 2 kv heads of 32)
PADDED = 128  # megatron pads the vocabulary to a multiple of 128


def _layer_params() -> int:
    q, kv, o = 4 * 32 * H, 2 * 32 * H, 4 * 32 * H  # q, k and v each of 2 heads, o
    return q + 2 * kv + o + 3 * H * FFN + 2 * H  # attention, gate/up/down, two norms


def _actor(mesh, tokens: float = 0.0, **kwargs) -> RoleTraffic:
    settings = {"optimizer_steps": 1, "update_epochs": 1, **kwargs}
    return RoleTraffic(Phase.UPDATE_ACTOR, (Phase.OLD_LOG_PROB,), ModelShape.from_hf_config(DEMO), mesh, "fp32",
                       tokens=tokens, **settings)


def test_the_gradient_all_reduce_is_each_ranks_buffer_around_the_ring():
    """DP2 on two nodes: each node sends its rank's whole fp32 gradient buffer (2(p-1)/p = 1 of it), megatron's
    padded vocabulary included. DP4 on two nodes of two: in the ring 0-1-2-3 the links 1->2 and 3->0 cross, each
    carrying 2 x 3/4 of the buffer. Nothing crosses on one node."""
    buffer = (LAYERS * _layer_params() + 2 * PADDED * H + H) * 4  # layers, embedding and output (padded), norm
    assert buffer == 2_494_976  # what bench/internode_traffic.py planned and the link carried (+2.7 %)
    two = internode_traffic([_actor(build_training_mesh(2, 1, 1))], per_node=1)
    assert two.phases == {"update_actor": (buffer, buffer)}  # one pass, no pipeline: nothing in old_log_prob
    four = internode_traffic([_actor(build_training_mesh(4, 1, 1))], per_node=2)
    assert four.phases["update_actor"] == (round(1.5 * buffer), round(1.5 * buffer))
    assert internode_traffic([_actor(build_training_mesh(2, 1, 1))], per_node=2).phases["update_actor"] == (0,)
    steps = internode_traffic([_actor(build_training_mesh(2, 1, 1), optimizer_steps=3)], per_node=1)
    assert steps.phases["update_actor"] == (3 * buffer, 3 * buffer)


def test_a_pipeline_across_nodes_carries_activations_forward_and_gradients_back():
    """PP2 on two nodes, 1000 tokens: a forward-only pass sends 1000 x 128 x 4 B from the first stage's node; the
    update that forward and the same back; the sync sends each stage's layers (and its vocabulary tensor) to the
    other node. At PP2 x DP2 on two nodes of two (stages on different nodes) each node carries both replicas'
    halves of the tokens: the same bytes; with VPP2 a micro-batch crosses 3 chunk boundaries, each between
    the nodes."""
    mesh = build_training_mesh(2, 1, 2)
    tokens, activations = 1000, 1000 * H * 4
    groups = build_reshard_groups(mesh, 1)
    stage_bytes = [(2 * _layer_params() + VOCAB * H) * 4, (2 * _layer_params() + VOCAB * H + H) * 4]
    received = [stage_bytes[1], stage_bytes[0]]  # each rank lacks the other stage (vLLM's vocab: 96 rows, whole)
    traffic = internode_traffic([_actor(mesh, tokens)], per_node=1, sync=(groups, received))
    assert traffic.phases == {"old_log_prob": (activations, 0), "update_actor": (activations, activations),
                              "sync": tuple(stage_bytes)}
    wide = build_training_mesh(4, 1, 2)  # rank = dp + 2 pp: stage 0 on node 0, stage 1 on node 1
    assert internode_traffic([_actor(wide, tokens)], per_node=2).phases["old_log_prob"] == (activations, 0)
    virtual = build_training_mesh(2, 1, 2, vpp=2)
    assert internode_traffic([_actor(virtual, tokens)], per_node=1).phases["old_log_prob"] == (
        2 * activations, activations)


def test_sequence_parallelism_and_the_distributed_optimizer_shrink_what_they_should():
    """TP2 x PP2 across nodes (each TP rank sends to its peer of the next stage): without SP each TP rank sends
    every token's activations, with SP its half. The distributed optimizer moves (p-1)/p of the fp32 gradients and
    (p-1)/p of the parameters (bf16 here): 3/4 of the plain all-reduce's bytes at p = 2."""
    tp_pp = build_training_mesh(4, 2, 2)
    full = internode_traffic([_actor(tp_pp, 1000)], per_node=2).phases["old_log_prob"]
    half = internode_traffic([_actor(tp_pp, 1000, sequence_parallel=True)], per_node=2).phases["old_log_prob"]
    assert full == (2 * 1000 * H * 4, 0) and half == (1000 * H * 4, 0)
    shape = ModelShape.from_hf_config(DEMO)
    plain = RoleTraffic(Phase.UPDATE_ACTOR, (), shape, build_training_mesh(2, 1, 1), "bf16", optimizer_steps=1)
    distributed = RoleTraffic(Phase.UPDATE_ACTOR, (), shape, build_training_mesh(2, 1, 1), "bf16",
                              distributed_optimizer=True, optimizer_steps=1)
    (a, _), (b, _) = (internode_traffic([r], per_node=1).phases["update_actor"] for r in (plain, distributed))
    assert b == pytest.approx(0.75 * a, abs=1)


def test_plan_shows_the_traffic_only_across_nodes():
    """`hybridrl plan` at nnodes > 1 prints what each node sends per phase; on one node nothing."""
    from hybridrl.config.plan import plan_from_sources
    from hybridrl.config.report import render_plan

    example = ROOT / "configs/examples/qwen2.5_32b_grpo_4x8.yaml"
    plan = plan_from_sources(example, [])
    text = render_plan(plan)
    traffic = plan_internode_traffic(plan)
    assert traffic is not None and traffic.nodes == plan.config.trainer.nnodes
    assert "Traffic between nodes per step" in text
    step = re.search(r"^step\s+([\d,.]+)", text, re.M)
    assert step and float(step.group(1).replace(",", "")) == pytest.approx(traffic.total()[0] / 2**20, abs=0.01)
    single = plan_from_sources(example, ["trainer.nnodes=1", "trainer.n_gpus_per_node=32"])
    assert plan_internode_traffic(single) is None and "Traffic between nodes" not in render_plan(single)


def test_a_disaggregated_pool_is_on_nodes_of_its_own():
    """rollout.mode=disaggregated: the rollout pool's nodes come after the training nodes and every byte of the
    cross-pool sync crosses, each training rank sending an even share (the demo at trainer 1 x 2, rollout 1 x 1:
    node 0 sends vLLM's whole fp32 shard, the 96 real vocabulary rows of each vocabulary tensor)."""
    from hybridrl.config.plan import plan_from_sources

    demo = ["actor_rollout_ref.model.path=configs/models/tiny-demo", "trainer.nnodes=1", "trainer.n_gpus_per_node=2",
            "actor_rollout_ref.rollout.mode=disaggregated", "actor_rollout_ref.rollout.nnodes=1",
            "actor_rollout_ref.rollout.n_gpus_per_node=1"]
    plan = plan_from_sources(ROOT / "configs/examples/cpu_tiny_grpo.yaml", demo)
    traffic = plan_internode_traffic(plan)
    model = (LAYERS * _layer_params() + 2 * VOCAB * H + H) * 4
    assert traffic.nodes == 2 and traffic.phases["sync"] == (model, 0) and "update_actor" in traffic.phases
    assert traffic.phases["update_actor"] == (0, 0)  # DP2 inside node 0


def test_a_teacher_pool_is_on_nodes_of_its_own_after_the_rollout_pool():
    """teacher.mode=disaggregated: the teacher's pool comes after the training and rollout nodes,
    teacher.n_gpus_per_node ranks a node. The demo as its own teacher at PP2 on a pool of 2 nodes x 1 rank, beside
    training on node 0 and the rollout pool on node 1: 1000 teacher tokens cross from node 2 (stage 0) to node 3
    (stage 1), 1000 x 128 x 4 B; nothing of the teacher's on the training or rollout nodes. At 1 node x 2 ranks
    the same pipeline stays inside node 2."""
    from hybridrl.config.plan import plan_from_sources
    from hybridrl.names import Role

    demo = ["actor_rollout_ref.model.path=configs/models/tiny-demo", "trainer.nnodes=1", "trainer.n_gpus_per_node=2",
            "actor_rollout_ref.rollout.mode=disaggregated", "actor_rollout_ref.rollout.nnodes=1",
            "actor_rollout_ref.rollout.n_gpus_per_node=1", "algorithm.distillation.enable=true",
            "teacher.model.path=configs/models/tiny-demo", "teacher.mode=disaggregated",
            "teacher.megatron.pipeline_model_parallel_size=2"]
    example = ROOT / "configs/examples/cpu_tiny_grpo.yaml"
    plan = plan_from_sources(example, [*demo, "teacher.nnodes=2", "teacher.n_gpus_per_node=1"])
    traffic = plan_internode_traffic(plan, tokens={Role.TEACHER: 1000})
    assert traffic.nodes == 4 and traffic.phases["teacher"] == (0, 0, 1000 * H * 4, 0)
    one_node = plan_from_sources(example, [*demo, "teacher.nnodes=1", "teacher.n_gpus_per_node=2"])
    traffic = plan_internode_traffic(one_node, tokens={Role.TEACHER: 1000})
    assert traffic.nodes == 3 and "teacher" not in traffic.phases


def test_served_lora_adapters_move_the_adapter_alone_each_step():
    """lora.merge=false: a step's sync moves the PEFT adapter, not the weights. Rank 8 on every target of the demo
    (H 128, FFN 256, q 128 and k/v 64 rows), per layer in PEFT form: q A 8x128 + B 128x8, k and v A 8x128 + B 64x8
    each, o 2 x 8x128, gate and up A 8x128 + B 256x8 each, down A 8x256 + B 128x8: 16,384 elements, x 4 layers x
    4 B = 262,144 B. Disaggregated, trainer 2 nodes x 1 rank: training rank r ships it to rollout rank q = r (mod
    2), so with two rollout ranks each training node sends it once, with one only node 0. Colocated at PP2 over 2
    nodes: each stage's half is broadcast from its holder to the other node."""
    from hybridrl.config.plan import plan_from_sources, served_adapter_bytes

    adapter = 16_384 * LAYERS * 4
    example = ROOT / "configs/examples/cpu_tiny_grpo.yaml"
    served = ["actor_rollout_ref.model.path=configs/models/tiny-demo", "actor_rollout_ref.model.lora.rank=8",
              "actor_rollout_ref.model.lora.merge=false", "trainer.nnodes=2", "trainer.n_gpus_per_node=1"]
    apart = served + ["actor_rollout_ref.rollout.mode=disaggregated", "actor_rollout_ref.rollout.nnodes=1"]
    two = plan_from_sources(example, [*apart, "actor_rollout_ref.rollout.n_gpus_per_node=2"])
    assert served_adapter_bytes(two) == adapter
    assert plan_internode_traffic(two).phases["sync"] == (adapter, adapter, 0)
    one = plan_from_sources(example, [*apart, "actor_rollout_ref.rollout.n_gpus_per_node=1"])
    assert plan_internode_traffic(one).phases["sync"] == (adapter, 0, 0)
    pp2 = "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2"
    colocated = plan_from_sources(example, [*served, pp2])
    assert plan_internode_traffic(colocated).phases["sync"] == (adapter / 2, adapter / 2)
    # merged (lora.merge true): half the fp32 model from each training node, every step
    merged = plan_from_sources(example, [*apart[:2], *apart[3:], "actor_rollout_ref.rollout.n_gpus_per_node=1"])
    assert served_adapter_bytes(merged) == 0 and plan_internode_traffic(merged).phases["sync"][0] > 4 * adapter


def test_the_performance_table_is_the_bench_result_file():
    results = json.loads((ROOT / "bench/results/internode_traffic.json").read_text())
    doc = (ROOT / "docs/performance.md").read_text()
    for name, layout in results["layouts"].items():
        for phase, row in layout["table"].items():
            cells = [f"{v:,.0f}" for v in (*row["measured"], *row["planned"])]
            assert f"| {name} | {phase} | " + " | ".join(cells) + " |" in doc, (name, phase)
