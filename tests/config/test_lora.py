"""`actor_rollout_ref.model.lora` at plan time: verl's keys read, what is not built refused naming the field, and
the plan's memory and report for a LoRA actor (grads and Adam's moments of the adapters alone, no reference model),
against hand counts."""
from __future__ import annotations

from pathlib import Path

import pytest

from hybridrl.config import ConfigError
from hybridrl.config.plan import plan_from_sources
from hybridrl.config.report import render_plan
from hybridrl.models.lora_targets import TARGETS

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "configs/examples/cpu_tiny_grpo.yaml")
MODEL = f"actor_rollout_ref.model.path={ROOT / 'configs/models/tiny-demo'}"  # its config.json: hidden 128, 4 layers
LORA = "actor_rollout_ref.model.lora"
GIB = 1024**3
CUDA = ("trainer.device=cuda", "trainer.gpu_memory_gib=80")


def _plan(*overrides: str):
    return plan_from_sources(DEMO, [MODEL, *overrides])


@pytest.mark.parametrize("overrides,field,phrase", [
    ([f"{LORA}.rank=640", f"{LORA}.alpha=640", f"{LORA}.merge=false"], f"{LORA}.rank",
     "vLLM serves adapters of rank <= 512"),
    ([f"{LORA}.rank=8", f"{LORA}.type=canonical_lora", f"{LORA}.target_modules=[linear_qkv]"],
     f"{LORA}.target_modules", "is not a known canonical_lora target"),
    ([f"{LORA}.rank=8", f"{LORA}.target_modules=[*.layers.0.*.linear_qkv]"], f"{LORA}.target_modules",
     "per-layer patterns are not supported"),
    ([f"{LORA}.rank=8", f"{LORA}.target_modules=all-linear"], f"{LORA}.target_modules",
     "is peft's every linear layer; here that is every target of the type: leave target_modules empty"),
    ([f"{LORA}.rank=8", f"{LORA}.target_modules=[linear_qkv]", f"{LORA}.exclude_modules=[linear_fc2]"],
     f"{LORA}.exclude_modules", "needs target_modules empty"),
    ([f"{LORA}.rank=8", f"{LORA}.dropout_position=post"], f"{LORA}.dropout_position", "post) is not built"),
    ([f"{LORA}.rank=8", f"{LORA}.dtype=bf16"], f"{LORA}.dtype", "adapters train in fp32"),
    ([f"{LORA}.rank=8", f"{LORA}.alpha=0"], f"{LORA}.alpha", "must be in (0"),
    ([f"{LORA}.rank=8", *CUDA, "actor_rollout_ref.model.use_remove_padding=true"],
     "actor_rollout_ref.model.use_remove_padding", "attention takes no packed sequences"),
    ([f"{LORA}.rank=8", "actor_rollout_ref.actor.use_kl_loss=true",
      "actor_rollout_ref.ref.megatron.param_offload=true"],
     "actor_rollout_ref.ref.megatron.param_offload", "no weights of its own to offload"),
    (["critic.model.lora.rank=8"], "critic.model.lora.rank", "LoRA adapts the actor only"),
    ([f"{LORA}.rank=8", "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.ref.megatron.dtype=bf16"],
     "actor_rollout_ref.ref.megatron.dtype", "the reference is the actor's own model with the adapters off"),
    ([f"{LORA}.rank=-1"], f"{LORA}.rank", "must be an integer >= 0"),
])
def test_what_is_not_built_is_refused_naming_the_field(overrides, field, phrase):
    with pytest.raises(ConfigError) as refused:
        _plan(*overrides)
    assert any(issue.field == field and phrase in str(issue) for issue in refused.value.issues), refused.value


MOE = f"actor_rollout_ref.model.path={ROOT / 'configs/models/tiny-demo-moe'}"


QWEN3_30B = f"actor_rollout_ref.model.path={ROOT / 'configs/models/qwen3-30b-a3b'}"  # 48 MoE layers, 128 experts


