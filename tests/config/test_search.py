"""`hybridrl plan --search` (`config.search`): every layout of a job's cluster planned as `hybridrl plan` plans it,
ranked by the predicted step time.

The references are independent of the search's own code path: each layout it prints is planned again from the
YAML file and its printed overrides through the loader (`plan_from_sources`), and a brute force written here
enumerates the colocated layouts with overrides of its own and plans each with every memory saver.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from hybridrl.config import ConfigError, plan_from_sources
from hybridrl.config.hardware import SHIPPED, load_job_hardware
from hybridrl.config.report import render_search
from hybridrl.config.search import SAVERS, Layout, search_from_sources, search_inputs, size_cluster
from hybridrl.config.step_time import predict_step_time

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "configs/examples"
QWEN_7B = str(EXAMPLES / "qwen2.5_7b_grpo_8gpu.yaml")
SEED_6GPU = str(EXAMPLES / "seed_6gpu_grpo.yaml")
LLAMA_70B = str(EXAMPLES / "llama3_70b_ppo_16x8.yaml")
H100 = SHIPPED["h100-sxm"]


def _replanned(config: str, overrides: list[str]):
    plan = plan_from_sources(config, [*overrides, "trainer.hardware=h100-sxm"])
    return plan, predict_step_time(plan, H100)


def test_each_printed_layout_is_a_job_that_plans_to_the_predicted_time_and_the_best_beats_the_written_one():
    result = search_from_sources(QWEN_7B, ["trainer.hardware=h100-sxm"])
    assert result.total_gpus == 8 and result.layouts >= 500 and len(result.ranked) > 10
    times = [found.step.seconds for found in result.ranked]
    assert times == sorted(times)
    for found in result.ranked[:3] + result.ranked[-2:]:
        plan, step = _replanned(QWEN_7B, found.overrides())
        assert step.seconds == pytest.approx(found.step.seconds, rel=1e-12)
        assert plan.gpu_memory.peak_gib == found.peak_gib and plan.gpu_memory.fits
        # the cluster stays the job's: 8 GPUs between the trainer and a rollout pool of its own
        assert plan.resolved.world_size + plan.resolved.rollout_world * plan.resolved.disaggregated == 8
    written = result.written
    assert written is not None and written.changes == ()
    assert written.step.seconds == pytest.approx(predict_step_time(plan_from_sources(QWEN_7B), H100).seconds)
    assert result.ranked[0].step.seconds <= written.step.seconds
    # the written layout (actor TP2, vLLM TP2, both offloads, recompute) is among those searched, with the saver
    # the search would pick for it: the first that fits of none, grads, grads + moments, recompute ...
    assert any(found.layout == Layout(2, 1, 2, 0, "sync") for found in result.ranked)


@pytest.mark.parametrize(("model", "pps"), [
    ("configs/models/qwen2.5-0.5b", (1, 2, 3, 4, 6, 8, 12)),  # the divisors of Qwen2.5-0.5B's 24 layers up to 16
    # Llama-3.1-8B's 32 layers on the 6 GPUs: some layouts need savers, some fit with none of them (the search
    # plans those two savers, not six)
    ("configs/models/llama3.1-8b", (1, 2, 4, 8, 16)),
])
def test_the_colocated_layouts_and_their_savers_equal_a_brute_force_through_the_loader(model, pps):
    """Every (actor TP, PP, vLLM TP) of the 6-GPU seed example, colocated, planned here from overrides written by
    this test with each memory saver in the documented order; the first that fits is the search's choice."""
    # (grad_offload, optimizer_offload, recompute), least time lost first, as docs/user-guide.md says
    order = ((False, False, False), (True, False, False), (True, True, False), (False, False, True),
             (True, False, True), (True, True, True))
    assert SAVERS == order
    arr = "actor_rollout_ref"
    result = search_from_sources(SEED_6GPU, ["trainer.hardware=h100-sxm", f"{arr}.model.path={model}"])
    searched = {(f.layout.train_tp, f.layout.train_pp, f.layout.rollout_tp): (f.savers, f.step.seconds)
                for f in result.ranked if f.layout.rollout_gpus == 0}
    expected = {}
    for tp in (1, 2, 4):
        for pp in pps:
            for rollout_tp in (1, 2, 4):
                for grads, moments, recompute in order:
                    overrides = [f"{arr}.model.path={model}", f"{arr}.actor.megatron.tensor_model_parallel_size={tp}",
                                 f"{arr}.actor.megatron.pipeline_model_parallel_size={pp}",
                                 f"{arr}.rollout.tensor_model_parallel_size={rollout_tp}",
                                 f"{arr}.actor.megatron.grad_offload={str(grads).lower()}",
                                 f"{arr}.actor.megatron.optimizer_offload={str(moments).lower()}",
                                 f"{arr}.model.enable_gradient_checkpointing={str(recompute).lower()}",
                                 # sequence parallelism wherever TP > 1 on GPUs, as documented
                                 f"{arr}.actor.megatron.sequence_parallel={str(tp > 1).lower()}"]
                    try:
                        _, step = _replanned(SEED_6GPU, overrides)
                    except ConfigError as exc:
                        if exc.issues[0].field == "trainer.gpu_memory_gib":
                            continue  # does not fit: the next saver
                        break  # a rule: no saver changes it
                    expected[(tp, pp, rollout_tp)] = ((grads, moments, recompute), step.seconds)
                    break
    assert searched.keys() == expected.keys() and len(expected) >= 5
    if "llama" in model:  # the case this model is here for: savers chosen, and layouts no saver fits
        assert any(savers != order[0] for savers, _ in expected.values())
        assert dict(result.refused)["trainer.gpu_memory_gib"] > 0
    for key, (savers, seconds) in expected.items():
        assert searched[key][0] == savers and searched[key][1] == pytest.approx(seconds, rel=1e-12), key


