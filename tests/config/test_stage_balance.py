"""The plan's pipeline balance: each stage's share of a row's matmul FLOPs, the first/last split that
evens them, and the warning that names it. References: FLOPs counted by hand from the models' shapes,
and the best split found by trying every split megatron accepts (`ParallelLayout.split_errors` and
`stage_layers`, the layout's own rule, not the estimate's shortcut)."""
import json
from pathlib import Path

import pytest

from hybridrl.config.estimates import layer_flops_per_token, stage_balance
from hybridrl.config.plan import plan_from_sources
from hybridrl.config.report import render_plan
from hybridrl.models.arch import ModelShape, read_hf_config
from hybridrl.models.layout import ParallelLayout

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "configs/examples/smollm2_arith_grpo.yaml")
MC = "actor_rollout_ref.actor.megatron"
# SmolLM2-135M-Instruct's config.json (the fields the shape reads)
SMOLLM2 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "head_dim": 64,
           "intermediate_size": 1536, "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3,
           "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
           "tie_word_embeddings": True, "hidden_act": "silu"}
# one SmolLM2 layer: q and o 576 x 576, k and v 576 x 192, the MLP 3 x 576 x 1536, two norms of 576
SMOLLM2_LAYER = 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536 + 2 * 576


def shares_by_hand(stage_layers: tuple[int, ...], layer_cost: float, head_cost: float) -> list[float]:
    costs = [layers * layer_cost for layers in stage_layers]
    costs[-1] += head_cost
    return [c / sum(costs) for c in costs]


def every_split(num_layers: int, pp: int) -> list[tuple[int, ...]]:
    """Every stage split megatron accepts at this PP (first/last set or not, the rest even)."""
    splits = set()
    for first in [None, *range(1, num_layers)]:
        for last in [None, *range(1, num_layers)]:
            layout = ParallelLayout(pp=pp, first_stage_layers=first, last_stage_layers=last)
            if not layout.split_errors(num_layers):
                splits.add(layout.stage_layers(num_layers))
    return sorted(splits)


def test_layer_flops_count_two_per_weight_a_token_meets_and_causal_attention():
    smol = ModelShape.from_hf_config(SMOLLM2)
    assert layer_flops_per_token(smol, 0, 100) == 2 * SMOLLM2_LAYER + 2 * 100 * 576
    # an MoE layer: attention, norms and router dense, then 8 of its 128 experts (Qwen3-30B-A3B, hand-counted
    # as in the memory estimate's test)
    qwen = ModelShape.from_hf_dir(ROOT / "configs/models/qwen3-30b-a3b")
    dense = 2048 * (4096 + 512 + 512) + 4096 * 2048 + 2 * 128 + 2 * 2048 + 128 * 2048
    assert layer_flops_per_token(qwen, 5, 8) == pytest.approx(2 * (dense + 8 * 3 * 2048 * 768) + 2 * 8 * 4096)


def test_smollm2_at_pp2_balances_by_moving_layers_off_the_head_stage():
    """44 tokens a row through the layers (96 prompt tokens shared by 8 rows + 32 response), 32 through
    the vocab head (49152 x 576): the head is worth ~7.7 layers of a row, so 15 + 15 puts 58 % of the work
    on the last stage and 18 + 12 evens it."""
    smol = ModelShape.from_hf_config(SMOLLM2)
    seq = 128
    layer = 44 * (2 * SMOLLM2_LAYER + 2 * seq * 576)
    head = 32 * 2 * 576 * 49152
    balance = stage_balance("actor", smol, ParallelLayout(pp=2), layer_tokens=44, head_tokens=32, seq_len=seq,
                            vocab_head=True)
    assert balance.layers == (15, 15)
    assert balance.shares == pytest.approx(shares_by_hand((15, 15), layer, head))
    assert balance.shares[1] == pytest.approx(0.58, abs=0.01)
    # the best of every split megatron accepts, tried one by one
    best = min(every_split(30, 2), key=lambda split: max(shares_by_hand(split, layer, head)))
    assert best == (18, 12) == balance.best_layers
    assert balance.best_shares == pytest.approx(shares_by_hand(best, layer, head))
    assert (balance.best_first, balance.best_last) == (None, 12)  # one setting says it
    assert balance.gain == pytest.approx(1 - max(shares_by_hand(best, layer, head)) / 0.58, abs=0.01)
    # already balanced: nothing better to suggest
    settled = stage_balance("actor", smol, ParallelLayout(pp=2, last_stage_layers=12), layer_tokens=44,
                            head_tokens=32, seq_len=seq, vocab_head=True)
    assert settled.best_layers == settled.layers == (18, 12) and settled.gain == 0
    # padded rows (no shared prompt): 128 tokens through every layer, the head weighs ~2 layers
    padded = stage_balance("actor", smol, ParallelLayout(pp=2), layer_tokens=128, head_tokens=32, seq_len=seq,
                           vocab_head=True)
    layer_padded = 128 * (2 * SMOLLM2_LAYER + 2 * seq * 576)
    assert padded.best_layers == min(every_split(30, 2),
                                     key=lambda split: max(shares_by_hand(split, layer_padded, head))) == (16, 14)


