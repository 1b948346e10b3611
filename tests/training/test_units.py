"""Pure pieces of the workers: sequence alignment, micro-batch partitions, LR schedule, metric sums."""
from __future__ import annotations

import math

import pytest
import torch

from hybridrl.training.lr_schedule import LRSchedule
from hybridrl.training.metrics import StepMetrics, average_steps
from hybridrl.training.micro_batching import (
    balanced_partition,
    dynamic_partition,
    fixed_partition,
    micro_batches_needed,
    restore_order,
    shared_dynamic_partition,
)
from hybridrl.training.sequences import SequenceLayoutError, build_model_inputs, take_predictions
from tests.support.forked import run_ranks
from tests.support.training_fixtures import RESPONSE, rollout_batch


# ------------------------------------------------------------------------------------ sequences
def test_alignment_keeps_each_rows_real_tokens_and_finds_responses():
    batch = rollout_batch(6, seed=2)
    inputs = build_model_inputs(batch["input_ids"], batch["attention_mask"], batch["position_ids"],
                                batch["responses"], batch["response_mask"])
    mask = batch["attention_mask"].bool()
    assert inputs.seq_length == int(mask.sum(-1).max())  # trimmed to the longest real row
    for i in range(6):
        real = batch["input_ids"][i][mask[i]]
        n = real.numel()
        assert torch.equal(inputs.input_ids[i, :n], real)  # left-aligned, order kept
        assert torch.equal(inputs.position_ids[i, :n], batch["position_ids"][i][mask[i]])
        assert int(inputs.last_index[i]) == n - 1
        # The column predicting response token j holds the token just before it.
        for j in range(int(batch["response_mask"][i].sum())):
            col = int(inputs.predict_index[i, j])
            assert inputs.input_ids[i, col + 1] == batch["responses"][i, j]
    picked = take_predictions(inputs.input_ids.unsqueeze(-1).float(), inputs.predict_index)
    assert picked.shape == (6, RESPONSE, 1)