def test_memory_decides_the_savers_and_a_rollout_pool_keeps_the_clusters_gpus():
    """Llama-3-70B PPO on 16 x 8 H100s: a layout's memory saver is the first that fits (the one before it does not),
    and a disaggregated layout splits the 128 GPUs between the trainer's machines and the rollout pool's."""
    result = search_from_sources(LLAMA_70B, ["trainer.hardware=h100-sxm"])
    # counted by hand: training TP 1-8 (4) x PP dividing 80 layers up to 16 (1, 2, 4, 5, 8, 10, 16) x vLLM TP 1-8 (4)
    # x placements: colocated, or a rollout pool of 1/8 .. 7/8 of the 16 machines, in turn or one step ahead
    assert result.total_gpus == 128 and result.layouts == 4 * 7 * 4 * (1 + 7 * 2) == 1680
    saved = [found for found in result.ranked if any(found.savers)]
    assert saved, "some layouts of a 70B model need offload or recompute on 80 GB"
    for found in saved[:3]:
        before = SAVERS[SAVERS.index(found.savers) - 1]
        changes = dict(found.changes)
        arr = "actor_rollout_ref"
        tighter = [f"{path}={str(value).lower() if isinstance(value, bool) else 'null' if value is None else value}"
                   for path, value in {**changes, f"{arr}.actor.megatron.grad_offload": before[0],
                                       "critic.megatron.grad_offload": before[0],
                                       f"{arr}.actor.megatron.optimizer_offload": before[1],
                                       "critic.megatron.optimizer_offload": before[1],
                                       f"{arr}.model.enable_gradient_checkpointing": before[2],
                                       "critic.model.enable_gradient_checkpointing": before[2]}.items()]
        with pytest.raises(ConfigError) as info:
            plan_from_sources(LLAMA_70B, tighter)
        assert info.value.issues[0].field == "trainer.gpu_memory_gib"
    pools = [found for found in result.ranked if found.layout.rollout_gpus]
    assert pools and {found.layout.rollout_gpus for found in pools} <= {2 * 8 * k for k in range(1, 8)}
    for found in pools[:2]:
        plan, step = _replanned(LLAMA_70B, found.overrides())
        assert plan.resolved.world_size + plan.resolved.rollout_world == 128
        assert plan.resolved.rollout_world == found.layout.rollout_gpus
        assert step.overlapped == (found.layout.async_mode != "sync")


