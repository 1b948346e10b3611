"""The hybrid engine's generation peak credits each part the actor offloads (optimizer, grads) on its own."""
from pathlib import Path

import pytest

from hybridrl.config import ConfigError
from hybridrl.config.plan import plan_from_sources

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs/examples/qwen2.5_32b_grpo_4x8.yaml")
MC = "actor_rollout_ref.actor.megatron"


def test_generation_peak_drops_by_what_is_offloaded():
    # on a roomy GPU every combination plans, so the peaks can be compared
    roomy = "trainer.gpu_memory_gib=1000"
    plans = {(opt, grad): plan_from_sources(CONFIG, [f"{MC}.optimizer_offload={opt}", f"{MC}.grad_offload={grad}",
                                                     roomy])
             for opt in (False, True) for grad in (False, True)}
    actor = next(m for m in plans[(True, True)].training_memory if m.role == "actor")
    gen = {k: p.gpu_memory.phase("generation").total_gib for k, p in plans.items()}
    # optimizer_offload moves Adam's moments (8 of its 12 bytes a parameter); the fp32 master weights stay
    assert abs(gen[(False, False)] - gen[(True, False)] - actor.moments_gib) < 0.01
    assert actor.moments_gib == pytest.approx(actor.optimizer_gib * 8 / 12, rel=1e-2)
    assert abs(gen[(False, False)] - gen[(False, True)] - actor.grads_gib) < 0.01
    # on the example's 80 GB GPUs: fits with both offloaded, refused with nothing offloaded
    assert plan_from_sources(CONFIG, [f"{MC}.optimizer_offload=true", f"{MC}.grad_offload=true"]).gpu_memory.fits
    assert gen[(False, False)] > 80
    with pytest.raises(ConfigError, match="optimizer_offload=true"):
        plan_from_sources(CONFIG, [f"{MC}.optimizer_offload=false", f"{MC}.grad_offload=false"])


def test_expert_parallelism_splits_the_experts_in_the_memory_estimate():
    """An MoE rank holds experts / EP of every layer's experts; the distributed optimizer shards the
    experts' state over DP x CP / EP replicas and the dense weights' over DP. Hand-counted for
    Qwen3-30B-A3B: a layer is attention 2048 x (4096 + 512 + 512) + 4096 x 2048, q/k norms 2 x 128,
    two layer norms 2 x 2048, a router 128 x 2048 (dense), and 128 experts of 3 x 2048 x 768; the
    embedding and the output layer are 151936 x 2048 each, the final norm 2048."""
    from hybridrl.config.estimates import GIB, training_memory
    from hybridrl.config.meshes import build_training_mesh
    from hybridrl.models.arch import ModelShape

    shape = ModelShape.from_hf_dir(ROOT / "configs/models/qwen3-30b-a3b")
    dense_layer = 2048 * (4096 + 512 + 512) + 4096 * 2048 + 2 * 128 + 2 * 2048 + 128 * 2048
    expert_layer = 128 * 3 * 2048 * 768
    vocab = 151936 * 2048
    assert shape.param_count() == 48 * (dense_layer + expert_layer) + 2 * vocab + 2048  # 30.5B

    def estimate(ep: int, etp: int | None = None):  # the example's layout: PP2 x DP16 on 32 GPUs, TP1
        return training_memory("actor", shape, build_training_mesh(32, tp=1, pp=2), dtype="bf16",
                               distributed_optimizer=True, trainable=True, micro_batch=1, seq_len=8,
                               sequence_parallel=False, gpu_gib=80, ep=ep, etp=etp)

    # a stage holds 24 layers; the last one's output layer + final norm outweigh the first's embedding
    dense, experts = 24 * dense_layer + vocab + 2048, 24 * expert_layer // 8
    m = estimate(8)
    assert m.params_gib == pytest.approx((dense + experts) * 2 / GIB, rel=1e-3)  # 4.81 GiB
    assert m.grads_gib == pytest.approx((dense + experts) * 4 / GIB, rel=1e-3)
    assert m.optimizer_gib == pytest.approx((dense / 16 + experts / 2) * 12 / GIB, rel=1e-3)  # 10.66 GiB
    # expert TP 2 at EP8: half of each of those experts, their state over 16 / (8 x 2) = 1 replica
    split = estimate(8, 2)
    assert split.params_gib == pytest.approx((dense + experts / 2) * 2 / GIB, rel=1e-3)
    assert split.optimizer_gib == pytest.approx((dense / 16 + experts / 2) * 12 / GIB, rel=1e-3)
    # EP1 keeps every expert on every rank (and shards their state over all 16 DP ranks)
    whole = estimate(1)
    assert whole.params_gib == pytest.approx((dense + 8 * experts) * 2 / GIB, rel=1e-3)
    assert whole.optimizer_gib == pytest.approx((dense + 8 * experts) / 16 * 12 / GIB, rel=1e-3)
    # the shipped example plans and fits its 80 GB GPUs at EP8
    plan = plan_from_sources(str(ROOT / "configs/examples/qwen3_30b_a3b_grpo_4x8.yaml"))
    assert plan.gpu_memory.fits and next(m for m in plan.training_memory if m.role == "actor").params_gib == \
        pytest.approx(m.params_gib, rel=1e-3)


def test_memory_estimate_sums_each_stages_own_layers_when_moe_and_dense_layers_mix():
    """With `mlp_only_layers` a dense layer (a wide dense MLP, no experts) sits among MoE layers: each
    stage's parameters are its own layers', hand-counted on the tiny Qwen3-MoE with layer 0 dense
    (intermediate 4096): layer 0 = 49,152 attention + 320 norms + 3 x 128 x 4096; an MoE layer = 49,984
    dense + 98,304 expert params; embedding and output 96 x 128 each, final norm 128."""
    from hybridrl.config.estimates import stage_params
    from hybridrl.models.arch import ModelShape, read_hf_config
    from hybridrl.models.layout import ParallelLayout

    config = read_hf_config(ROOT / "configs/models/tiny-demo-moe")
    config.update(mlp_only_layers=[0], intermediate_size=4096)
    shape = ModelShape.from_hf_config(config)
    dense_layer, moe_dense, moe_experts, vocab = 49_152 + 320 + 3 * 128 * 4096, 49_984, 98_304, 96 * 128
    # PP1 at EP2: every layer on one stage, half of each MoE layer's experts
    assert list(stage_params(shape, ParallelLayout(pp=1, ep=2))) == [
        (dense_layer + 3 * moe_dense + 2 * vocab + 128, 3 * moe_experts / 2)]
    # PP2 at EP2: the first stage holds the dense layer, an MoE layer and the embedding; the last two
    # MoE layers, the final norm and the output layer
    assert list(stage_params(shape, ParallelLayout(pp=2, ep=2))) == [
        (dense_layer + moe_dense + vocab, moe_experts / 2), (2 * moe_dense + vocab + 128, moe_experts)]
    # uneven PP2 (1 + 3 layers): the first stage keeps only the dense layer and the embedding
    assert list(stage_params(shape, ParallelLayout(pp=2, ep=2, first_stage_layers=1))) == [
        (dense_layer + vocab, 0), (3 * moe_dense + vocab + 128, 3 * moe_experts / 2)]