@pytest.mark.parametrize("pp", [3, 5, 6])
def test_best_split_is_the_lightest_heaviest_stage_of_every_split_megatron_accepts(pp):
    smol = ModelShape.from_hf_config(SMOLLM2)
    layer, head = 40 * (2 * SMOLLM2_LAYER + 2 * 64 * 576), 30 * 2 * 576 * 49152
    balance = stage_balance("ref", smol, ParallelLayout(pp=pp), layer_tokens=40, head_tokens=30, seq_len=64,
                            vocab_head=True)
    splits = every_split(30, pp)
    lightest = min(max(shares_by_hand(split, layer, head)) for split in splits)
    assert balance.best_layers in splits
    assert max(balance.best_shares) == pytest.approx(lightest)
    assert max(balance.best_shares) < max(balance.shares)  # the head makes the even split worse
    layout = ParallelLayout(pp=pp, first_stage_layers=balance.best_first, last_stage_layers=balance.best_last)
    assert layout.stage_layers(30) == balance.best_layers


def test_value_head_and_uneven_experts():
    """A value head (critic, reward model) weighs nothing: the even split stays. With a dense layer among
    MoE layers (tiny Qwen3-MoE, layer 0 dense with a 4096-wide MLP) the layers weigh differently and the
    shares follow each stage's own layers."""
    smol = ModelShape.from_hf_config(SMOLLM2)
    critic = stage_balance("critic", smol, ParallelLayout(pp=2), layer_tokens=44, head_tokens=32, seq_len=128,
                           vocab_head=False)
    assert (critic.best_first, critic.best_last, critic.gain) == (None, None, 0)
    layer, value_head = 44 * (2 * SMOLLM2_LAYER + 2 * 128 * 576), 32 * 2 * 576
    assert critic.shares == pytest.approx(shares_by_hand((15, 15), layer, value_head))

    config = read_hf_config(ROOT / "configs/models/tiny-demo-moe")
    config.update(mlp_only_layers=[0], intermediate_size=4096)
    moe = ModelShape.from_hf_config(config)
    q = moe.q_size
    # layer 0: 49,152 attention + 320 norms + 3 x 128 x 4096; an MoE layer: 49,984 dense + top-k of its experts
    dense0 = 49_152 + 320 + 3 * 128 * 4096
    routed = 49_984 + 98_304 * moe.moe_top_k / moe.num_experts
    per = [2 * dense0 + 2 * 16 * q] + [2 * routed + 2 * 16 * q] * 3
    balance = stage_balance("actor", moe, ParallelLayout(pp=2), layer_tokens=10, head_tokens=4, seq_len=16,
                            vocab_head=True)
    head = 4 * 2 * moe.hidden_size * moe.vocab_size
    costs = [10 * (per[0] + per[1]), 10 * (per[2] + per[3]) + head]
    assert balance.shares == pytest.approx([c / sum(costs) for c in costs])


def _smollm2_dir(tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    return str(tmp_path)


def test_plan_warns_with_the_setting_that_evens_the_stages(tmp_path):
    path = f"actor_rollout_ref.model.path={_smollm2_dir(tmp_path)}"
    plan = plan_from_sources(EXAMPLE, [path, f"{MC}.pipeline_model_parallel_size=2"])
    (balance,) = plan.stage_balance
    assert (balance.role, balance.layers, balance.best_layers) == ("actor", (15, 15), (18, 12))
    (warning,) = [w for w in plan.warnings if "pipeline stages" in w]
    assert f"{MC}.num_layers_in_last_pipeline_stage=12 (18+12 layers, 50%/50%)" in warning and "42%/58%" in warning
    assert "18+12 would carry 50%/50%" in render_plan(plan)
    # the suggested setting plans without the warning, and the report says so
    settled = plan_from_sources(EXAMPLE, [path, f"{MC}.pipeline_model_parallel_size=2",
                                          f"{MC}.num_layers_in_last_pipeline_stage=12"])
    assert not [w for w in settled.warnings if "pipeline stages" in w]
    assert "18+12 layers carry 50%/50% (the most even split)" in render_plan(settled)
    # no pipeline, nothing to balance
    assert plan_from_sources(EXAMPLE, [path]).stage_balance == ()


def test_a_reference_on_the_actors_section_shares_its_warning(tmp_path):
    """With a KL loss the reference runs on the actor's megatron section: both balances are planned, and
    the one setting is named once."""
    path = f"actor_rollout_ref.model.path={_smollm2_dir(tmp_path)}"
    plan = plan_from_sources(EXAMPLE, [path, f"{MC}.pipeline_model_parallel_size=2",
                                       "actor_rollout_ref.actor.use_kl_loss=true"])
    assert [(b.role, b.best_layers) for b in plan.stage_balance] == [("actor", (18, 12)), ("ref", (18, 12))]
    assert len([w for w in plan.warnings if "pipeline stages" in w]) == 1
