"""The rules of the rollout at plan time: where vLLM runs (colocated or its own pool) and its TP, multi-turn
tool calling, validation sampling. Torch-free; called by `config.validate`."""
from __future__ import annotations

import math
from pathlib import Path

from hybridrl.algorithms.names import GREEDY_BASELINE_ADV_ESTIMATORS
from hybridrl.config.checker import Checker, divisors
from hybridrl.config.resolve import Resolved
from hybridrl.config.schema import JobConfig
from hybridrl.models.arch import ModelShape
from hybridrl.models.vllm_layout import vllm_padded_vocab
from hybridrl.parallel.device_policy import DEVICE_POLICIES


def check_multi_turn(check: Checker, config: JobConfig) -> None:
    """`rollout.multi_turn` when enabled: tools that exist, a known parser, limits that are positive."""
    from hybridrl.tool_calling import BUILTIN_TOOLS, available_parsers

    rollout = config.actor_rollout_ref.rollout
    mt, prefix = rollout.multi_turn, "actor_rollout_ref.rollout.multi_turn"
    if mt.max_turns is not None:  # null: no limit but the response budget (verl's max_assistant_turns=null)
        check.is_int_at_least(f"{prefix}.max_turns", mt.max_turns, 1)
    check.is_int_at_least(f"{prefix}.max_observation_chars", mt.max_observation_chars, 1)
    if mt.max_parallel_calls is not None:  # null: every call of a turn
        check.is_int_at_least(f"{prefix}.max_parallel_calls", mt.max_parallel_calls, 1)
    tools = mt.tools if isinstance(mt.tools, list) else None
    if not tools or not all(isinstance(t, str) and t for t in tools):
        check.fail(f"{prefix}.tools", mt.tools, "must list at least one tool name (the model has nothing to call "
                   f"otherwise): built in {list(BUILTIN_TOOLS)} or defined in tools_file", list(BUILTIN_TOOLS))
    elif len(set(tools)) != len(tools):
        check.fail(f"{prefix}.tools", mt.tools, "names a tool twice")
    else:
        user = [t for t in tools if t not in BUILTIN_TOOLS]
        if mt.tools_file is None and user:
            check.fail(f"{prefix}.tools", mt.tools, f"names {user}, which are not built in; set {prefix}.tools_file "
                       "to the Python file that defines them", list(BUILTIN_TOOLS))
    if mt.tools_file is not None and not Path(str(mt.tools_file)).is_file():
        check.fail(f"{prefix}.tools_file", mt.tools_file, "is not a file (a Python file defining TOOL_SCHEMAS and "
                   "their functions)")
    # a tools file may define the parser (its TOOL_PARSERS): checked when the trainer loads the file,
    # before any worker starts
    if mt.tool_parser not in available_parsers() and mt.tools_file is None:
        check.fail(f"{prefix}.tool_parser", mt.tool_parser, "is not a registered tool-call parser (verl's "
                   "multi_turn.format names the same thing; a tools file's TOOL_PARSERS may add one: set "
                   f"{prefix}.tools_file)", available_parsers())
    if mt.tool_timeout_s is not None:
        check.in_range(f"{prefix}.tool_timeout_s", mt.tool_timeout_s, 0, 86400, low_open=True)
    if mt.sandbox.isolation == "none" and "python" in (tools or ()):
        check.warnings.append(f"{prefix}.sandbox.isolation=none: the python tool runs model-written code as a plain "
                              "subprocess with limits and a Python audit hook, which is not a boundary against "
                              "hostile code (it can read what the trainer can); use namespaces where the kernel "
                              "allows user namespaces")
    for name in ("wall_time_s", "cpu_time_s", "memory_mb", "max_file_mb", "max_output_bytes"):
        value = getattr(mt.sandbox, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            check.fail(f"{prefix}.sandbox.{name}", value, "must be a positive number")
    tr = mt.turn_reward
    penalty = tr.tool_error_penalty
    if not isinstance(penalty, (int, float)) or isinstance(penalty, bool) or not math.isfinite(penalty) or penalty < 0:
        check.fail(f"{prefix}.turn_reward.tool_error_penalty", penalty,
                   "must be a finite number >= 0 (it is subtracted per failed tool call)", [0.0, 0.1])
    if tr.path is not None and not Path(str(tr.path)).is_file():
        check.fail(f"{prefix}.turn_reward.path", tr.path, "is not a file (a Python file defining the per-turn "
                   f"reward function {tr.name!r})")
    if not isinstance(tr.name, str) or not tr.name.isidentifier():
        check.fail(f"{prefix}.turn_reward.name", tr.name, "must be a Python function name")


def check_validation_sampling(check: Checker, config: JobConfig) -> None:
    """Greedy validation (do_sample false or temperature 0) decodes one sample per prompt, so
    sampling knobs set next to it would be dropped."""
    vk, r = config.actor_rollout_ref.rollout.val_kwargs, "actor_rollout_ref.rollout.val_kwargs"
    if vk.do_sample:
        if vk.temperature == 0:
            check.fail(f"{r}.temperature", vk.temperature,
                       f"must be > 0 when {r}.do_sample=true (temperature 0 decodes greedily)", [0.6, 1.0])
        return
    knobs = (("temperature", vk.temperature, 0.0), ("n", vk.n, 1), ("top_p", vk.top_p, 1.0))
    for name, value, greedy in knobs:
        if value != greedy:
            check.fail(f"{r}.{name}", value, f"has no effect while {r}.do_sample=false (greedy, one sample per "
                       f"prompt): set do_sample=true to sample, or leave it at {greedy:g}", [greedy])
    if vk.top_k not in (-1, 0):
        check.fail(f"{r}.top_k", vk.top_k, f"has no effect while {r}.do_sample=false (greedy): set "
                   "do_sample=true to sample, or leave it at -1", [-1])


def check_stop_tokens(check: Checker, config: JobConfig, model: ModelShape | None) -> None:
    """`rollout.stop_token_ids`: token ids, each in [0, vocab_size) of the model's config.json (vLLM refuses any
    other at the first generation: they index its logits). A negative id is wrong without the model."""
    field = "actor_rollout_ref.rollout.stop_token_ids"
    ids = config.actor_rollout_ref.rollout.stop_token_ids
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        check.fail(field, ids, "must be a list of token ids (integers)")
        return
    vocab = model.vocab_size if model is not None else None
    bad = [i for i in ids if i < 0 or (vocab is not None and i >= vocab)]
    if bad:
        valid = (f"be in [0, {vocab}) (the model's vocab_size is {vocab})" if vocab is not None
                 else "be 0 or more (token ids count from 0)")
        check.fail(field, ids, f"holds token ids outside the vocabulary: {bad}; each must {valid}")


def check_rollout_head_dim(check: Checker, config: JobConfig, model: ModelShape | None) -> None:
    """The actor's head_dim is one vLLM's attention has a kernel for on this device (on CPU a fixed list): another
    passes every other check and stops each rollout worker as vLLM builds the model."""
    policy = DEVICE_POLICIES.get(config.trainer.device)  # None: an unknown device, reported elsewhere
    if model is None or policy is None or policy.vllm_attention_head_dims is None:
        return
    if model.head_dim not in policy.vllm_attention_head_dims:
        check.fail("actor_rollout_ref.model.path", config.actor_rollout_ref.model.path,
                   f"is a model of head_dim={model.head_dim} (config.json's head_dim, or hidden_size / "
                   f"num_attention_heads), for which vLLM's attention on trainer.device={policy.name} has no kernel "
                   "(every rollout worker would stop as vLLM builds the model); it takes these head_dims",
                   policy.vllm_attention_head_dims)


def check_rollout_placement(check: Checker, config: JobConfig, resolved: Resolved, world: int) -> int:
    """rollout.mode, its pool and rollout.async_mode; returns the ranks vLLM runs on (0 when invalid)."""
    arr = config.actor_rollout_ref
    rollout = arr.rollout
    r = "actor_rollout_ref.rollout"
    if resolved.disaggregated and arr.actor.megatron.param_offload:
        check.fail("actor_rollout_ref.actor.megatron.param_offload", True,
                   f"frees the actor's GPUs for a colocated vLLM; with {r}.mode=disaggregated vLLM runs on its own "
                   "GPUs and the actor's have nothing to make room for", [False])
    if rollout.async_mode in ("sync", "one_step_off"):  # an unknown mode: reported by validate._check_names
        for name in FULLY_ASYNC_FIELDS:
            value = getattr(rollout, name)
            if value is not None:
                check.fail(f"{r}.{name}", value, f"applies to {r}.async_mode=fully_async only (it is "
                           f"{rollout.async_mode}); remove it", [])
    elif rollout.max_staleness is not None:
        check.is_int_at_least(f"{r}.max_staleness", rollout.max_staleness, 1)
    if rollout.mode != "disaggregated":
        if rollout.mode != "colocated":
            return 0  # an unknown mode: reported by validate._check_names
        for name, value, default in (("nnodes", rollout.nnodes, 1), ("n_gpus_per_node", rollout.n_gpus_per_node, None)):
            if value != default:
                check.fail(f"{r}.{name}", value, f"sizes a disaggregated rollout pool; with {r}.mode=colocated vLLM "
                           "runs on the training ranks (trainer.nnodes × trainer.n_gpus_per_node): remove it, or set "
                           "mode=disaggregated", [default])
        if rollout.async_mode in ("one_step_off", "fully_async"):
            check.fail(f"{r}.async_mode", rollout.async_mode, f"needs {r}.mode=disaggregated: colocated, generation "
                       "and training take turns on the same GPUs, so neither can run ahead", ["sync"])
        return world
    ok = check.is_int_at_least(f"{r}.nnodes", rollout.nnodes, 1)
    if rollout.n_gpus_per_node is None:
        ok = check.fail(f"{r}.n_gpus_per_node", None, f"is required with {r}.mode=disaggregated: the rollout "
                        "pool's ranks per machine (vLLM's GPUs, apart from the trainer's)")
    else:
        ok &= check.is_int_at_least(f"{r}.n_gpus_per_node", rollout.n_gpus_per_node, 1)
    if rollout.free_cache_engine is not None:
        check.fail(f"{r}.free_cache_engine", rollout.free_cache_engine, f"applies to {r}.mode=colocated only: a "
                   "disaggregated rollout has its GPUs to itself and never sleeps; remove it", [])
    if rollout.async_mode in ("one_step_off", "fully_async"):
        behind = f"with {r}.async_mode={rollout.async_mode}"
        alg = config.algorithm
        if alg.adv_estimator in GREEDY_BASELINE_ADV_ESTIMATORS:
            check.fail("algorithm.adv_estimator", alg.adv_estimator, f"{behind}: its greedy baseline would be a "
                       "second generation of the step's prompts while the rollout pool runs ahead (not built); use "
                       "grpo, rloo, reinforce_plus_plus or gae, or async_mode=sync", ["grpo", "rloo"])
        if alg.filter_groups.enable:
            check.fail("algorithm.filter_groups.enable", True, f"{behind}: dynamic sampling's extra generation "
                       "rounds are not built for a rollout that runs ahead; use async_mode=sync", [False])
    if rollout.async_mode == "fully_async":
        behind = f"with {r}.async_mode=fully_async"
        if rollout.multi_turn.enable is True:
            check.fail(f"{r}.multi_turn.enable", True, f"{behind}: a conversation paused at a weight sync would "
                       "have to resume mid-turn (not built); use async_mode=one_step_off or sync", [False])
        if arr.actor.router_replay == "rollout":
            check.fail("actor_rollout_ref.actor.router_replay", "rollout", f"{behind}: a partial rollout re-reads "
                       "its prefix under new weights, whose routing would not be the one the tokens were sampled "
                       "with; use async_mode=one_step_off or sync", ["none"])
    return resolved.rollout_world if ok else 0


# rollout settings that apply to async_mode=fully_async only (refused elsewhere; `--search` clears them on the
# layouts it runs in turn or one step ahead)
FULLY_ASYNC_FIELDS = ("max_staleness", "stale_samples", "partial_rollout")


def check_rollout_layout(check: Checker, config: JobConfig, world: int, model: ModelShape | None,
                          pool: bool = False) -> int:
    """vLLM layout rules on its `world` ranks (`pool`: a disaggregated rollout pool's); returns the number
    of rollout replicas (0 when invalid)."""
    field = "actor_rollout_ref.rollout.tensor_model_parallel_size"
    itp = config.actor_rollout_ref.rollout.tensor_model_parallel_size
    if not check.is_int_at_least(field, itp, 1):
        return 0
    ok = True
    if world and world % itp:
        where = "rollout pool's " if pool else ""
        ok = check.fail(field, itp, f"must divide the {where}{world} GPUs", divisors(world))
    if model is not None:
        heads, kv = model.num_attention_heads, model.num_kv_heads
        padded_vocab = vllm_padded_vocab(model.vocab_size)
        if heads % itp:
            ok = check.fail(field, itp, f"must divide the model's {heads} attention heads", divisors(heads))
        elif kv % itp and itp % kv:
            ok = check.fail(field, itp, f"must divide the model's {kv} KV heads or be a multiple of them",
                            [d for d in divisors(heads) if kv % d == 0 or d % kv == 0])
        elif padded_vocab % itp:
            ok = check.fail(field, itp,
                            f"must divide the vocabulary as vLLM pads it ({model.vocab_size} -> {padded_vocab})",
                            [d for d in divisors(heads) if padded_vocab % d == 0])
        elif model.is_moe and model.moe_ffn_hidden_size % itp:
            # vLLM splits each expert's width over its TP ranks (no expert parallelism in vLLM here)
            ok = check.fail(field, itp, f"must divide the experts' intermediate size {model.moe_ffn_hidden_size}: "
                            "vLLM splits each expert over its TP ranks",
                            [d for d in divisors(heads) if model.moe_ffn_hidden_size % d == 0])
    return world // itp if (ok and world) else 0