@pytest.mark.parametrize("packed,pad_multiple", [(False, 1), (False, 4), (True, 4)])
def test_padding_mask_marks_exactly_the_columns_without_a_real_token(packed, pad_multiple):
    batch = rollout_batch(6, seed=2)
    inputs = build_model_inputs(batch["input_ids"], batch["attention_mask"], batch["position_ids"],
                                batch["responses"], batch["response_mask"], packed=packed, pad_multiple=pad_multiple)
    lengths = batch["attention_mask"].sum(-1).tolist()
    mask = inputs.padding_mask()
    assert mask.shape == inputs.input_ids.shape and mask.dtype == torch.bool
    if packed:  # one row of every real token, then the padding segment up to the multiple of 4
        total = sum(lengths)
        assert mask.shape[1] == -(-total // 4) * 4 > total
        assert mask[0].tolist() == [False] * total + [True] * (mask.shape[1] - total)
    else:
        for i, n in enumerate(lengths):
            assert mask[i].tolist() == [False] * n + [True] * (mask.shape[1] - n), i
        assert int((~mask).sum()) == sum(lengths) and mask.any()


def test_response_token_positions_and_scatter_back():
    batch = rollout_batch(6, seed=2)
    inputs = build_model_inputs(batch["input_ids"], batch["attention_mask"], batch["position_ids"],
                                batch["responses"], batch["response_mask"])
    rows, cols = inputs.response_token_positions()
    mask = batch["response_mask"]
    assert rows.numel() == int(mask.sum())  # every real response token once, no padding
    expected = [(i, j) for i in range(6) for j in range(mask.shape[1]) if mask[i, j]]  # row-major
    assert list(zip(rows.tolist(), cols.tolist())) == expected
    values = torch.arange(1, rows.numel() + 1, dtype=torch.float32, requires_grad=True)
    full = inputs.scatter_response_tokens(values)
    assert full.shape == mask.shape and bool((full[mask == 0] == 0).all())
    assert [float(full[i, j]) for i, j in expected] == values.tolist()
    full.sum().backward()  # differentiable: each token's gradient reaches its value once
    assert torch.equal(values.grad, torch.ones_like(values))
    # no real response token at all: one masked position, so a forward still has a column
    empty = build_model_inputs(batch["input_ids"], batch["attention_mask"], batch["position_ids"],
                               batch["responses"], torch.zeros_like(mask))
    rows, cols = empty.response_token_positions()
    assert rows.tolist() == [0] and cols.tolist() == [0]


def test_alignment_rejects_bad_layouts():
    batch = rollout_batch(2)
    holes = batch["attention_mask"].clone()
    holes[0, -RESPONSE - 2] = 0  # a hole inside row 0's prompt (row 0 is unpadded)
    with pytest.raises(SequenceLayoutError, match="holes"):
        build_model_inputs(batch["input_ids"], holes, batch["position_ids"], batch["responses"],
                           batch["response_mask"])
    no_prompt = batch["attention_mask"].clone()
    no_prompt[1, :-RESPONSE] = 0
    with pytest.raises(SequenceLayoutError, match="prompt token"):
        build_model_inputs(batch["input_ids"], no_prompt, batch["position_ids"], batch["responses"],
                           batch["response_mask"])
    with pytest.raises(SequenceLayoutError, match="end with the responses"):
        build_model_inputs(batch["input_ids"], batch["attention_mask"], batch["position_ids"],
                           batch["responses"] + 1, batch["response_mask"])


# ------------------------------------------------------------------------------- micro-batches
def test_fixed_and_balanced_partitions():
    assert fixed_partition(5, 2) == [[0, 1], [2, 3], [4]]
    lengths = [9, 1, 8, 2, 7, 3]
    parts = balanced_partition(lengths, 3)
    assert sorted(sum(parts, [])) == list(range(6)) and all(parts)
    assert sorted(sum(lengths[r] for r in p) for p in parts) == [10, 10, 10]
    assert micro_batches_needed(lengths, 10) == 3
    assert micro_batches_needed(lengths, 100) == 1
    assert micro_batches_needed([50, 1], 10) == 2  # an over-long row gets a micro-batch of its own


def test_restore_order_inverts_any_partition():
    values = torch.arange(7.0).unsqueeze(-1) * 10
    parts = [[5, 0], [3, 1, 6], [2, 4]]
    outputs = [values[torch.tensor(p)] for p in parts]
    assert torch.equal(restore_order(outputs, parts), values)


def _agree(rank: int, world: int) -> list[list[int]]:
    lengths = [30, 30, 30, 30] if rank == 0 else [5, 5, 5, 5]
    return dynamic_partition(lengths, max_tokens=60, dp_group=None if world == 1 else torch.distributed.group.WORLD)


def test_dynamic_partition_agrees_on_the_count_over_dp():
    rank0, rank1 = run_ranks(_agree, 2)
    assert len(rank0) == len(rank1) == 2  # rank 1 alone would need 1 micro-batch


def test_shared_token_budget_counts_a_prompt_once_and_keeps_its_rows_together():
    # two prompt groups: prompt 10 with responses 2, 3, 4 (rows 0-2), prompt 5 with responses 1, 1 (rows 3-4)
    prompts = [10, 10, 10, 5, 5]
    lengths = [12, 13, 14, 6, 6]
    groups = [[0, 1, 2], [3, 4]]
    # shared: 10 + 9 = 19 and 5 + 2 = 7 tokens, one micro-batch of 26 fits a budget of 30 (rows alone: 51)
    assert shared_dynamic_partition(lengths, prompts, groups, 30) == [[0, 1, 2, 3, 4]]
    assert len(dynamic_partition(lengths, 30)) == 2
    # a budget of 20: the groups go to separate micro-batches, each whole (19 and 7)
    assert shared_dynamic_partition(lengths, prompts, groups, 20) == [[0, 1, 2], [3, 4]]
    # a budget of 16: the first group is cut where its prompt plus responses pass it: 10+2+3 = 15, then
    # 10+4 = 14; with the second group's 7 that is 36 tokens, 3 micro-batches
    assert sorted(shared_dynamic_partition(lengths, prompts, groups, 16)) == [[0, 1], [2], [3, 4]]


# ------------------------------------------------------------------------------------ schedule
def test_lr_schedule_shapes():
    warm = LRSchedule(lr=1.0, warmup_steps=4)
    assert [warm.lr_at(k) for k in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    linear = LRSchedule(lr=1.0, min_lr=0.1, warmup_steps=0, decay_style="linear", total_steps=10)
    assert linear.lr_at(0) == 1.0 and linear.lr_at(5) == pytest.approx(0.55) and linear.lr_at(20) == 0.1
    cosine = LRSchedule(lr=1.0, warmup_steps=2, decay_style="cosine", total_steps=12)
    assert cosine.lr_at(2) == 1.0 and cosine.lr_at(7) == pytest.approx(0.5) and cosine.lr_at(12) == 0.0
    assert cosine.lr_at(4) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.2)))
    with pytest.raises(ValueError, match="needs the total"):
        LRSchedule(lr=1.0, decay_style="cosine")
    restored = LRSchedule(lr=1.0, warmup_steps=4)
    warm.step_count = 3
    restored.load_state_dict(warm.state_dict())
    assert restored.current_lr == 1.0


