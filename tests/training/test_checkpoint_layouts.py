"""Role checkpoints resume on another layout: weights, Adam state and LR schedule re-shard on load.

A PPO actor takes one optimizer step and saves. Each resume loads that checkpoint on some layout and
takes the next step on the same batch; its loss, grad norm, lr and the weights after the step
(gathered to HF names) must match a resume on the saved layout to 1e-5 (fp32, CPU). A resume that
restores only the weights (fresh Adam state, schedule from step 0) must not match: the comparison
sees the optimizer state. The warmup schedule makes the second step's lr differ from the first's.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.checkpoint_resumes import assert_same_next_step, checkpoint_rank, resume_config, run_resume
from tests.support.forked import run_ranks
from tests.support.models_fixtures import make_hf_model, safetensors_state
from tests.support.training_fixtures import job_config, policy_model, rollout_batch, sequence_classifier, with_critic


@pytest.fixture(scope="module")
def tp2_pp2_checkpoint(tmp_path_factory):
    """A TP2 x PP2 actor checkpoint after one optimizer step: (HF model, batches, checkpoint folder)."""
    base = tmp_path_factory.mktemp("tp2pp2")
    hf = make_hf_model(base / "hf", "llama", num_hidden_layers=8)  # 8 layers: PP4 x VPP2 can hold it too
    batches = [rollout_batch(8, seed=1), rollout_batch(8, seed=2)]
    ckpt = base / "ckpt"
    run_ranks(checkpoint_rank, 4, resume_config(hf, tp=2, pp=2), batches, str(ckpt), "", "save")
    return hf, batches, ckpt


def test_tp2_pp2_checkpoint_resumes_on_tp1_pp2_and_tp2_pp1(tp2_pp2_checkpoint, tmp_path):
    hf, batches, ckpt = tp2_pp2_checkpoint
    reference = run_resume(resume_config(hf, tp=2, pp=2), 4, batches, ckpt, tmp_path / "ref", "resume")
    assert reference["resharded"] is False
    assert reference["step"]["lr"] == pytest.approx(1e-2 * 2 / 4)  # the second step of the warmup
    # (tp, pp, layers on the first stage: None = even; 3 = uneven stages of 3 + 5 layers)
    for tp, pp, first in ((1, 2, None), (2, 1, None), (1, 2, 3)):
        run = run_resume(resume_config(hf, tp=tp, pp=pp, first_stage_layers=first), tp * pp, batches, ckpt,
                   tmp_path / f"tp{tp}pp{pp}first{first}", "resume")
        assert run["resharded"] is True
        assert_same_next_step(run, reference, f"tp{tp} pp{pp} first stage {first}")
    # Without the optimizer state and schedule the next step differs: the comparison above sees them.
    fresh = run_resume(resume_config(hf, tp=1, pp=1), 1, batches, ckpt, tmp_path / "fresh", "weights_only")
    gap = max(float((fresh["weights"][n] - w).abs().max()) for n, w in reference["weights"].items())
    assert gap > 1e-4 and fresh["lr"] != reference["lr"]


def test_distributed_optimizer_dp2_checkpoint_resumes_on_dp1_and_tp2(tmp_path):
    """Adam state sharded over DP by megatron's distributed optimizer is gathered on save and re-split on load."""
    hf = policy_model(tmp_path / "hf")
    batches = [rollout_batch(8, seed=3), rollout_batch(8, seed=4)]
    ckpt = tmp_path / "ckpt"
    saved = resume_config(hf, tp=1, pp=1, dp=2, distributed=True)
    run_ranks(checkpoint_rank, 2, saved, batches, str(ckpt), "", "save")
    reference = run_resume(saved, 2, batches, ckpt, tmp_path / "ref", "resume")
    cases = {"dp1": (resume_config(hf, tp=1, pp=1), 1),
             "tp2 distributed": (resume_config(hf, tp=2, pp=1, distributed=True), 2)}
    for label, (config, world) in cases.items():
        run = run_resume(config, world, batches, ckpt, tmp_path / label.replace(" ", "_"), "resume")
        assert run["resharded"] is True
        assert_same_next_step(run, reference, label)