@pytest.mark.parametrize("ep", [1, 2])
def test_an_moe_models_experts_take_adapters_counted_per_rank(ep):
    """Qwen3-30B-A3B at rank 8 (type lora): hidden 2,048, q rows 32 x 128, kv rows 4 x 128, 128 experts of FFN 768.
    Per layer: qkv A 8 x 2,048 + B 5,120 x 8, proj A 8 x 4,096 + B 2,048 x 8; each expert fc1 A 8 x 2,048 + B 1,536
    x 8 (gate and up), fc2 A 8 x 768 + B 2,048 x 8; a rank holds 128 / EP experts' of each of the 48 layers."""
    attention = 8 * 2048 + 5120 * 8 + 8 * 4096 + 2048 * 8
    expert = 8 * 2048 + 1536 * 8 + 8 * 768 + 2048 * 8
    overrides = [QWEN3_30B, f"{LORA}.rank=8", f"actor_rollout_ref.actor.megatron.expert_model_parallel_size={ep}"]
    plan = plan_from_sources(DEMO, overrides)
    actor = next(m for m in plan.training_memory if m.role == "actor")
    assert actor.grads_gib == pytest.approx(48 * (attention + 128 // ep * expert) * 4 / GIB, abs=5e-4)
    assert actor.optimizer_gib == pytest.approx(2 * actor.grads_gib, abs=1e-3)
    assert f"the fp32 adapters train ({48 * (attention + 128 * expert):,} parameters" in render_plan(plan)


@pytest.mark.parametrize("tp,etp", [(2, None), (1, 2), (2, 1)])
def test_expert_adapters_split_over_expert_tp_are_counted_per_rank(tp, etp):
    """Qwen3-30B-A3B at rank 8 (type lora) with each expert split over expert TP (None: TP, megatron's default), as
    its weights are: an expert's fc1 A 8 x 2,048 whole on each expert TP rank and B 1,536 / ETP x 8 (its rows of gate
    and up), fc2 A 8 x 768 / ETP (its input columns) and B 2,048 x 8 whole; the attention's split over TP as
    always (qkv B 5,120 / TP x 8, proj A 8 x 4,096 / TP); all 128 experts' on each rank (EP 1), 48 layers."""
    expert_tp = tp if etp is None else etp
    attention = 8 * 2048 + 5120 * 8 // tp + 8 * 4096 // tp + 2048 * 8
    expert = 8 * 2048 + 1536 * 8 // expert_tp + 8 * 768 // expert_tp + 2048 * 8
    overrides = [QWEN3_30B, f"{LORA}.rank=8", f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={tp}",
                 f"actor_rollout_ref.actor.megatron.sequence_parallel={str(tp > 1).lower()}"]
    if etp is not None:
        overrides.append(f"actor_rollout_ref.actor.megatron.expert_tensor_parallel_size={etp}")
    plan = plan_from_sources(DEMO, overrides)
    actor = next(m for m in plan.training_memory if m.role == "actor")
    assert actor.grads_gib == pytest.approx(48 * (attention + 128 * expert) * 4 / GIB, abs=5e-4)
    assert actor.optimizer_gib == pytest.approx(2 * actor.grads_gib, abs=2e-3)  # both rounded to 1e-3
    whole = 48 * (8 * 2048 + 5120 * 8 + 8 * 4096 + 2048 * 8 + 128 * (8 * 2048 + 1536 * 8 + 8 * 768 + 2048 * 8))
    assert f"the fp32 adapters train ({whole:,} parameters" in render_plan(plan)


@pytest.mark.parametrize("overrides,field,phrase", [
    ([f"{LORA}.type=canonical_lora", f"{LORA}.target_modules=[linear_fc1_gate]"], f"{LORA}.type",
     "gate and up share an A"),
    ([f"{LORA}.dropout=0.1"], f"{LORA}.dropout", "take no dropout"),
    ([f"{LORA}.merge=false"], f"{LORA}.merge", "vLLM serving adapters on experts is not built"),
])
def test_what_is_not_built_for_expert_adapters_is_refused(overrides, field, phrase):
    with pytest.raises(ConfigError) as refused:
        plan_from_sources(DEMO, [MOE, f"{LORA}.rank=8", *overrides])
    assert any(issue.field == field and phrase in str(issue) for issue in refused.value.issues), refused.value


def test_a_dense_mlp_among_moe_layers_is_warned_of_for_the_peft_folder(tmp_path):
    """peft 0.21 drops a dense MLP layer's adapters among MoE layers when it loads a PEFT folder onto transformers 5
    (tests/models/test_lora_moe.py's fixture keeps every layer MoE for that reason): the plan says so."""
    import json

    config = json.loads((ROOT / "configs/models/tiny-demo-moe/config.json").read_text())
    config["mlp_only_layers"] = [2]
    (tmp_path / "config.json").write_text(json.dumps(config))
    warned = [w for w in plan_from_sources(DEMO, [f"actor_rollout_ref.model.path={tmp_path}",
                                                  f"{LORA}.rank=8"]).warnings if "dense MLPs among MoE" in w]
    assert warned and "layers [2]" in warned[0]
    assert not [w for w in plan_from_sources(DEMO, [MOE, f"{LORA}.rank=8"]).warnings if "dense MLPs" in w]


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_expert_adapters_plan_at_tp2_with_each_expert_whole(distributed_optimizer):
    plan = plan_from_sources(DEMO, [MOE, f"{LORA}.rank=8",
                                    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                                    "actor_rollout_ref.actor.megatron.sequence_parallel=true",
                                    "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1",
                                    f"actor_rollout_ref.actor.megatron.use_distributed_optimizer="
                                    f"{str(distributed_optimizer).lower()}"])
    assert plan.resolved.lora_rank == 8
    assert plan.layout("actor").megatron.use_distributed_optimizer is distributed_optimizer


def test_expert_adapters_plan_at_ep2_with_the_distributed_optimizer():
    """Its expert shards are gathered over the expert data-parallel group at a save (tests/training/test_lora.py)."""
    plan = plan_from_sources(DEMO, [MOE, f"{LORA}.rank=8",
                                    "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
                                    "actor_rollout_ref.actor.megatron.use_distributed_optimizer=true"])
    assert plan.resolved.lora_rank == 8 and plan.layout("actor").megatron.use_distributed_optimizer


def test_adapters_on_the_attention_alone_take_any_moe_setting():
    plan = plan_from_sources(DEMO, [MOE, f"{LORA}.rank=8", f"{LORA}.merge=false", f"{LORA}.dropout=0.1",
                                    f"{LORA}.target_modules=[linear_qkv,linear_proj]"])
    assert plan.resolved.serves_adapters


QWEN = f"actor_rollout_ref.model.path={ROOT / 'configs/models/qwen2.5-0.5b'}"  # hidden 896, 24 layers, ffn 4864


@pytest.mark.parametrize("tp,per_layer", [
    # rank 128, fused (type lora), every layer kind; hidden 896, q rows 14 x 64, kv rows 2 x 64, ffn 4864:
    # qkv A 128x896 + B 1152x128; proj A 128x896 + B 896x128; fc1 A 128x896 + B 9728x128; fc2 A 128x4864 + B 896x128
    (1, 128 * 896 + 1152 * 128 + 128 * 896 + 896 * 128 + 128 * 896 + 9728 * 128 + 128 * 4864 + 896 * 128),
    # TP2: the column layers' B halves (qkv, fc1), the row layers' A halves (proj, fc2)
    (2, 128 * 896 + 576 * 128 + 64 * 896 + 896 * 128 + 128 * 896 + 4864 * 128 + 64 * 4864 + 896 * 128),
])
def test_the_plan_counts_the_adapters_and_no_reference_model(tp, per_layer):
    overrides = [f"{LORA}.rank=128", f"{LORA}.alpha=256", "actor_rollout_ref.actor.use_kl_loss=true",
                 f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={tp}"]
    plan = plan_from_sources(DEMO, [QWEN, *overrides])
    full = plan_from_sources(DEMO, [QWEN, *overrides[2:]])
    actor = next(m for m in plan.training_memory if m.role == "actor")
    whole = next(m for m in full.training_memory if m.role == "actor")
    adapters = 24 * per_layer  # one stage
    assert actor.grads_gib == pytest.approx(adapters * 4 / GIB, abs=5e-4) and actor.grads_gib > 0.1
    assert actor.optimizer_gib == pytest.approx(adapters * 8 / GIB, abs=5e-4) and actor.master_params_gib == 0
    assert actor.params_gib == pytest.approx(whole.params_gib + adapters * 4 / GIB, abs=1e-3)
    assert whole.grads_gib > 3 * actor.grads_gib  # the whole model's gradients
    assert [m.role for m in plan.training_memory] == ["actor"]  # the reference is the actor's own base
    assert [m.role for m in full.training_memory] == ["actor", "ref"]
    report = render_plan(plan)
    whole_adapters = 24 * (128 * 896 + 1152 * 128 + 128 * 896 + 896 * 128 + 128 * 896 + 9728 * 128 + 128 * 4864
                           + 896 * 128)
    assert (f"LoRA (lora, rank 128, alpha 256) on linear_qkv, linear_proj, linear_fc1, linear_fc2: the model frozen, "
            f"the fp32 adapters train ({whole_adapters:,} parameters") in report, report
    assert "the reference is the base with the adapters off" in report


def test_the_type_alone_adapts_every_layer_kind_of_that_type():
    """target_modules unset means every target of lora.type: `type: canonical_lora` alone plans with its seven
    per-projection adapters (not lora's fused names, which it would refuse), and exclude_modules alone adapts the
    rest; counted by hand on the tiny demo (hidden 128, 4 query heads and 2 kv heads of 32, ffn 256, 4 layers)."""
    q, kv, hidden, ffn, rank = 128, 64, 128, 256, 8
    canonical = rank * (hidden + q) + 2 * rank * (hidden + kv) + rank * (q + hidden) \
        + 2 * rank * (hidden + ffn) + rank * (ffn + hidden)  # q, k, v, proj, gate, up, fc2: each its own A and B
    plan = _plan(f"{LORA}.rank={rank}", f"{LORA}.type=canonical_lora")
    report = render_plan(plan)
    assert ("LoRA (canonical_lora, rank 8, alpha 32) on linear_q, linear_k, linear_v, linear_proj, linear_fc1_gate, "
            f"linear_fc1_up, linear_fc2: the model frozen, the fp32 adapters train ({4 * canonical:,} parameters") \
        in report, report
    fused_without_fc2 = rank * (hidden + q + 2 * kv) + rank * (q + hidden) + rank * (hidden + 2 * ffn)
    report = render_plan(_plan(f"{LORA}.rank={rank}", f"{LORA}.exclude_modules=[linear_fc2]"))
    assert ("LoRA (lora, rank 8, alpha 32) on linear_qkv, linear_proj, linear_fc1: the model frozen, the fp32 "
            f"adapters train ({4 * fused_without_fc2:,} parameters") in report, report


def test_a_merged_sync_in_fp32_gets_its_own_probe_tolerance():
    """Merging rounds (W + s B A) once where the trainer computes W x + s B (A x): a correct fp32 run at a high
    learning rate gapped 1.5e-4 (over the 1e-4 default) after 16 steps; with adapters the fp32 default is 1e-2,
    still far under a wrong layout's >= 1.4. An explicit rollout.probe_tolerance stays the user's."""
    assert _plan(f"{LORA}.rank=8").resolved.probe_tolerance == 1e-2
    assert _plan().resolved.probe_tolerance == 1e-4
    assert _plan(f"{LORA}.rank=8", "actor_rollout_ref.rollout.probe_tolerance=1e-3").resolved.probe_tolerance == 1e-3
    # adapters served by vLLM (merge false) are computed as the trainer does, W x + s B (A x): the fp32 default
    served = _plan(f"{LORA}.rank=8", f"{LORA}.merge=false").resolved
    assert served.probe_tolerance == 1e-4 and served.serves_adapters and served.lora_rank == 8
    assert not _plan(f"{LORA}.rank=8").resolved.serves_adapters
    assert not _plan(f"{LORA}.merge=false").resolved.serves_adapters  # no adapters: nothing to serve
    # and with a disaggregated rollout: the base crosses the pools once, then the adapter alone
    apart = _plan(f"{LORA}.rank=8", f"{LORA}.merge=false", "actor_rollout_ref.rollout.mode=disaggregated",
                  "actor_rollout_ref.rollout.n_gpus_per_node=1", "trainer.n_gpus_per_node=1").resolved
    assert apart.serves_adapters and apart.disaggregated


def test_the_performance_table_is_the_bench_result_file():
    import json

    runs = json.loads((ROOT / "bench/results/lora.json").read_text())["runs"]
    longer = json.loads((ROOT / "bench/results/lora_long.json").read_text())
    assert longer["steps"] == 40 and sorted(longer["runs"]) == ["full", "lora_lr_0.0003"]
    doc = (ROOT / "docs/performance.md").read_text()
    for run in [*runs.values(), *longer["runs"].values()]:
        cells = [f"{run['val_before']:.3f}", f"{run['val_after']:.3f}", f"{run['reward_first_3']:.3f}",
                 f"{run['reward_last_3']:.3f}", f"{run['median_step_s']:.2f}",
                 f"{100 * run['phase_share']['update_actor']:.0f} %", f"{run['update_after_allocated_gib']:.2f}",
                 f"{run['max_probe_gap']:.1e}"]
        assert " | " + " | ".join(cells) + " |" in doc, cells
    for name in ("lora_lr_0.0003", "lora_served_lr_0.0003"):  # merged against served: the second table
        run = runs[name]
        cells = [f"{run['median_gen_s']:.2f}", f"{run['median_sync_s']:.2f}",
                 f"{run['sync_bytes_per_rank'] / 1e6:.1f} MB"]
        assert " | " + " | ".join(cells) in doc, cells


def test_the_adapter_folder_is_checked_at_plan(tmp_path):
    """`adapter_path` (what `train` reads): a PEFT folder whose rank and alpha are the config's, before any process."""
    import json

    folder = tmp_path / "adapter"
    folder.mkdir()
    with pytest.raises(ConfigError) as refused:
        plan_from_sources(DEMO, [MODEL, f"{LORA}.rank=8", f"{LORA}.adapter_path={folder}"], check_files=True)
    assert any(i.field == f"{LORA}.adapter_path" and "lacks adapter_config.json, adapter_model.safetensors"
               in str(i) for i in refused.value.issues), refused.value
    (folder / "adapter_config.json").write_text(json.dumps({"r": 16, "lora_alpha": 32}))
    (folder / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError) as refused:
        plan_from_sources(DEMO, [MODEL, f"{LORA}.rank=8", f"{LORA}.alpha=32", f"{LORA}.adapter_path={folder}"],
                          check_files=True)
    mine = [i for i in refused.value.issues if i.field.startswith(LORA)]
    assert [(i.field, i.valid) for i in mine] == [(f"{LORA}.rank", (16,)), (f"{LORA}.adapter_path", ())], mine
    assert "adapter_model.safetensors, which is not a readable safetensors file" in mine[1].rule  # 0 bytes


def test_adapters_on_cuda_train_padded_on_the_local_spec():
    """On a GPU a LoRA actor is built on megatron's local layer spec (TransformerEngine's fuses the norm into the
    adapted linear layers): its micro-batches resolve padded (the plan says why); its attention is PyTorch's fused
    kernel there (`parallel.sdpa_attention`), which holds no scores, so its activations are the whole model's.
    Qwen2.5-0.5B at TP2."""
    overrides = [QWEN, *CUDA, "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                 "actor_rollout_ref.model.enable_gradient_checkpointing=false"]
    lora = plan_from_sources(DEMO, [*overrides, f"{LORA}.rank=8"])
    full = plan_from_sources(DEMO, overrides)
    assert full.resolved.packed("actor") and not lora.resolved.packed("actor")
    assert ("actor padded (actor_rollout_ref.model.use_remove_padding default on cuda, off: LoRA adapters build "
            "the actor on megatron's local layer spec, whose attention takes no packed sequences)") in render_plan(lora)
    actor, whole = (next(m for m in p.training_memory if m.role == "actor") for p in (lora, full))
    assert actor.activations_gib_per_micro_batch == whole.activations_gib_per_micro_batch > 0

def test_adapters_on_cuda_keep_sequence_parallelism():
    """The adapters' local spec serves sequence parallelism on a GPU too (its torch norms tagged as TE's:
    `sequence_parallel_norm`): the 7B example with adapters plans with it, its activations a TP-th of what they are
    without (2 GiB less at TP2 here, the attention scores aside)."""
    example = str(ROOT / "configs/examples/qwen2.5_7b_grpo_8gpu.yaml")
    lora = [f"{LORA}.rank=32", f"{LORA}.alpha=64"]
    with_sp, without = (plan_from_sources(example, [*lora, f"actor_rollout_ref.actor.megatron.sequence_parallel={sp}"])
                        for sp in ("true", "false"))
    split, whole = (next(m for m in p.training_memory if m.role == "actor") for p in (with_sp, without))
    assert with_sp.layout("actor").megatron.sequence_parallel_in_effect
    assert split.activations_gib_in_flight < whole.activations_gib_in_flight - 1


HF_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CANONICAL = f"{LORA}.target_modules=[linear_q,linear_k,linear_v,linear_proj,linear_fc1_gate,linear_fc1_up,linear_fc2]"


@pytest.fixture(scope="module")
def peft_folders(tmp_path_factory):
    """Adapter folders peft itself saves for the tiny model's shape (configs/models/tiny-demo), as a peft user brings
    them: peft's defaults (an A per projection), on q and v alone, and with rsLoRA, DoRA or a rank per module."""
    import peft
    import torch
    import transformers

    root = tmp_path_factory.mktemp("peft")
    config = transformers.AutoConfig.from_pretrained(ROOT / "configs/models/tiny-demo")
    out = {}
    for name, settings in {"peft": {}, "qv": {"target_modules": ["q_proj", "v_proj"]}, "rslora": {"use_rslora": True},
                           "dora": {"use_dora": True}, "pattern": {"rank_pattern": {"q_proj": 4}}}.items():
        torch.manual_seed(0)
        model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_config(config),
                                    peft.LoraConfig(**{"r": 8, "lora_alpha": 16, "target_modules": HF_PROJECTIONS,
                                                       **settings}))
        model.save_pretrained(root / name)
        out[name] = root / name
    return out


@pytest.mark.parametrize("folder,overrides,field,phrases,valid", [
    # peft's adapters hold an A per projection: a fused (type lora) adapter would have to drop two of q, k, v's
    ("peft", [], f"{LORA}.type", ["holds an A per projection", "q_proj, k_proj, v_proj differ in layer 0"],
     ("canonical_lora",)),
    ("qv", [f"{LORA}.type=canonical_lora", CANONICAL], f"{LORA}.adapter_path",
     ["lacks 40 tensor(s)", "layers.0.self_attn.k_proj.lora_A.weight", "the folder's adapters are on q_proj, v_proj"],
     ("linear_q", "linear_v")),
    # one more target in the folder than the config adapts: dropped silently before
    ("peft", [f"{LORA}.type=canonical_lora", f"{LORA}.target_modules=[linear_q,linear_k,linear_v]"],
     f"{LORA}.adapter_path", ["holds 32 tensor(s) they do not load, which would be dropped", "mlp.down_proj.lora_A"],
     tuple(TARGETS["canonical_lora"])),
    ("rslora", [f"{LORA}.type=canonical_lora", CANONICAL], f"{LORA}.adapter_path",
     ["use_rslora=True", "lora_alpha / sqrt(r)"], None),
    ("dora", [f"{LORA}.type=canonical_lora", CANONICAL], f"{LORA}.adapter_path", ["use_dora=True"], None),
    ("dora", [f"{LORA}.type=canonical_lora", CANONICAL], f"{LORA}.adapter_path",
     ["which would be dropped", "lora_magnitude_vector"], None),
    ("pattern", [f"{LORA}.type=canonical_lora", CANONICAL], f"{LORA}.adapter_path",
     ["layers.0.self_attn.q_proj.lora_A.weight [4, 128] (expected [8, 128])"], None),
])
def test_a_peft_folder_is_refused_unless_it_is_the_adapters_the_config_builds(peft_folders, folder, overrides, field,
                                                                              phrases, valid):
    """`adapter_path` from peft: what `train` would load it as, checked at plan against the folder's own tensors and
    adapter_config.json; before, these planned and then stopped the workers (a missing tensor, a fused A), or loaded
    as another adapter silently (rsLoRA's scaling, DoRA's magnitudes, extra targets dropped)."""
    with pytest.raises(ConfigError) as refused:
        plan_from_sources(DEMO, [MODEL, f"{LORA}.rank=8", f"{LORA}.alpha=16",
                                 f"{LORA}.adapter_path={peft_folders[folder]}", *overrides], check_files=True)
    mine = [i for i in refused.value.issues if i.field == field and all(p in str(i) for p in phrases)]
    assert mine, refused.value
    if valid is not None:
        assert mine[0].valid == valid


@pytest.mark.parametrize("folder,overrides", [("peft", [CANONICAL]),
                                              ("qv", [f"{LORA}.target_modules=[linear_q,linear_v]"])])
def test_a_peft_folder_the_config_matches_plans(peft_folders, folder, overrides):
    """peft's own folder with canonical_lora and its targets: no problem about the adapters (the model folder here
    holds a config.json alone, which is refused for itself)."""
    with pytest.raises(ConfigError) as refused:
        plan_from_sources(DEMO, [MODEL, f"{LORA}.rank=8", f"{LORA}.alpha=16", f"{LORA}.type=canonical_lora",
                                 f"{LORA}.adapter_path={peft_folders[folder]}", *overrides], check_files=True)
    assert not [i for i in refused.value.issues if i.field.startswith(LORA)], refused.value