def test_a_job_whose_own_layout_is_refused_is_still_searched():
    # actor TP 3 divides neither the heads nor the world: `hybridrl plan` refuses the job; the search replaces it
    overrides = ["trainer.hardware=h100-sxm", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3"]
    with pytest.raises(ConfigError):
        plan_from_sources(QWEN_7B, overrides)
    result = search_from_sources(QWEN_7B, overrides)
    assert result.written is None and result.ranked
    # the report says so (it said nothing of the job as written)
    text = render_search(result, QWEN_7B, overrides)
    assert "the job as written does not plan (`hybridrl plan --layout-only` of it says why)" in text


def test_the_cli_prints_the_ranking_and_refuses_a_search_without_hardware():
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "hybridrl.cli", "plan", *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)

    result = cli(SEED_6GPU, "--search", "--top", "3", "trainer.hardware=h200")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("hybridrl plan --search on h200: 6 GPUs;")
    assert sum(line.startswith("#") and " s " in line for line in lines) >= 3
    job = next(line for line in lines if line.startswith("#1 as a job: hybridrl plan "))
    top = search_from_sources(SEED_6GPU, ["trainer.hardware=h200"]).ranked[0]
    assert job.endswith(" ".join(top.overrides()))
    as_json = json.loads(cli(SEED_6GPU, "--search", "--format", "json", "trainer.hardware=h200").stdout)
    assert as_json["ranked"][0]["step"]["phases"][0]["phase"] == "gen"
    refused = cli(SEED_6GPU, "--search")
    assert refused.returncode == 2 and "trainer.hardware=None is needed by --search" in refused.stderr
    assert "Traceback" not in refused.stderr
    no_rows = cli(SEED_6GPU, "--search", "--top", "0", "trainer.hardware=h200")
    assert no_rows.returncode == 2 and "--top=0 needs --search and a number of layouts >= 1" in no_rows.stderr
    unsearched = cli(SEED_6GPU, "--top", "3", "trainer.hardware=h200")  # a --top that would print nothing
    assert unsearched.returncode == 2 and "--top=3 needs --search" in unsearched.stderr