def test_critic_checkpoint_resumes_on_another_layout(tmp_path):
    """Value model: backbone re-shards like the policy, the scalar head (replicated over TP) is carried."""
    hf = policy_model(tmp_path / "hf")
    critic = sequence_classifier(tmp_path / "critic")
    batches = [rollout_batch(8, seed=5), rollout_batch(8, seed=6)]
    ckpt = tmp_path / "ckpt"

    def config(tp: int, pp: int) -> Any:
        c = with_critic(job_config(hf, world=tp * pp, tp=tp, pp=pp), critic, tp=tp, pp=pp)
        c.critic.optim.lr_warmup_steps = 4
        return c

    run_ranks(checkpoint_rank, 4, config(2, 2), batches, str(ckpt), "", "save", "critic")
    reference = run_resume(config(2, 2), 4, batches, ckpt, tmp_path / "ref", "resume", "critic")
    run = run_resume(config(1, 2), 2, batches, ckpt, tmp_path / "tp1pp2", "resume", "critic")
    assert run["resharded"] is True and run["lr"] == reference["lr"]
    for field in ("vf_loss", "grad_norm"):
        a, b = getattr(run["metrics"], field), getattr(reference["metrics"], field)
        assert abs(a - b) <= 1e-5, (field, a, b)
    assert run["weights"].keys() == reference["weights"].keys()
    gap = max(float((run["weights"][n] - w).abs().max()) for n, w in reference["weights"].items())
    assert gap <= 1e-5, gap


def _load_rank(rank: int, world: int, config: Any, ckpt: str) -> str:
    from hybridrl.config.plan import build_plan
    from hybridrl.training.backend import MegatronBackend, role_spec
    from hybridrl.training.checkpointing import load_role_checkpoint

    backend = MegatronBackend(role_spec(build_plan(config), "actor"))
    try:
        load_role_checkpoint(backend, ckpt)
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


def test_another_model_is_refused_on_a_layout_change(tp2_pp2_checkpoint, tmp_path):
    _, _, ckpt = tp2_pp2_checkpoint
    other = make_hf_model(tmp_path / "qwen", "qwen2", seed=0)  # another architecture
    error = run_ranks(_load_rank, 1, resume_config(other, tp=1, pp=1), str(ckpt))[0]
    assert "was saved from another model" in error and "architecture='LlamaForCausalLM'" in error \
        and "Qwen2ForCausalLM" in error, error


def _resave_rank(rank: int, world: int, config: Any, ckpt: str, out: str) -> None:
    from hybridrl.config.plan import build_plan
    from hybridrl.training.backend import MegatronBackend, role_spec
    from hybridrl.training.checkpointing import load_role_checkpoint, save_role_checkpoint

    backend = MegatronBackend(role_spec(build_plan(config), "actor"))
    load_role_checkpoint(backend, ckpt)
    save_role_checkpoint(backend, out)


def _hf_state(ckpt: Path) -> tuple[dict[str, Any], dict[tuple[str, str], torch.Tensor]]:
    """A role checkpoint's optimizer description and every state kind as whole HF-named tensors."""
    from hybridrl.models.checkpoint import read_hf_tensor
    from hybridrl.models.layout import hf_tensor_shapes
    from hybridrl.training.checkpointing import _read_meta
    from hybridrl.training.train_state import STATE_DIR, KindReader, TrainState

    meta = _read_meta(ckpt)
    store = TrainState(ckpt / STATE_DIR, meta)
    tensors = {}
    try:
        for kind in meta["optimizer"]["kinds"]:
            for name in hf_tensor_shapes(store.shape):
                try:
                    tensors[(kind, name)] = read_hf_tensor(KindReader(store, kind), store.shape, name)
                except Exception:  # noqa: BLE001 - fp32 params (norms) of a bf16 model have no separate master
                    assert kind == "main_param" and "norm" in name, (kind, name)
    finally:
        store.close()
    return meta["optimizer"], tensors


def _groups_after_load(rank: int, world: int, config: Any, ckpt: str) -> list[tuple[Any, ...]]:
    from hybridrl.config.plan import build_plan
    from hybridrl.training.backend import MegatronBackend, role_spec
    from hybridrl.training.checkpointing import load_role_checkpoint
    from hybridrl.training.optimizer_state import OptimizerView

    backend = MegatronBackend(role_spec(build_plan(config), "actor"))
    load_role_checkpoint(backend, ckpt)
    inner = [part.optimizer for part in OptimizerView(backend.optimizer).parts]
    steps = {float(s["step"]) for optimizer in inner for s in optimizer.state.values()}
    return [(tuple(g["betas"]), g["eps"], steps) for optimizer in inner for g in optimizer.param_groups]