def test_a_resume_with_another_count_of_optimizer_steps_a_step_keeps_the_schedule_on_the_run():
    """The schedule counts optimizer steps over total_training_steps x those a step takes. A GRPO run decaying
    linearly from 1e-3 over 4 steps, saved after 2 at one optimizer step each and resumed at two a step
    (ppo_mini_batch_size halved), logged actor/lr 6.875e-4 and 4.375e-4 for steps 3 and 4 (measured): its position 2
    read against 8, so the decay ended above half the lr. Rescaled to the same point of the run (4 of 8) it ends as
    the run does."""
    from hybridrl.config.schema import OptimConfig

    optim = OptimConfig(lr=1e-3, lr_decay_style="linear")
    saved = LRSchedule.from_config(optim, total_steps=4 * 1, steps_per_step=1)
    saved.step_count = 2
    resumed = LRSchedule.from_config(optim, total_steps=4 * 2, steps_per_step=2)
    resumed.load_state_dict(saved.state_dict())
    assert resumed.step_count == 4
    assert [resumed.lr_at(resumed.step_count + k) for k in range(4)] == pytest.approx([5e-4, 3.75e-4, 2.5e-4, 1.25e-4])
    same = LRSchedule.from_config(optim, total_steps=4, steps_per_step=1)  # the same count a step: as saved
    saved.step_count = 3  # (a skipped non-finite step leaves the count behind the steps; kept exactly)
    same.load_state_dict(saved.state_dict())
    assert same.step_count == 3
    older = {k: v for k, v in saved.state_dict().items() if k != "steps_per_step"}  # a checkpoint before the field
    resumed.load_state_dict(older)
    assert resumed.step_count == 3


def test_the_warmup_rises_from_lr_warmup_init():
    """verl's optim.lr_warmup_init (megatron's init_lr): the linear warmup starts from it instead of 0."""
    from hybridrl.config.schema import OptimConfig

    schedule = LRSchedule.from_config(OptimConfig(lr=1.0, lr_warmup_steps=4, lr_warmup_init=0.2))
    assert [schedule.lr_at(k) for k in range(6)] == pytest.approx([0.4, 0.6, 0.8, 1.0, 1.0, 1.0])
    plain = LRSchedule.from_config(OptimConfig(lr=1.0, lr_warmup_steps=4))
    assert [plain.lr_at(k) for k in range(4)] == [0.25, 0.5, 0.75, 1.0]


# ------------------------------------------------------------------------------------- metrics
def test_step_metrics_sum_totals_and_weight_means():
    sums = StepMetrics()
    sums.add_micro({"weight": torch.tensor(3.0), "total/loss": torch.tensor(0.5), "mean/clipfrac": torch.tensor(1.0)})
    sums.add_micro({"weight": torch.tensor(1.0), "total/loss": torch.tensor(0.25), "mean/clipfrac": torch.tensor(0.0)})
    assert sums.reduce_over(None) == {"loss": 0.75, "clipfrac": 0.75}
    assert average_steps([{"a": 1.0, "b": 2.0}, {"a": 3.0}]) == {"a": 2.0, "b": 2.0}


def test_step_metrics_take_the_max_of_max_metrics():
    sums = StepMetrics()
    for gap in (0.5, 2.0, 1.0):
        sums.add_micro({"weight": torch.tensor(1.0), "max/gap": torch.tensor(gap)})
    assert sums.reduce_over(None) == {"gap": 2.0}


# ------------------------------------------------------------------------------------ optimizer
@pytest.mark.parametrize("make", [
    lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True),
    lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False),
    lambda params: torch.optim.Adam(params, lr=1e-2, amsgrad=True, foreach=False),
], ids=["adamw_fused", "adamw_single_tensor", "adam_amsgrad"])
def test_adam_state_made_at_setup_steps_exactly_as_torchs_lazy_state(make):
    """`materialize_adam_state` (`DevicePolicy.optimizer_state_at_setup`) against torch's own lazy
    initialization: the same state entries, and three steps give bit-identical weights and moments."""
    from types import SimpleNamespace

    from hybridrl.training.backend import materialize_adam_state

    gen = torch.Generator().manual_seed(0)
    initial = [torch.randn(5, 3, generator=gen), torch.randn(7, generator=gen), torch.randn(2, generator=gen)]
    grads = [[torch.randn(t.shape, generator=gen) for t in initial[:2]] for _ in range(3)]

    def params() -> list[torch.nn.Parameter]:
        made = [torch.nn.Parameter(t.clone()) for t in initial]
        made[2].requires_grad_(False)  # frozen: no state either way
        return made

    lazy_params, eager_params = params(), params()
    lazy, eager = make(lazy_params), make(eager_params)
    assert materialize_adam_state(SimpleNamespace(optimizer=eager)) == 2
    assert not lazy.state and set(eager.state) == set(eager_params[:2])
    for step_grads in grads:
        for ps in (lazy_params, eager_params):
            for p, g in zip(ps[:2], step_grads):
                p.grad = g.clone()
        lazy.step()
        eager.step()
    for p_lazy, p_eager in zip(lazy_params, eager_params):
        assert torch.equal(p_lazy, p_eager)
        assert set(lazy.state[p_lazy]) == set(eager.state[p_eager])
        for name, value in lazy.state[p_lazy].items():
            other = eager.state[p_eager][name]
            assert (value.dtype, value.device) == (other.dtype, other.device), name
            assert torch.equal(value, other), name
    assert not torch.equal(lazy_params[0], initial[0])  # the steps moved the weights
