"""verl's keys that have no field of hybridrl's own, read in verl's meaning, so a verl job carries over.

A verl script's overrides mostly name hybridrl's own fields (the schema speaks verl's vocabulary). The
rest are here, each one of four kinds, and the loader (`hybridrl.config.loader`) applies them before
it reads a key as unknown:

* `Restates`: a setting whose accepted values describe what hybridrl does anyway (verl's default is
  always among them: `trainer.critic_warmup=0`, `use_dist_checkpointing=False`). Those values are taken
  and change nothing; any other value is refused, saying what hybridrl does instead.
* `Alias`: verl's spelling of a hybridrl field (`actor_rollout_ref.nccl_timeout` is
  `trainer.nccl_timeout_s`); the value goes to that field, and two spellings with different values are
  the loader's usual error naming both. A `section` alias spells a whole section: each key under it is
  the same key under the target (verl's top-level `custom_reward_function.path` is
  `algorithm.custom_reward_function.path`).
* `Refused`: a verl key with a meaning hybridrl does not build; refused by name with the reason, never
  read as a near-spelled field of another meaning (verl's `data.reward_fn_key` is not `data.reward_key`).
  With `null_restates`, null (verl's default: the feature off) is taken and changes nothing.
* `Implies`: a verl setting whose accepted values each stand for values of hybridrl fields (verl's
  `reward_model.reward_manager=prime` is reward calls in a pool of processes:
  `algorithm.custom_reward_function.num_workers`). The loader sets those fields where the job does not set them
  itself, in any source and spelling: the job's own value wins. Any other value is refused with the reason.

`ROLE` in a key stands for each role section with a megatron layout (actor, ref, critic, reward model).
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from hybridrl.parallel.device import usable_cores

ROLE = "<role>"
ROLE_PATHS = (("actor_rollout_ref", "actor"), ("actor_rollout_ref", "ref"), ("critic",), ("reward_model",))
ANY = object()  # every value restates hybridrl's behaviour


@dataclass(frozen=True)
class Restates:
    key: str
    accepted: tuple[Any, ...] | object
    does: str  # what hybridrl does, for the refusal of any other value


@dataclass(frozen=True)
class Alias:
    key: str
    target: str
    translate: dict[Any, Any] | None = None  # verl's values -> hybridrl's (others pass unchanged)
    section: bool = False  # the key is a section: every key under it is the same key under the target


@dataclass(frozen=True)
class Refused:
    key: str
    why: str | Callable[[Any], str]  # or the reason for the value given (one that reads the file it names)
    null_restates: bool = False  # null (verl's default: the feature off) is taken and changes nothing

    def reason(self, value: Any) -> str:
        return self.why(value) if callable(self.why) else self.why


@dataclass(frozen=True)
class Implies:
    key: str
    values: Mapping[Any, Mapping[str, Any]]  # verl's value -> {hybridrl field: its value, or a function giving it}
    why: str | Callable[[Any], str]  # the refusal of any other value (or the reason for the value given)

    def implied(self, value: Any) -> dict[str, Any] | None:
        """The fields `value` sets (functions called now), or None when it is not accepted (YAML's True is not 1:
        compared with types)."""
        for accepted, fields in self.values.items():
            if type(value) is type(accepted) and value == accepted:
                return {name: field() if callable(field) else field for name, field in fields.items()}
        return None

    def reason(self, value: Any) -> str:
        return self.why(value) if callable(self.why) else self.why


VerlKey = Restates | Alias | Refused | Implies

# verl's resume_mode=resume_path with resume_from_path=<folder>: hybridrl's resume_mode is the folder itself
RESUME_PATH_POINTER = ("hybridrl's trainer.resume_mode takes the checkpoint path itself: trainer.resume_mode=<the "
                       "global_step_N folder> (auto: the newest under default_local_dir; disable: a fresh start)")
REWARD_WORKERS = "algorithm.custom_reward_function.num_workers"
# verl's PrimeRewardManager: a ProcessPoolExecutor of num_processes=64, each call given 300 s (hybridrl's timeout_s
# default), a failed or timed-out call scoring 0.0 (hybridrl's fallback_score is not implied)
PRIME_PROCESSES = 64


def prime_num_workers() -> int:
    """What verl's reward_manager=prime sets num_workers to: its 64 processes, at most one per core this process may
    run on (the trainer's machine, where the reward processes run): each runs one call at a time under a wall-clock
    deadline, and CPU-bound calls sharing a core would take longer towards it."""
    return max(1, min(PRIME_PROCESSES, usable_cores()))


def _reward_manager_refusal(value: Any) -> str:
    if value == "batch":
        return ("is verl's manager that calls the reward function once per batch with lists (data_sources, "
                "solution_strs, ground_truths, extra_infos); hybridrl calls it once per sample, in "
                f"{REWARD_WORKERS} processes at once: write it per sample (verl's naive form compute_score("
                "data_source, solution_str, ground_truth, extra_info)) and set reward_model.reward_manager=prime or "
                f"{REWARD_WORKERS}=N for the batch in parallel")
    return ("is a verl setting hybridrl takes only as naive, dapo, prime: the rule scorer (algorithm.reward_fn) or "
            "algorithm.custom_reward_function scores each sample; DAPO's overlong penalty is "
            f"algorithm.overlong_buffer; prime's pool of processes is {REWARD_WORKERS}")


_FSDP_TRAINER = ("hybridrl trains every role with megatron-core; verl's FSDP trainer (strategy=fsdp and its "
                 "fsdp_config sections) is not built: start from verl's Megatron trainer config "
                 "(verl/trainer/config/_generated_ppo_megatron_trainer.yaml) or set strategy=megatron for "
                 "actor_rollout_ref.actor, actor_rollout_ref.ref and critic")
_TORCH_DTYPES = (("bfloat16", "bf16"), ("float16", "fp16"), ("float32", "fp32"))
_WEIGHTS = "hybridrl loads the HF folder of model.path with its own weight table per model family " \
           "(hybridrl/models/families)"
VERL_KEYS: tuple[VerlKey, ...] = (
    Restates("trainer.critic_warmup", (0,), "the actor updates from the first step (critic warm-up is not built yet)"),
    # one switch for one idea: where vLLM runs is actor_rollout_ref.rollout.mode alone
    Restates("actor_rollout_ref.hybrid_engine", (True,),
             "actor_rollout_ref.rollout.mode decides where vLLM runs: colocated (the default, verl's hybrid engine: "
             "actor, rollout and reference in the same processes) or disaggregated (vLLM on a pool of its own)"),
    Restates(f"{ROLE}.megatron.use_mbridge", (True, False), _WEIGHTS),
    Restates(f"{ROLE}.megatron.vanilla_mbridge", (True, False), _WEIGHTS),
    Restates(f"{ROLE}.megatron.use_dist_checkpointing", (False,),
             _WEIGHTS + "; a megatron checkpoint converts to one with `hybridrl convert mcore-to-hf`"),
    # verl reads the path only with use_dist_checkpointing=True, which is refused above
    Restates(f"{ROLE}.megatron.dist_checkpointing_path", ANY, _WEIGHTS),
    Restates("actor_rollout_ref.model.use_fused_kernels", (False,),
             "log-probs and entropy come from hybridrl's own vocab-parallel functions "
             "(hybridrl/algorithms/vocab_parallel.py); verl's fused kernels are not used"),
    Restates("actor_rollout_ref.actor.use_torch_compile", (True, False),
             "hybridrl compiles nothing with torch.compile"),
    Restates("data.return_raw_chat", (True, False), "every prompt keeps its raw chat messages (PromptItem.raw_prompt)"),
    Restates("data.reward_fn_key", ("data_source",),
             "hybridrl logs scores per row's data_source column; the scorer is algorithm.reward_fn"),
    Restates("actor_rollout_ref.rollout.enable_chunked_prefill", (True,), "vLLM's V1 engine always chunks prefills"),
    Restates(f"{ROLE}.profiler.enable", (False,), "hybridrl has no built-in profiler: run the job under nsys"),
    Restates(f"{ROLE}.profiler.all_ranks", ANY, "only read with profiler.enable=true, which is refused"),
    Restates(f"{ROLE}.profiler.ranks", ANY, "only read with profiler.enable=true, which is refused"),
    # verl's DAPO reward manager: the rule score plus the soft overlong penalty, which is hybridrl's
    # algorithm.overlong_buffer (naive: the rule score alone, the same with the buffer off); its prime manager: the
    # same calls in a pool of processes, each under a deadline (verl/workers/reward_manager/prime.py)
    *(Implies(key, {"naive": {}, "dapo": {}, "prime": {REWARD_WORKERS: prime_num_workers}}, _reward_manager_refusal)
      # verl's scripts' key, and newer verl's (0.9: reward.reward_manager.name, the legacy key migrated into it)
      for key in ("reward_model.reward_manager", "reward.reward_manager.name")),
    # prime's pool size (its constructor's num_processes, which verl passes from reward_model.reward_kwargs)
    Alias("reward_model.reward_kwargs.num_processes", REWARD_WORKERS),
    Alias("reward_model.reward_kwargs.overlong_buffer_cfg.enable", "algorithm.overlong_buffer.enable"),
    Alias("reward_model.reward_kwargs.overlong_buffer_cfg.len", "algorithm.overlong_buffer.len"),
    Alias("reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor", "algorithm.overlong_buffer.penalty_factor"),
    Restates("reward_model.reward_kwargs.overlong_buffer_cfg.log", ANY,
             "the penalty is always logged (reward/overlong_penalty_mean)"),
    Alias("reward_model.reward_kwargs.max_resp_len", "algorithm.overlong_buffer.max_response_length"),
    Alias("actor_rollout_ref.nccl_timeout", "trainer.nccl_timeout_s"),
    # the seconds each reward call may take (verl's rate-limited reward manager reads it; 300 by default there too)
    Alias("reward_model.timeout", "algorithm.custom_reward_function.timeout_s"),
    Restates(f"{ROLE}.megatron.override_transformer_config.moe_router_dtype", ("fp32",),
             "the router runs in fp32, as the HF model's does"),
    Restates(f"{ROLE}.megatron.override_transformer_config.moe_grouped_gemm", (False,),
             "hybridrl's weight tables lay experts out as megatron's SequentialMLP (one linear pair per expert)"),
    # megatron TransformerConfig fields that are hybridrl layout fields of the role: read as those
    *(Alias(f"{ROLE}.megatron.override_transformer_config.{name}", f"{ROLE}.megatron.{name}")
      for name in ("sequence_parallel", "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
                   "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff",
                   "moe_token_dispatcher_type", "moe_expert_capacity_factor", "moe_token_drop_policy",
                   "moe_pad_expert_input_to_capacity")),
    Alias("data.trust_remote_code", "actor_rollout_ref.model.trust_remote_code"),
    # verl spells dtypes as torch does (its default: bfloat16); hybridrl's fields take bf16, fp16, fp32
    *(Alias(key, key, translate=dict(_TORCH_DTYPES))
      for key in (f"{ROLE}.megatron.dtype", "actor_rollout_ref.rollout.dtype")),
    # verl's FSDP trainer names torch's class; megatron's adam is AdamW (decoupled weight decay, its default)
    *(Alias(f"{role}.optim.optimizer", f"{role}.optim.optimizer", translate={"AdamW": "adam"})
      for role in ("actor_rollout_ref.actor", "critic")),
    # the actor's is hybridrl's own field (megatron only); verl's reference and critic name theirs too
    *(Restates(f"{role}.strategy", ("megatron",), _FSDP_TRAINER)
      for role in ("actor_rollout_ref.ref", "critic")),
    # verl's seed of its sampler's order: hybridrl's data order comes from the one job seed, which also seeds sampling
    Refused("data.seed", "is verl's seed of the data order; hybridrl's data order follows trainer.seed (which also "
            "seeds the rollout's sampling): set trainer.seed"),
    *(Refused(f"data.{key}", "names verl's multimodal column; hybridrl trains text-only models (a file with an images "
              "or videos column is refused): drop it, and the column from the data")
      for key in ("image_key", "video_key")),
    # verl's user reward function: at the top level (its scripts), under `reward` (newer verl)
    Alias("custom_reward_function", "algorithm.custom_reward_function", section=True),
    Alias("reward.custom_reward_function", "algorithm.custom_reward_function", section=True),
    Alias("actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes",
          "actor_rollout_ref.rollout.update_weights_bucket_megabytes"),
    # verl's sync/async rollout modes both run vLLM in the training processes: hybridrl's colocated mode
    Alias("actor_rollout_ref.rollout.mode", "actor_rollout_ref.rollout.mode",
          translate={"sync": "colocated", "async": "colocated"}),
    Refused("actor_rollout_ref.actor.ppo_micro_batch_size",
            "is verl's deprecated global micro-batch; set actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"),
    Refused("actor_rollout_ref.rollout.log_prob_micro_batch_size",
            "is verl's deprecated global micro-batch; set actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"),
    Refused("actor_rollout_ref.ref.log_prob_micro_batch_size",
            "is verl's deprecated global micro-batch; set actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"),
    Refused("critic.ppo_micro_batch_size",
            "is verl's deprecated global micro-batch; set critic.ppo_micro_batch_size_per_gpu"),
    # verl's FSDP spellings of the LoRA fields (its Megatron path's are hybridrl's: model.lora.*); its common
    # target_modules=all-linear is every linear layer of the decoder: lora.target_modules empty (every target of
    # lora.type, none excluded)
    Alias("actor_rollout_ref.model.lora_rank", "actor_rollout_ref.model.lora.rank"),
    Alias("actor_rollout_ref.model.lora_alpha", "actor_rollout_ref.model.lora.alpha"),
    Alias("actor_rollout_ref.model.target_modules", "actor_rollout_ref.model.lora.target_modules",
          translate={"all-linear": []}),
    Alias("actor_rollout_ref.model.exclude_modules", "actor_rollout_ref.model.lora.exclude_modules",
          translate={None: []}),
    Alias("actor_rollout_ref.model.lora_adapter_path", "actor_rollout_ref.model.lora.adapter_path"),
    # verl's FSDP LoRA scripts' loading and sync knobs, none of which changes what trains or what vLLM serves here
    Restates("actor_rollout_ref.model.use_shm", ANY,
             "the workers read the model folder where it is (verl: a copy in /dev/shm first, for speed)"),
    Restates("actor_rollout_ref.rollout.layered_summon", ANY,
             "the resharder sends vLLM the weights (merged with the adapters) in buckets of "
             "actor_rollout_ref.rollout.update_weights_bucket_megabytes, never the whole model at once"),
    Restates("actor_rollout_ref.rollout.load_format", ANY,
             "vLLM serves the trainer's weights from the first sync on, whatever it loaded at start-up"),
    # verl's FSDP backend's own section: hybridrl trains with megatron-core
    Refused("actor_rollout_ref.actor.fsdp_config", "is verl's FSDP backend; hybridrl trains with megatron-core: the "
            "same offloads are actor_rollout_ref.actor.megatron.param_offload and optimizer_offload (the layout is "
            "actor_rollout_ref.actor.megatron.*)"),
    Refused("actor_rollout_ref.ref.fsdp_config", "is verl's FSDP backend; hybridrl runs the reference with "
            "megatron-core: its offload is actor_rollout_ref.ref.megatron.param_offload (with LoRA the reference is "
            "the actor's own base: nothing to offload)"),
    Refused("critic.model.fsdp_config", "is verl's FSDP backend; hybridrl trains with megatron-core: the critic's "
            "offloads are critic.megatron.optimizer_offload and grad_offload"),
    # the global gradient-norm clip: verl's FSDP actor/critic `grad_clip`, and `clip_grad` on the role
    *(Alias(f"{role}.{name}", f"{role}.optim.clip_grad")
      for role in ("actor_rollout_ref.actor", "critic") for name in ("grad_clip", "clip_grad")),
    # verl keeps this many of each role's checkpoints; hybridrl's checkpoint (global_step_N) holds every role's,
    # kept or removed together: the same number for both (two different numbers are the two-spellings error)
    Alias("trainer.max_actor_ckpt_to_keep", "trainer.keep_last_n"),
    Alias("trainer.max_critic_ckpt_to_keep", "trainer.keep_last_n"),
    Refused("trainer.resume_from_path", "is verl's checkpoint path for its resume_mode=resume_path; "
            + RESUME_PATH_POINTER),
    Restates("actor_rollout_ref.rollout.do_sample", (True,),
             "the training rollout always samples (actor_rollout_ref.rollout.temperature, top_p, top_k); greedy "
             "decoding is validation's: actor_rollout_ref.rollout.val_kwargs.do_sample=false"),
    Refused("global_profiler", "hybridrl has no built-in profiler: run the job under nsys or torch.profiler yourself"),
    # verl's on-policy distillation recipe queries a teacher server (ZeroMQ) for top-k log-probs
    Refused("actor_rollout_ref.teacher",
            "is verl's distillation recipe's teacher server; hybridrl runs the teacher itself, in its own "
            "processes on the training GPUs: set algorithm.distillation.enable=true and teacher.model.path (a "
            "Hugging Face folder with the policy's tokenizer), its layout in teacher.megatron"),
)


_MT = "actor_rollout_ref.rollout.multi_turn"
_TOOLS_FILE_EXAMPLE = (
    "TOOL_SCHEMAS = [<each tool's OpenAI schema, the tool_schema of verl's YAML>]; def <name>(<its parameters>, "
    "sample): ... (sample: the calling row, read-only; verl's per-row create kwargs are "
    "sample['extra_info']['tools_kwargs'][<name>]['create_kwargs']); return the answer's text")


def _tool_config_refusal(path: Any) -> str:
    """Why verl's tool_config_path is refused, with a tools file made of its YAML's schemas when it reads."""
    head = (f"is verl's YAML of BaseTool classes (verl.tools.base_tool, which hybridrl does not import: verl is not "
            f"a dependency); hybridrl's tools are plain functions in a Python file: set {_MT}.tools_file to it and "
            f"{_MT}.tools to their names. ")
    try:
        tools = yaml.safe_load(Path(str(path)).read_text())["tools"]
        entries = [(str(t["class_name"]), dict(t["tool_schema"])) for t in tools]
        names = [str(schema["function"]["name"]) for _, schema in entries]
    except Exception:  # unreadable or not verl's layout: the general form
        return head + "The file defines " + _TOOLS_FILE_EXAMPLE
    classes = ", ".join(f"{name} ({cls})" for (cls, _), name in zip(entries, names))
    schemas = json.dumps([schema for _, schema in entries])
    functions = " ".join(
        f"def {name}({', '.join([*schema['function'].get('parameters', {}).get('properties', {}), 'sample'])}): "
        f"... (what {cls}.execute returns as text; {cls}.create's create_kwargs are "
        f"sample['extra_info']['tools_kwargs'][{name!r}]['create_kwargs']);"
        for (cls, schema), name in zip(entries, names))
    return (head + f"This file's tools: {classes}. As a tools file: TOOL_SCHEMAS = {schemas} {functions} then "
            f"{_MT}.tools={json.dumps(names)} {_MT}.tools_file=<that file>")


# verl's multi-turn rollout (its ToolAgentLoop) keys: the limits are hybridrl's agent loop's
# (hybridrl/rollout/agent_loop.py)
_MULTI_TURN: tuple[VerlKey, ...] = (
    # verl stops after that many model turns without reading the last one's calls: hybridrl's max_turns (null: the
    # response budget alone, as verl's null)
    Alias(f"{_MT}.max_assistant_turns", f"{_MT}.max_turns"),
    Alias(f"{_MT}.format", f"{_MT}.tool_parser"),
    # both count characters of the tool's text and keep that many plus a note
    Alias(f"{_MT}.max_tool_response_length", f"{_MT}.max_observation_chars"),
    Alias(f"{_MT}.tool_response_truncate_side", f"{_MT}.observation_truncate_side"),
    Alias(f"{_MT}.max_parallel_calls", f"{_MT}.max_parallel_calls"),
    # verl stops once the conversation holds that many tool answers (after the model's next turn)
    Restates(f"{_MT}.max_user_turns", (None,),
             f"hybridrl bounds a conversation by its model turns alone: N rounds of tool answers are {_MT}.max_turns"
             "=N+1 (verl's max_assistant_turns), the last turn's calls not run"),
    Restates(f"{_MT}.use_inference_chat_template", (False,),
             "the conversation trained is the token ids vLLM sampled with the tool answers' tokens between them "
             "(verl's false), never re-rendered through the chat template"),
    Restates(f"{_MT}.tokenization_sanity_check_mode", ANY,
             "hybridrl never re-tokenizes a conversation (its ids are the sampled ids and each tool answer's "
             "tokens, appended once), so there is nothing to check"),
    Restates(f"{_MT}.num_repeat_rollouts", (None,),
             "samples per prompt are actor_rollout_ref.rollout.n (verl 0.9 reads num_repeat_rollouts nowhere)"),
    Restates(f"{_MT}.interaction_config_path", (None,),
             "hybridrl's conversations have no simulated user (verl's interactions): tool answers are the only "
             f"turns between the model's; per-turn feedback is {_MT}.turn_reward (a Python function of each turn)"),
    Refused(f"{_MT}.tool_config_path", _tool_config_refusal, null_restates=True),
    Refused(f"{_MT}.function_tool_path",
            "is verl's file of @function_tool functions (it imports verl.tools, which hybridrl does not: verl is not a "
            f"dependency); hybridrl's tools file is the same functions without the decorator: set {_MT}.tools_file "
            "to a Python file whose " + _TOOLS_FILE_EXAMPLE + f", and {_MT}.tools to their names",
            null_restates=True),
)
VERL_KEYS += _MULTI_TURN


def _expand(key: str, role: tuple[str, ...] | None) -> tuple[str, ...]:
    if key.startswith(ROLE):
        assert role is not None, key
        return (*role, *key[len(ROLE) + 1:].split("."))
    return tuple(key.split("."))


def _paths(entry: VerlKey) -> Iterator[tuple[tuple[str, ...], tuple[str, ...] | None]]:
    """Each dotted path `entry` covers, with its alias target for that path (a role's key, the same role's)."""
    for role in ROLE_PATHS if entry.key.startswith(ROLE) else (None,):
        target = _expand(entry.target, role) if isinstance(entry, Alias) else None
        yield _expand(entry.key, role), target


_BY_PATH: dict[tuple[str, ...], tuple[VerlKey, tuple[str, ...] | None]] = {
    path: (entry, target) for entry in VERL_KEYS for path, target in _paths(entry)}


def verl_key(parts: tuple[str, ...]) -> tuple[VerlKey, tuple[str, ...] | None] | None:
    """The entry for a dotted path (or for a section above it: a `Refused` section refuses all of its keys, a
    `section` alias moves them under its target), with the path an `Alias` sets for it."""
    for depth in range(len(parts), 0, -1):
        found = _BY_PATH.get(parts[:depth])
        if found is None:
            continue
        entry, target = found
        if depth == len(parts) or isinstance(entry, Refused):
            return found
        if isinstance(entry, Alias) and entry.section:
            assert target is not None
            return entry, (*target, *parts[depth:])
    return None


def restated(entry: Restates, value: Any) -> bool:
    """Whether `value` is one `entry` accepts (YAML's True is not 1: compared with types)."""
    if entry.accepted is ANY:
        return True
    return any(type(value) is type(ok) and value == ok for ok in entry.accepted)  # type: ignore[union-attr]