def test_a_resume_keeps_the_jobs_optimizer_settings(tp2_pp2_checkpoint):
    """Adam's betas and eps are the resumed job's (actor.optim.betas, eps), the moments and step count the
    checkpoint's: the saved param groups' hyper-parameters were put back over the job's, so new betas or eps were
    silently ignored."""
    hf, _, ckpt = tp2_pp2_checkpoint
    config = resume_config(hf, tp=1, pp=1)
    config.actor_rollout_ref.actor.optim.betas = [0.8, 0.95]
    config.actor_rollout_ref.actor.optim.eps = 1e-3
    groups = run_ranks(_groups_after_load, 1, config, str(ckpt))[0]
    assert groups and all(g == ((0.8, 0.95), 1e-3, {1.0}) for g in groups), groups  # saved: (0.9, 0.999), 1e-5


def test_bf16_master_weights_and_adam_state_reshard_exactly(tmp_path):
    """bf16: the fp32 master copies travel too. Saved with the distributed optimizer at DP2, loaded at TP2
    (plain bf16 optimizer) and saved again: every state tensor, by HF name, is bit-identical."""
    hf = policy_model(tmp_path / "hf")
    batches = [rollout_batch(8, seed=7)] * 2

    def config(tp: int, dp: int, distributed: bool) -> Any:
        c = resume_config(hf, tp=tp, pp=1, dp=dp, distributed=distributed)
        c.actor_rollout_ref.actor.megatron.dtype = "bf16"
        return c

    first, second = tmp_path / "dp2", tmp_path / "tp2"
    run_ranks(checkpoint_rank, 2, config(1, 2, True), batches, str(first), "", "save")
    run_ranks(_resave_rank, 2, config(2, 1, False), str(first), str(second))
    (described, saved), (described_again, resaved) = _hf_state(first), _hf_state(second)
    assert described == described_again and described["step"] == 1.0
    assert described["kinds"] == {"exp_avg": "float32", "exp_avg_sq": "float32", "main_param": "float32"}
    assert saved.keys() == resaved.keys()
    assert all(torch.equal(saved[k], resaved[k]) for k in saved)
    # the masters hold more than the bf16 weights do
    weights = safetensors_state(hf)
    name = "model.layers.0.mlp.down_proj.weight"
    master = saved[("main_param", name)]
    assert not torch.equal(master, master.bfloat16().float()) and not torch.equal(master, weights[name])


def test_tp2_pp2_checkpoint_reshards_exactly_into_virtual_pipeline_chunks(tp2_pp2_checkpoint, tmp_path):
    """Loaded at PP4 x VPP2 (two model chunks per rank) and saved again: weights and every optimizer
    state tensor, by HF name, are bit-identical to the TP2 x PP2 originals."""
    from hybridrl.models.checkpoint import McoreCheckpointReader, read_hf_tensor
    from hybridrl.models.layout import hf_tensor_shapes

    hf, _, ckpt = tp2_pp2_checkpoint
    config = job_config(hf, world=4, pp=4, vpp=2)
    again = tmp_path / "pp4vpp2"
    run_ranks(_resave_rank, 4, config, str(ckpt), str(again))
    (described, saved), (described_again, resaved) = _hf_state(ckpt), _hf_state(again)
    assert described == described_again and set(described["kinds"]) == {"exp_avg", "exp_avg_sq"}
    assert saved.keys() == resaved.keys() and all(torch.equal(saved[k], resaved[k]) for k in saved)
    readers = [McoreCheckpointReader(c / "model") for c in (ckpt, again)]
    assert readers[1].layout.vpp == 2
    for name in hf_tensor_shapes(readers[0].shape):
        assert torch.equal(*(read_hf_tensor(r, r.shape, name) for r in readers)), name


def test_uneven_stage_checkpoint_reshards_exactly_both_ways(tp2_pp2_checkpoint, tmp_path):
    """TP2 x PP2 loaded at uneven PP2 (3 + 5 layers) and saved, then that loaded at PP1 and saved: the
    weights and every optimizer state tensor, by HF name, stay bit-identical; the uneven checkpoint
    records its split."""
    from hybridrl.training.checkpointing import _read_meta

    hf, _, ckpt = tp2_pp2_checkpoint
    uneven, flat = tmp_path / "uneven", tmp_path / "pp1"
    run_ranks(_resave_rank, 2, resume_config(hf, tp=1, pp=2, first_stage_layers=3), str(ckpt), str(uneven))
    run_ranks(_resave_rank, 1, resume_config(hf, tp=1, pp=1), str(uneven), str(flat))
    assert _read_meta(uneven)["layout"]["first_stage_layers"] == 3
    described, saved = _hf_state(ckpt)
    for again in (uneven, flat):
        described_again, resaved = _hf_state(again)
        assert described == described_again and saved.keys() == resaved.keys()
        assert all(torch.equal(saved[k], resaved[k]) for k in saved), again.name