def test_a_users_uneven_pipeline_split_stays_at_their_pp_only():
    """The seed example at PP4 with 3 layers on the first stage (24 = 3 + 7 x 3): other PPs are searched with the even
    split (the user's first-stage count would refuse most of them), PP4 with the user's."""
    arr = "actor_rollout_ref.actor.megatron"
    uneven = search_from_sources(SEED_6GPU, ["trainer.hardware=h100-sxm", f"{arr}.pipeline_model_parallel_size=4",
                                             f"{arr}.num_layers_in_first_pipeline_stage=3"])
    even = search_from_sources(SEED_6GPU, ["trainer.hardware=h100-sxm"])

    def planned(result, pp_four: bool) -> set[Layout]:
        return {found.layout for found in result.ranked if (found.layout.train_pp == 4) == pp_four}

    assert planned(uneven, False) == planned(even, False) and planned(uneven, False)
    for found in uneven.ranked:
        plan, _ = _replanned(SEED_6GPU, [f"{arr}.pipeline_model_parallel_size=4",
                                         f"{arr}.num_layers_in_first_pipeline_stage=3", *found.overrides()])
        layers = plan.layout("actor").mesh.layout().stage_layers(24)
        assert layers[0] == (3 if found.layout.train_pp == 4 else 24 // found.layout.train_pp)


def test_the_smallest_cluster_for_a_step_time_is_the_first_size_whose_best_meets_it():
    """Qwen2.5-7B GRPO, 60 s a step on H100s: part of a machine (1, 2, 4 GPUs), then 1, 2, 4 machines; the search on
    each size is the plain search of the job resized, and the first whose best meets 60 s is the answer, printed as
    overrides of the job as written (its size included)."""
    inputs = search_inputs(QWEN_7B, ["trainer.hardware=h100-sxm"])
    sizing = size_cluster(inputs, 60.0)
    assert [r.total_gpus for r in sizing.results] == [1, 2, 4, 8, 16, 32]
    bests = [r.ranked[0].step.seconds if r.ranked else None for r in sizing.results]
    assert all(best is None or best > 60.0 for best in bests[:-1]) and bests[-1] <= 60.0
    assert sizing.smallest is sizing.results[-1]
    # each size's search equals the plain search of the job with that size written in
    alone = search_from_sources(QWEN_7B, ["trainer.hardware=h100-sxm", "trainer.nnodes=2"])
    assert alone.ranked[0].step.seconds == pytest.approx(bests[4], rel=1e-12)
    plan, step = _replanned(QWEN_7B, sizing.smallest.ranked[0].overrides())
    assert plan.resolved.world_size + plan.resolved.rollout_world * plan.resolved.disaggregated == 32
    assert step.seconds == pytest.approx(bests[-1], rel=1e-12)
    # beyond every size tried: the sizing says none meets it, and the command exits 1 (an answer, not a success)
    assert size_cluster(inputs, 1.0).smallest is None
    unmet = subprocess.run([sys.executable, "-m", "hybridrl.cli", "plan", QWEN_7B, "--search", "--target-step-time",
                            "1", "trainer.hardware=h100-sxm"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert unmet.returncode == 1 and "1 s" in unmet.stdout, unmet.stdout[-2000:] + unmet.stderr[-2000:]
    refused = subprocess.run([sys.executable, "-m", "hybridrl.cli", "plan", QWEN_7B, "--target-step-time", "60",
                              "trainer.hardware=h100-sxm"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--target-step-time=60.0 needs --search" in refused.stderr


def test_a_fully_async_job_is_searched_keeping_its_staleness_settings_where_they_apply():
    """A fully_async job's max_staleness / stale_samples / partial_rollout stay on its fully_async layouts and are
    cleared on the others (the validator refuses them there); each layout replans with its printed overrides."""
    arr = "actor_rollout_ref.rollout"
    overrides = ["trainer.hardware=h100-sxm", "trainer.n_gpus_per_node=4", f"{arr}.mode=disaggregated",
                 f"{arr}.n_gpus_per_node=4", f"{arr}.async_mode=fully_async", f"{arr}.max_staleness=2",
                 f"{arr}.stale_samples=keep", f"{arr}.partial_rollout=false"]
    result = search_from_sources(QWEN_7B, overrides)
    modes = {found.layout.async_mode for found in result.ranked}
    assert modes == {"sync", "fully_async"}, modes
    for mode in modes:
        found = next(f for f in result.ranked if f.layout.async_mode == mode)
        plan, step = _replanned(QWEN_7B, [*overrides, *found.overrides()])
        rollout = plan.config.actor_rollout_ref.rollout
        kept = mode == "fully_async"
        assert (rollout.max_staleness, rollout.stale_samples, rollout.partial_rollout) == \
            ((2, "keep", False) if kept else (None, None, None))
        assert step.seconds == pytest.approx(found.step.seconds, rel=1e-12)


def _pasted(line: str, prefix: str):
    """The job a printed command line is, planned as `hybridrl plan` plans it when pasted: its words parsed by
    hybridrl's own parser, its hardware the one it names."""
    from hybridrl.cli import build_parser
    from hybridrl.config.hardware import load_job_hardware

    words = shlex.split(line.removeprefix(prefix))
    assert words[:2] == ["hybridrl", "plan"], line
    args = build_parser().parse_args(words[1:])
    plan = plan_from_sources(args.config, args.overrides, check_files=not args.layout_only)
    return plan, predict_step_time(plan, load_job_hardware(plan.config.trainer.hardware))


def test_the_printed_commands_are_the_searched_job_with_the_users_own_overrides(capsys):
    """The user's overrides (the hardware, a batch, a layout field in its role-level spelling the search changes, a
    mapping that sets a changed field beside one it keeps) stay in the printed command; pasted, it plans the layout
    ranked first, to its predicted time and peak. Before, the command dropped them: no hardware, another job."""
    from hybridrl.cli import main

    arr = "actor_rollout_ref"
    overrides = ["trainer.hardware=a100-80gb", "data.train_batch_size=512",
                 f"{arr}.actor.tensor_model_parallel_size=4", f"{arr}.rollout={{tensor_model_parallel_size: 4, n: 4}}"]
    assert main(["plan", QWEN_7B, "--search", *overrides]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("#1 as a job: "))
    top = search_from_sources(QWEN_7B, overrides).ranked[0]
    plan, step = _pasted(line, "#1 as a job: ")
    assert step.hardware == "a100-80gb" and step.seconds == pytest.approx(top.step.seconds, rel=1e-12)
    assert plan.gpu_memory.peak_gib == top.peak_gib
    mesh = plan.layout("actor").mesh
    assert (mesh.tp, mesh.pp, plan.config.actor_rollout_ref.rollout.tensor_model_parallel_size) == \
        (top.layout.train_tp, top.layout.train_pp, top.layout.rollout_tp)
    assert top.layout.train_tp != 4  # the user's TP was changed: their spelling of it left the command
    assert (plan.config.data.train_batch_size, plan.config.actor_rollout_ref.rollout.n) == (512, 4)
    # --format json carries the same command, and each ranked layout's overrides for `train` (it had neither)
    assert main(["plan", QWEN_7B, "--search", "--format", "json", *overrides]) == 0
    ranked = json.loads(capsys.readouterr().out)["ranked"]
    assert ranked[0]["command"] == line.removeprefix("#1 as a job: ")
    second = search_from_sources(QWEN_7B, overrides).ranked[1]
    plan = plan_from_sources(QWEN_7B, ranked[1]["job_overrides"])
    step = predict_step_time(plan, load_job_hardware("a100-80gb"))
    assert step.seconds == pytest.approx(second.step.seconds, rel=1e-12)
    assert second.step.seconds != pytest.approx(top.step.seconds, rel=1e-9)  # a different layout: the test can fail

    # the sizing's answer, the same way: its cluster size and the user's settings
    assert main(["plan", QWEN_7B, "--search", "--target-step-time", "300", *overrides]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    gpus = int(line.split(" GPUs: ")[0])
    best = size_cluster(search_inputs(QWEN_7B, overrides), 300.0).smallest.ranked[0]
    plan, step = _pasted(line, f"{gpus} GPUs: ")
    assert plan.resolved.world_size + plan.resolved.rollout_world * plan.resolved.disaggregated == gpus
    assert step.hardware == "a100-80gb" and step.seconds == pytest.approx(best.step.seconds, rel=1e-12)
    assert best.step.seconds <= 300.0
    assert (plan.config.data.train_batch_size, plan.config.actor_rollout_ref.rollout.n) == (512, 4)
    assert main(["plan", QWEN_7B, "--search", "--target-step-time", "300", "--format", "json", *overrides]) == 0
    sized = json.loads(capsys.readouterr().out)
    assert sized["smallest"]["total_gpus"] == gpus and sized["smallest"]["ranked"][0]["command"] == \
        line.removeprefix(f"{gpus} GPUs: ")


def test_a_search_nothing_fits_says_memory_is_why_not_the_jobs_own_problems(capsys):
    """7B GRPO on 16 GiB GPUs: every layout that passes the rules is over memory with every saver. The search said
    'the job's own problems (`hybridrl plan` lists them) come before its layout'; it now says memory, and how many."""
    from hybridrl.cli import main

    overrides = ["trainer.gpu_memory_gib=16", "trainer.hardware=h100-sxm"]
    result = search_from_sources(QWEN_7B, overrides)
    over_memory = dict(result.refused)["trainer.gpu_memory_gib"]
    assert not result.ranked and over_memory > 0
    # one of them, with every memory saver on, refused for its memory by `hybridrl plan`
    arr = "actor_rollout_ref"
    with pytest.raises(ConfigError) as info:
        plan_from_sources(QWEN_7B, [*overrides, f"{arr}.actor.megatron.tensor_model_parallel_size=4",
                                    f"{arr}.actor.megatron.pipeline_model_parallel_size=2"])
    assert [issue.field for issue in info.value.issues] == ["trainer.gpu_memory_gib"]
    assert main(["plan", QWEN_7B, "--search", *overrides]) == 1  # an answer, and nothing fits: not a success
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith(f"No layout plans: {over_memory} of the {result.layouts} layouts do not fit the GPUs' "
                           "memory (trainer.gpu_memory_gib) with any memory saver"), last
    assert "--target-step-time" in last


@pytest.mark.parametrize("override", ["trainer.n_gpus_per_node=0", "trainer.nnodes=0", "trainer.n_gpus_per_node=-8",
                                      "actor_rollout_ref.rollout.n_gpus_per_node=-4"])
def test_a_search_of_a_cluster_without_gpus_is_refused_naming_the_field(override):
    """It searched '0 GPUs; 0 layouts' (or '-8 GPUs') and answered 'No layout plans: the job's own problems ...' with
    exit 0; `hybridrl plan` refuses the same field, and so do the search and the sizing now."""
    overrides = ["trainer.hardware=h100-sxm", override]
    if "rollout" in override:
        overrides.append("actor_rollout_ref.rollout.mode=disaggregated")
    field, value = override.split("=")
    with pytest.raises(ConfigError) as planned:
        plan_from_sources(QWEN_7B, overrides)
    assert (field, int(value)) in [(issue.field, issue.value) for issue in planned.value.issues]
    for refused in (lambda: search_from_sources(QWEN_7B, overrides), lambda: search_inputs(QWEN_7B, overrides)):
        with pytest.raises(ConfigError) as info:
            refused()
        assert [(issue.field, issue.value, issue.rule) for issue in info.value.issues] == \
            [(field, int(value), "must be an integer >= 1")]


def test_a_pipeline_the_users_vpp_does_not_divide_is_searched_without_virtual_stages():
    """Llama-3-70B PPO with VPP 5: PP 2 (VPP needs PP > 2) and PP 10 (80 layers are not 10 x 5 x k) were refused by the
    user's VPP, 304 layouts, so no PP-2 layout was ever ranked; they are now planned without virtual stages, and
    each replans from its printed overrides to its predicted time."""
    overrides = ["trainer.hardware=h100-sxm"]
    arr = "actor_rollout_ref.actor.megatron"
    with pytest.raises(ConfigError) as info:  # the rule that refused them: the user's VPP at PP 2
        plan_from_sources(LLAMA_70B, [f"{arr}.pipeline_model_parallel_size=2",
                                      "critic.megatron.pipeline_model_parallel_size=2"])
    assert {issue.field for issue in info.value.issues} == {f"{arr}.virtual_pipeline_model_parallel_size",
                                                            "critic.megatron.virtual_pipeline_model_parallel_size"}
    result = search_from_sources(LLAMA_70B, overrides)
    unvirtual = [f for f in result.ranked if f.layout.train_pp in (2, 10)]
    assert unvirtual and {f.layout.train_pp for f in unvirtual} >= {2}
    for found in unvirtual[:3] + [f for f in result.ranked if f.layout.train_pp in (4, 8, 16)][:2]:
        plan, step = _replanned(LLAMA_70B, found.overrides())
        vpp = plan.layout("actor").megatron.virtual_pipeline_model_parallel_size
        assert vpp == (None if found.layout.train_pp in (2, 10) else 5), (found.layout, vpp)
        assert step.seconds == pytest.approx(found.step.seconds, rel=1e-12)


# In a fresh interpreter (a process with no threads: the test session's may run some, and the search then plans in
# one process): the 7B job's 1,200 layouts planned by one process and by forked ones.
_ONE_AND_FORKED = """
import json, sys
from hybridrl.config import search as searching
inputs = searching.search_inputs(sys.argv[1], ["trainer.hardware=h100-sxm"])
one = searching.search(inputs.config, inputs.model, inputs.hardware, critic=inputs.critic, processes=1)
chosen = searching._search_processes(one.layouts)
forked = searching.search(inputs.config, inputs.model, inputs.hardware, critic=inputs.critic, processes=3)
print(json.dumps({"chosen": chosen, "layouts": [one.layouts, forked.layouts],
                  "same_ranked": one.ranked == forked.ranked,
                  "ranked": len(one.ranked), "same_refused": one.refused == forked.refused,
                  "refused": one.refused, "same_written": one.written == forked.written}))
"""


def test_a_search_planned_by_forked_processes_is_the_one_process_search():
    """A large search plans its layouts in a process per core (forked; the order of the ranking's ties and of the
    refusal counts kept): the same ranked layouts, refusals and written layout as one process plans."""
    run = subprocess.run([sys.executable, "-c", _ONE_AND_FORKED, QWEN_7B], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["layouts"] == [1200, 1200] and report["ranked"] > 10 and report["refused"]
    assert report["same_ranked"] and report["same_refused"] and report["same_written"], report
    assert report["chosen"] == min(len(os.sched_getaffinity(0)), 8)  # one per core from 256 layouts
