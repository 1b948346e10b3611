"""The job config: one tree of dataclasses, in the vocabulary verl users already know.

Every field has a default and a one-line `doc` (shown by `hybridrl plan --explain` and in
`configs/base.yaml`). The loader (`hybridrl.config.loader`) fills these from YAML and dotted overrides with type
checking; derived numbers never live here: they are computed once into the immutable `Plan`
(`hybridrl.config.plan`), so the user's config is never mutated behind their back.
"""
from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from hybridrl.algorithms.names import (
    ADV_ESTIMATOR_NAMES,
    KL_CONTROLLER_KINDS,
    KL_PENALTY_NAMES,
    LOSS_AGG_MODES,
    ROLLOUT_IS_LEVELS,
    ROLLOUT_MASK_LEVELS,
)
from hybridrl.models.lora_targets import A_INIT_METHODS, LORA_TYPES, TARGETS
from hybridrl.tool_calling.sandbox import Isolation

# Closed vocabularies. A field typed with one of these takes exactly its values: the loader reads
# them as strings, validation refuses anything else (naming the valid values, with a did-you-mean)
# and `configs/base.yaml` lists them, so the three cannot disagree. The second name is the word
# an error uses ("is not a known <what>").
Device = Literal["cuda", "cpu"]
Dtype = Literal["bf16", "fp16", "fp32"]
LoggerName = Literal["console", "jsonl", "tensorboard", "wandb"]
# the package each optional logger imports in train (hybridrl/trainer/tracking.py), which the plan imports too
LOGGER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}
RolloutEngineName = Literal["vllm"]
SandboxIsolation = Isolation  # hybridrl.tool_calling.sandbox: "namespaces" or "none"
Strategy = Literal["megatron"]
OptimizerName = Literal["adam", "sgd"]
LrDecayStyle = Literal["constant", "linear", "cosine"]
Truncation = Literal["error", "left", "right", "middle"]
TruncateSide = Literal["left", "middle", "right"]
MalformedMode = Literal["error", "skip"]
OldLogProbMode = Literal["auto", "recompute"]
RouterReplayMode = Literal["none", "rollout"]
# Where a role runs: on the training ranks (vLLM: in the training processes, the hybrid engine; the teacher:
# processes of its own on the training GPUs) or on ranks of its own (a pool beside the trainer's).
PlacementMode = Literal["colocated", "disaggregated"]
# Every seed a config sets, and each one hybridrl derives (per request, per layer): in [0, 2**31). numpy's generators,
# which megatron's and vLLM's seeding reach, take [0, 2**32), and megatron adds per-rank offsets.
SEED_RANGE = 2**31
CUSTOM_REWARD_NAME = "compute_score"  # verl's name for a custom reward function
# How far generation runs ahead of training (disaggregated only): not at all, one step, continuously.
AsyncMode = Literal["sync", "one_step_off", "fully_async"]
# fully_async: what happens to a sample older than rollout.max_staleness when the trainer reaches it.
StaleSamples = Literal["drop", "keep"]
# on-policy distillation's signal: the sampled token's reverse KL as its advantage, or the teacher's top-k
# distribution at each response position as a forward-KL loss term of the update
DistillationLoss = Literal["sampled_reverse_kl", "top_k_forward_kl", "full_reverse_kl"]
# megatron's moe_router_load_balancing_type values that need no more than the local spec
MoELoadBalancing = Literal["aux_loss", "seq_aux_loss", "none"]
# megatron's MoE token dispatchers that run on the local spec (its "flex" one needs DeepEP / HybridEP)
MoEDispatcher = Literal["alltoall", "allgather"]
# which tokens an expert over its capacity drops: the lowest routing probabilities, or the latest positions
MoEDropPolicy = Literal["probs", "position"]
AdvEstimator = Literal[ADV_ESTIMATOR_NAMES]
LossAggMode = Literal[LOSS_AGG_MODES]
KlEstimator = Literal[KL_PENALTY_NAMES]
KlControllerKind = Literal[KL_CONTROLLER_KINDS]
RolloutIsLevel = Literal[ROLLOUT_IS_LEVELS]
RolloutMaskLevel = Literal[ROLLOUT_MASK_LEVELS]
LoraType = Literal[LORA_TYPES]  # hybridrl.models.lora_targets
LoraAInit = Literal[A_INIT_METHODS]
LoraBInit = Literal["zero"]
LoraDropoutPosition = Literal["pre", "post"]

CHOICE_NAMES: dict[Any, str] = {
    Device: "device", Dtype: "dtype", LoggerName: "logger", RolloutEngineName: "rollout engine",
    Strategy: "training strategy", OptimizerName: "optimizer", LrDecayStyle: "LR schedule",
    Truncation: "truncation mode", TruncateSide: "truncation side", MalformedMode: "malformed-row policy",
    OldLogProbMode: "old log-prob mode",
    RouterReplayMode: "router replay mode", PlacementMode: "placement mode", AsyncMode: "async mode",
    StaleSamples: "stale-sample policy",
    AdvEstimator: "advantage estimator", LossAggMode: "loss aggregation mode", KlEstimator: "KL estimator",
    KlControllerKind: "KL controller", RolloutIsLevel: "rollout IS level", RolloutMaskLevel: "rollout mask level",
    MoEDispatcher: "MoE token dispatcher", MoEDropPolicy: "MoE token drop policy",
}


def without_none(hint: Any) -> Any:
    """The type of a field typed `X | None` (X); the hint itself when it is no union; None for a
    union of several types."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        return options[0] if len(options) == 1 else None
    return hint


def choices_of(hint: Any) -> tuple[Any, bool] | None:
    """(the Literal, whether the field is a list of it) for a field typed with a closed vocabulary
    (optionally `| None` or `list[...]`); None for any other field."""
    hint = without_none(hint)
    is_list = typing.get_origin(hint) is list
    if is_list:
        (hint,) = typing.get_args(hint)
    return (hint, is_list) if typing.get_origin(hint) is Literal else None


@functools.cache
def _choice_table(cls: type) -> tuple[tuple[str, tuple[Any, tuple[Any, ...], bool] | None, bool], ...]:
    """(field, (its Literal, the Literal's values, whether a list of them) or None, whether it may hold a config
    section) of each field of a config class, once per class: resolving the types is most of validation's time,
    and `hybridrl plan --search` validates hundreds of configs."""
    hints = typing.get_type_hints(cls)

    def may_hold_section(hint: Any) -> bool:
        return any(dataclasses.is_dataclass(t) for t in (hint, *typing.get_args(hint)))

    def closed(hint: Any) -> tuple[Any, tuple[Any, ...], bool] | None:
        found = choices_of(hint)
        return None if found is None else (found[0], typing.get_args(found[0]), found[1])

    return tuple((f.name, closed(hints[f.name]), may_hold_section(hints[f.name])) for f in dataclasses.fields(cls))


def closed_fields(root: Any, prefix: str = "") -> list[tuple[str, Any, tuple[Any, ...], Any]]:
    """(dotted path, Literal, its values, value) of every closed-vocabulary field in a config tree, list items
    as `path[i]`; sections that are None (e.g. an unset ref layout) have no fields."""
    out: list[tuple[str, Any, tuple[Any, ...], Any]] = []
    for name, found, section in _choice_table(type(root)):
        value = getattr(root, name)
        if section and dataclasses.is_dataclass(value):
            out += closed_fields(value, f"{prefix}{name}.")
            continue
        if found is None or value is None:
            continue
        literal, values, is_list = found
        path = f"{prefix}{name}"
        if is_list and isinstance(value, list):
            out += [(f"{path}[{i}]", literal, values, item) for i, item in enumerate(value)]
        else:
            out.append((path, literal, values, value))
    return out


def choice_fields(root: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted path, Literal, value) of every closed-vocabulary field (`closed_fields` without the values)."""
    return [(path, literal, value) for path, literal, _, value in closed_fields(root, prefix)]


def doc(default: Any = None, text: str = "", *, factory: Any = None) -> Any:
    """A dataclass field with a default and a one-line description kept in its metadata."""
    if factory is not None:
        return field(default_factory=factory, metadata={"doc": text})
    return field(default=default, metadata={"doc": text})


# --------------------------------------------------------------------------------------- data
@dataclass
class DataConfig:
    train_files: list[str] = doc(factory=list, text="local parquet/JSONL files with training prompts")
    val_files: list[str] = doc(factory=list, text="local parquet/JSONL files for validation")
    prompt_key: str = doc("prompt", "column holding the prompt (text or chat messages)")
    reward_key: str = doc("reward_model", "column holding the reward spec (e.g. ground truth)")
    max_prompt_length: int = doc(512, "prompt tokens kept; longer prompts are filtered or truncated")
    max_response_length: int = doc(512, "response tokens generated at most")
    train_batch_size: int = doc(1024, "prompts per training step (each sampled rollout.n times)")
    val_batch_size: int | None = doc(None, "prompts per validation batch; None = whole val set")
    shuffle: bool = doc(True, "shuffle the training prompts each epoch (deterministic from the seed)")
    apply_chat_template: bool | None = doc(
        None, "format prompts with the tokenizer's chat template: null = chat-message prompts (verl's format) are "
              "formatted and text prompts kept as they are; true = text prompts too, as one user message; "
              "false = never (chat-message prompts are refused)")
    filter_overlong_prompts: bool = doc(True, "drop prompts longer than max_prompt_length (counted)")
    truncation: Truncation = doc("error", "over-long prompts when not filtered: refuse, or cut on the left/right, or "
                                           "in the middle (verl's: the first and last halves kept)")
    on_malformed: MalformedMode = doc("error", "rows without a usable prompt: error names file, row; skip counts")


# ------------------------------------------------------------------------------------- models
@dataclass
class LoraConfig:
    """verl's `model.lora` (its Megatron path, Megatron-Bridge's names): adapters on the actor; rank 0 = off."""

    rank: int = doc(0, "LoRA rank r (0 = no adapters: the whole model trains)")
    alpha: float = doc(32.0, "scaling numerator: an adapter adds (alpha / rank) B A x")
    type: LoraType = doc("lora", "lora: one adapter per megatron layer (fused qkv and fc1 each one A and B); "
                                 "canonical_lora: one per Hugging Face projection (q, k, v, gate, up their own)")
    target_modules: list[str] = doc(
        factory=list,
        text="layers to adapt: linear_qkv, linear_proj, linear_fc1, linear_fc2 (type lora); linear_q, linear_k, "
             "linear_v, linear_proj, linear_fc1_gate, linear_fc1_up, linear_fc2 (canonical_lora); empty = every "
             "one of the type's (verl's default list for lora, all seven for canonical_lora)")
    exclude_modules: list[str] = doc(factory=list, text="adapt every target of the type but these (target_modules "
                                                        "must then be empty)")
    dropout: float = doc(0.0, "dropout on an adapter's input while training")
    dropout_position: LoraDropoutPosition = doc("pre", "where dropout acts: pre (on the adapter's input; post is "
                                                       "refused: not built)")
    lora_A_init_method: LoraAInit = doc("xavier", "A's first values: xavier (xavier_uniform_) or kaiming "
                                                  "(kaiming_uniform_ with a = sqrt(5), peft's); B starts at zero")
    lora_B_init_method: LoraBInit = doc("zero", "B's first values (zero: the adapted model starts as the base)")
    merge: bool = doc(True, "the weight sync merges the adapters into the weights vLLM serves (W + (alpha / rank) "
                            "B A, through the resharder); false (verl's default): vLLM serves the adapters itself, "
                            "the base written once and each later sync moving the adapters alone (colocated "
                            "rollouts, rank <= 512)")
    dtype: Dtype | None = doc(None, "the adapters' parameter dtype: null = fp32 (they train in fp32 whatever the "
                                    "model's dtype; verl: the model's), fp32; others refused")
    adapter_path: str | None = doc(None, "a Hugging Face PEFT adapter folder to start from (adapter_config.json, "
                                         "adapter_model.safetensors); null = fresh adapters")
    a2a_experimental: bool = doc(False, "Megatron-Bridge's all-to-all adapter communication (not built: false only)")
    freeze_vision_model: bool = doc(True, "vision-language models' vision tower stays frozen (text models have "
                                          "none: true only)")
    freeze_vision_projection: bool = doc(True, "the vision projection stays frozen (text models: true only)")

    @property
    def targets(self) -> tuple[str, ...]:
        """The layers adapted: target_modules, or (verl's exclude form) every target of the type but the excluded."""
        if self.target_modules:
            return tuple(self.target_modules)
        return tuple(t for t in TARGETS.get(self.type, {}) if t not in self.exclude_modules)


@dataclass
class ModelConfig:
    path: str = doc("", "local Hugging Face folder (config.json + safetensors)")
    tokenizer_path: str | None = doc(None, "tokenizer folder; None = model path")
    trust_remote_code: bool = doc(False, "allow custom modelling code from the model folder")
    enable_gradient_checkpointing: bool = doc(False, "recompute activations in backward (full recompute)")
    use_remove_padding: bool | None = doc(
        None, "pack each micro-batch's rows into one sequence without padding (megatron THD, cu_seqlens) in "
              "every training and log-prob/value pass of the roles built from this model; null = on where the "
              "device serves packed attention (cpu: the CPU layer's stand-in; cuda: TransformerEngine's, which "
              "the gpu extra installs) unless a MoE layout's allgather or drop-and-pad dispatch spans DP ranks "
              "(it needs equal-width micro-batches), false = padded micro-batches")
    shared_prefix: bool | None = doc(
        None, "packed micro-batches hold a prompt once for all of their rows that share it (GRPO's n samples "
              "of a prompt): one segment [prompt, response_1, ..., response_k], each response attending to the "
              "prompt and causally to itself at its own positions; the same log-probs, loss and gradients as "
              "each row alone, on fewer tokens. null = on where served (packed, the CPU layer's attention "
              "stand-in, context_parallel_size 1, a dense model), true where it is not is refused")
    lora: LoraConfig = doc(factory=LoraConfig, text="LoRA adapters (actor_rollout_ref.model only)")


@dataclass
class MegatronConfig:
    tensor_model_parallel_size: int = doc(1, "TP: each layer's matrices split over this many GPUs")
    pipeline_model_parallel_size: int = doc(1, "PP: layers split into this many stages")
    virtual_pipeline_model_parallel_size: int | None = doc(None, "VPP: model chunks per stage (interleaved 1F1B)")
    num_layers_in_first_pipeline_stage: int | None = doc(
        None, "uneven PP (megatron's field): decoder layers on the first stage; null = the even share of the "
              "layers the set first/last stages leave (e.g. fewer layers on the last stage, which also holds "
              "the output layer)")
    num_layers_in_last_pipeline_stage: int | None = doc(
        None, "uneven PP: decoder layers on the last stage; null = the even share, as for the first stage")
    context_parallel_size: int = doc(1, "CP: each sequence split over this many GPUs")
    expert_model_parallel_size: int = doc(1, "EP (MoE models): each MoE layer's experts split over this many "
                                          "GPUs, inside the DP × CP span")
    expert_tensor_parallel_size: int | None = doc(None, "ETP (MoE models): each expert's matrices split over this "
                                                  "many GPUs (megatron's expert mesh: EP × ETP within DP × CP × TP); "
                                                  "None = tensor_model_parallel_size; another value needs TP 1 so far")
    moe_router_load_balancing_type: MoELoadBalancing = doc(
        "aux_loss", "MoE models: megatron's router load-balancing loss (aux_loss: over each micro-batch, "
        "seq_aux_loss: per sequence, none = off whatever the coefficient); it acts only with a coefficient > 0")
    moe_aux_loss_coeff: float | None = doc(
        None, "MoE models: weight of the load-balancing loss (0 = off; actor/moe_aux_loss is logged when it is on); "
        "null = the model's config.json: its router_aux_loss_coef where it sets output_router_logits: true "
        "(transformers adds the loss to training only then), else off. hybridrl plan prints which one is used")
    moe_z_loss_coeff: float | None = doc(None, "MoE models: weight of the router z-loss (None = off)")
    moe_token_dispatcher_type: MoEDispatcher = doc(
        "alltoall", "MoE models: megatron's token dispatcher (alltoall: all-to-all over EP, variable sizes; "
        "allgather: every rank gathers the TP x EP group's tokens, the fallback; it needs equal micro-batch "
        "shapes across that group, so micro-batches are padded to the batch's full width where the group spans "
        "DP ranks, and it refuses PP > 1)")
    moe_expert_capacity_factor: float | None = doc(
        None, "MoE models: megatron's expert capacity, as a factor of an even share (each expert takes at most "
        "ceil(tokens x top-k / experts x factor) tokens of a micro-batch, padding included; the rest are dropped: "
        "actor/moe_dropped_token_fraction); None = no capacity, no token dropped. vLLM never drops, so the "
        "trainer's log-probs then differ from the rollout's where tokens drop (the sync's probe runs without it)")
    moe_token_drop_policy: MoEDropPolicy = doc(
        "probs", "MoE models with a capacity factor: an expert over its capacity keeps the tokens with the highest "
        "routing probabilities (probs) or the earliest positions (position)")
    moe_pad_expert_input_to_capacity: bool = doc(
        False, "MoE models with a capacity factor: pad every expert's input to its capacity (static shapes; the "
        "same numbers as without the padding)")
    sequence_parallel: bool = doc(False, "shard norms/dropout activations over TP (needs TP > 1)")
    use_distributed_optimizer: bool = doc(True, "shard optimizer states over data-parallel ranks (ZeRO-1)")
    make_vocab_size_divisible_by: int = doc(128, "vocab padded to a multiple of this × TP, as megatron does")
    param_offload: bool = doc(False, "keep parameters on CPU between phases")
    optimizer_offload: bool = doc(False, "keep optimizer states on CPU between phases")
    grad_offload: bool = doc(False, "keep gradients on CPU between phases")
    dtype: Dtype | None = doc(None, "compute dtype; None = bf16 on cuda, fp32 on cpu")
    seed: int = doc(1234, "model-parallel RNG seed")
    override_transformer_config: dict[str, Any] = doc(
        factory=dict, text="megatron TransformerConfig fields set as given (verl's key), e.g. activation recompute: "
        "recompute_granularity full|selective, recompute_method uniform|block, recompute_num_layers; each name and "
        "value checked against megatron-core's TransformerConfig; fields hybridrl sets from the model, the layout "
        "or the device are refused, those with a hybridrl field of their own are read as it")

    override_ddp_config: dict[str, Any] = doc(
        factory=dict, text="megatron DistributedDataParallelConfig fields set as given (verl's key), e.g. "
        "overlap_grad_reduce, overlap_param_gather, bucket_size: each name and value checked against megatron-core's; "
        "on cuda the overlaps are on by default where they apply (hybridrl plan lists them), false turns one off")

    @property
    def sequence_parallel_in_effect(self) -> bool:
        """`sequence_parallel` as megatron applies it: only with TP > 1 (a validated config's sizes)."""
        return bool(self.sequence_parallel) and self.tensor_model_parallel_size > 1


@dataclass
class OptimConfig:
    optimizer: OptimizerName = doc("adam", "optimizer")
    lr: float = doc(1e-6, "peak learning rate")
    min_lr: float = doc(0.0, "floor of the decay schedule")
    lr_warmup_steps: int = doc(-1, "linear warmup optimizer steps; -1 = use lr_warmup_steps_ratio")
    lr_warmup_steps_ratio: float = doc(0.0, "warmup as a fraction of all optimizer steps")
    lr_warmup_init: float = doc(0.0, "the learning rate the linear warmup rises from, to lr (verl's and megatron's "
                                     "init_lr); the first warmup step already takes one step of the rise")
    lr_decay_style: LrDecayStyle = doc("constant", "LR decay after warmup")
    weight_decay: float = doc(0.01, "decoupled weight decay (AdamW)")
    betas: list[float] = doc(factory=lambda: [0.9, 0.999], text="Adam betas")
    eps: float = doc(1e-8, "Adam epsilon")
    clip_grad: float = doc(1.0, "global gradient-norm clip; 0 disables")
    override_optimizer_config: dict[str, Any] = doc(
        factory=dict, text="megatron OptimizerConfig fields set as given (verl's key), e.g. optimizer_cpu_offload, "
        "optimizer_offload_fraction (cuda); each name and value checked against megatron-core's OptimizerConfig; "
        "fields hybridrl sets from this section, the dtype or the layout are refused")


@dataclass
class ActorConfig:
    strategy: Strategy = doc("megatron", "training backend")
    megatron: MegatronConfig = doc(factory=MegatronConfig, text="training layout")
    optim: OptimConfig = doc(factory=OptimConfig, text="optimizer and LR schedule")
    ppo_mini_batch_size: int = doc(256, "prompts per optimizer step (× rollout.n sequences)")
    ppo_micro_batch_size_per_gpu: int = doc(4, "sequences per forward/backward on one GPU")
    use_dynamic_bsz: bool = doc(False, "form micro-batches by token count instead of sequence count")
    ppo_max_token_len_per_gpu: int = doc(16384, "token budget per micro-batch when use_dynamic_bsz")
    ppo_epochs: int = doc(1, "passes over each step's data")
    old_log_prob: OldLogProbMode = doc("auto", "old log-prob pass: auto = skip it when the step's update is one "
                            "optimizer step on data the current weights generated (the ratio is then "
                            "exactly 1 and the update's own forward gives the same log-probs); "
                            "recompute = always run it")
    router_replay: RouterReplayMode = doc("none", "MoE routing in the training forward: none = megatron's "
                                  "routers choose; rollout = the old-log-prob and update forwards route each token to "
                                  "the experts vLLM routed it to in the rollout (the sync's probe routes freely); "
                                  "single-turn, any inference TP, no sequence/context parallelism or activation "
                                  "recompute")
    shuffle: bool = doc(False, "shuffle sequences between PPO epochs")
    clip_ratio: float = doc(0.2, "PPO clip epsilon (default for clip_ratio_low/high)")
    clip_ratio_low: float | None = doc(None, "lower clip epsilon; None = clip_ratio")
    clip_ratio_high: float | None = doc(None, "upper clip epsilon (DAPO clip-higher); None = clip_ratio")
    clip_ratio_c: float | None = doc(3.0, "dual-clip bound for negative advantages (> 1); None disables")
    loss_agg_mode: LossAggMode = doc("token-mean", "how token losses become one number (see algorithms)")
    entropy_coeff: float = doc(0.0, "entropy bonus coefficient")
    use_kl_loss: bool = doc(False, "add KL(actor || ref) to the loss (GRPO style)")
    kl_loss_coef: float = doc(0.001, "coefficient of the KL loss")
    kl_loss_type: KlEstimator = doc("low_var_kl", "KL estimator (kl = k1, mse = k2, low_var_kl = k3)")


@dataclass
class SamplingConfig:
    n: int = doc(1, "samples per prompt")
    temperature: float = doc(0.0, "sampling temperature; 0 = greedy")
    top_p: float = doc(1.0, "nucleus sampling mass")
    top_k: int = doc(-1, "top-k sampling; -1 disables")
    do_sample: bool = doc(False, "sample (True) or decode greedily (False)")


@dataclass
class SandboxConfig:
    isolation: SandboxIsolation = doc(
        "namespaces", "python tool: namespaces = an OS sandbox (bubblewrap namespaces, seccomp, "
                      "kernel limits; hybridrl/tool_calling/sandbox.py), refused at plan time where the kernel cannot "
                      "give one; none = a plain subprocess with limits and a Python audit hook, NOT a boundary "
                      "against hostile code (warned on every run)")
    wall_time_s: float = doc(10.0, "python tool: wall-time limit of one run (the process group is killed)")
    cpu_time_s: int = doc(5, "python tool: CPU-time limit of one run (RLIMIT_CPU)")
    memory_mb: int = doc(512, "python tool: address-space limit in MiB (RLIMIT_AS)")
    max_file_mb: int = doc(16, "python tool: largest file it may write, MiB (RLIMIT_FSIZE)")
    max_output_bytes: int = doc(8192, "python tool: stdout and stderr each cut to this many bytes")


@dataclass
class TurnRewardConfig:
    tool_error_penalty: float = doc(0.0, "subtracted from a model turn's reward for each of its tool calls that "
                                         "failed (any status but ok); >= 0")
    path: str | None = doc(None, "Python file with a per-turn reward function (trusted code); None = none")
    name: str = doc("turn_reward", "that function's name: fn(turn: hybridrl.rollout.turn_rewards.ModelTurn) -> float")


@dataclass
class MultiTurnConfig:
    enable: bool = doc(False, "multi-turn tool-calling rollouts (hybridrl/rollout/agent_loop.py); the response "
                              "is the whole conversation (response_length tokens), observation tokens untrained")
    max_turns: int | None = doc(5, "model turns per sample before the rollout stops; null = no limit but the "
                                   "response budget (verl's max_assistant_turns=null)")
    tools: list[str] = doc(factory=list, text="tools offered to the model: built in (calculator, python) or "
                                              "defined in tools_file")
    tool_parser: str = doc("hermes", "how tool calls are read from a model turn (hybridrl.tool_calling parsers)")
    tools_file: str | None = doc(None, "Python file defining TOOL_SCHEMAS and their functions (trusted code)")
    max_observation_chars: int = doc(4096, "a tool's answer is cut to this many characters, plus a note saying so "
                                           "(verl's max_tool_response_length)")
    observation_truncate_side: TruncateSide = doc(
        "right", "which characters of a longer tool answer are kept: right = the first max_observation_chars, "
                 "left = the last, middle = the first and last half each (verl's tool_response_truncate_side)")
    max_parallel_calls: int | None = doc(
        None, "tool calls run per model turn, the first ones written; later ones are not run and get no "
              "answer, as in verl; null = all (verl's max_parallel_calls, whose default is 1)")
    tool_timeout_s: float | None = doc(
        None, "tools file tools: each call runs in a process of its own, killed past this many seconds (state "
              "a call changes is not kept); None = in the rollout worker, without a limit")
    sandbox: SandboxConfig = doc(factory=SandboxConfig, text="limits of the python tool's sandbox")
    turn_reward: TurnRewardConfig = doc(
        factory=TurnRewardConfig, text="per-turn rewards, on each model turn's last token, added to "
                                       "token_level_scores (outcome estimators see the sum)")


@dataclass
class RolloutConfig:
    name: RolloutEngineName = doc("vllm", "rollout engine")
    tensor_model_parallel_size: int = doc(1, "inference TP: GPUs per vLLM replica")
    n: int = doc(1, "samples per prompt (GRPO group size)")
    temperature: float = doc(1.0, "sampling temperature")
    top_p: float = doc(1.0, "nucleus sampling mass")
    top_k: int = doc(-1, "top-k sampling; -1 disables")
    response_length: int | None = doc(None, "max new tokens; None = data.max_response_length")
    stop_token_ids: list[int] = doc(factory=list, text="extra token ids that end a response")
    ignore_eos: bool = doc(False, "keep sampling past EOS (full-length responses, e.g. for benchmarks)")
    dtype: Dtype | None = doc(None, "rollout dtype; None = bf16 on cuda, fp32 on cpu")
    gpu_memory_utilization: float = doc(0.5, "fraction of GPU memory vLLM may use (weights + KV cache)")
    cpu_kv_cache_gib: float | None = doc(
        None, "CPU only: KV cache of each vLLM rank in GiB; None = enough for one replica's whole rollout "
              "batch at full length (generation in one wave)")
    enforce_eager: bool | None = doc(
        None, "None = CUDA graphs on cuda (faster decoding), eager on cpu (no graphs there); "
              "true = no CUDA graphs (faster start, less memory)")
    probe_tolerance: float | None = doc(
        None, "the sync's log-prob probe (trainer vs every vLLM replica) stops training above this max abs gap; "
              "None = 1e-4 when training and rollout are fp32 (1e-2 with merged LoRA adapters, whose rounding "
              "differs from the trainer's), else 0.5 (bf16 round-off ~0.1, a wrong layout >= 2)")
    update_weights_bucket_megabytes: int = doc(
        512, "weight sync: MiB of shards gathered and handed to vLLM at a time (bounds the sync's extra memory)")
    free_cache_engine: bool | None = doc(
        None, "colocated: sleep vLLM (free KV cache and weights) while training; None = true colocated (a "
              "disaggregated rollout has its GPUs to itself: setting it there is refused)")
    max_num_batched_tokens: int = doc(8192, "vLLM scheduler token budget per step")
    max_num_seqs: int = doc(1024, "vLLM scheduler sequence budget")
    log_prob_micro_batch_size_per_gpu: int = doc(8, "sequences per old-log-prob forward on one GPU")
    log_prob_use_dynamic_bsz: bool | None = doc(
        None, "old-log-prob micro-batches by token count; null = actor.use_dynamic_bsz (verl's default)")
    log_prob_max_token_len_per_gpu: int | None = doc(
        None, "old-log-prob token budget per micro-batch when dynamic; null = actor.ppo_max_token_len_per_gpu")
    calculate_log_probs: bool = doc(True, "return the rollout's own per-token log-probs")
    val_kwargs: SamplingConfig = doc(factory=SamplingConfig, text="sampling for validation (greedy by default)")
    seed: int = doc(0, "base seed of sampling requests")
    multi_turn: MultiTurnConfig = doc(factory=MultiTurnConfig, text="tool-calling conversations (agent loop)")
    mode: PlacementMode = doc("colocated", "colocated = vLLM in the training processes (hybrid engine, weights "
                                         "resharded in place); disaggregated = vLLM on its own ranks (nnodes × "
                                         "n_gpus_per_node), weights sent across the pools after each update")
    nnodes: int = doc(1, "disaggregated: machines of the rollout pool")
    n_gpus_per_node: int | None = doc(None, "disaggregated: rollout ranks per machine (required there)")
    async_mode: AsyncMode = doc(
        "sync", "disaggregated only: sync = generate, then train; one_step_off = generate step k+1 while step k "
                "trains (samples one weight version old); fully_async = the rollout pool generates continuously "
                "into a buffer the trainer draws from (max_staleness bounds how old)")
    max_staleness: int | None = doc(
        None, "fully_async: a sample whose oldest token is more than this many weight versions behind the "
              "policy it is trained on is stale; None = 1")
    stale_samples: StaleSamples | None = doc(
        None, "fully_async: drop stale samples (counted) or keep them (counted); None = drop")
    partial_rollout: bool | None = doc(
        None, "fully_async: at a weight sync, requests in flight are paused and continue under the new "
              "weights (each token tagged with its version); false = finish them on the old weights first; "
              "None = true")


# The reference runs in the actor's processes (one megatron parallel state): these layout fields of
# `actor_rollout_ref.ref.megatron` must equal the actor's, and default to them (verl's interpolation).
REF_SHARES_WITH_ACTOR = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                         "virtual_pipeline_model_parallel_size", "num_layers_in_first_pipeline_stage",
                         "num_layers_in_last_pipeline_stage", "expert_model_parallel_size",
                         "expert_tensor_parallel_size", "seed")
# ... and these settings of its model default to the actor's too (a ref section written for its offload keeps the
# actor's dtype, sequence parallelism and megatron overrides, as verl's ref config interpolates the overrides), but
# may differ: the reference is a model of its own (with LoRA it is not: `config.lora_rules`).
REF_DEFAULTS_TO_ACTOR = ("dtype", "sequence_parallel", "override_transformer_config")


@dataclass
class RefConfig:
    megatron: MegatronConfig | None = doc(None, "reference layout; None = same as the actor")
    log_prob_micro_batch_size_per_gpu: int = doc(8, "sequences per ref-log-prob forward on one GPU")
    log_prob_use_dynamic_bsz: bool | None = doc(
        None, "ref-log-prob micro-batches by token count; null = actor.use_dynamic_bsz (verl's default)")
    log_prob_max_token_len_per_gpu: int | None = doc(
        None, "ref-log-prob token budget per micro-batch when dynamic; null = actor.ppo_max_token_len_per_gpu")


@dataclass
class ActorRolloutRefConfig:
    model: ModelConfig = doc(factory=ModelConfig, text="the policy model")
    actor: ActorConfig = doc(factory=ActorConfig, text="policy training")
    rollout: RolloutConfig = doc(factory=RolloutConfig, text="generation with vLLM")
    ref: RefConfig = doc(factory=RefConfig, text="frozen reference policy")


@dataclass
class CriticConfig:
    enable: bool | None = doc(None, "train a critic; None = only when adv_estimator is gae")
    model: ModelConfig = doc(factory=ModelConfig, text="critic backbone; empty path = the actor's model")
    megatron: MegatronConfig = doc(factory=MegatronConfig, text="critic layout")
    optim: OptimConfig = doc(factory=lambda: OptimConfig(lr=1e-5), text="critic optimizer")
    ppo_mini_batch_size: int | None = doc(None, "prompts per critic optimizer step; None = actor's")
    ppo_micro_batch_size_per_gpu: int = doc(4, "sequences per critic forward/backward on one GPU")
    ppo_epochs: int | None = doc(None, "critic passes per step; None = actor's")
    cliprange_value: float = doc(0.5, "value clip range around the old values")
    loss_agg_mode: LossAggMode = doc("token-mean", "aggregation of the value loss")


@dataclass
class RewardModelConfig:
    enable: bool = doc(False, "score responses with a reward model worker")
    model: ModelConfig = doc(factory=ModelConfig, text="sequence-classification checkpoint")
    megatron: MegatronConfig = doc(factory=MegatronConfig, text="reward model layout")
    micro_batch_size_per_gpu: int = doc(8, "sequences per reward-model forward on one GPU")


@dataclass
class TeacherConfig:
    """On-policy distillation's teacher (`algorithm.distillation`): a frozen causal LM with its own layout that
    scores the student's sampled tokens, in processes of its own on the training GPUs (as the critic and reward
    model) or on a pool of ranks of its own (`mode: disaggregated`, e.g. a teacher too large to share them)."""

    model: ModelConfig = doc(factory=ModelConfig, text="the teacher's HF folder (the policy's tokenizer)")
    megatron: MegatronConfig = doc(factory=MegatronConfig, text="teacher layout")
    log_prob_micro_batch_size_per_gpu: int = doc(8, "sequences per teacher-log-prob forward on one GPU")
    log_prob_use_dynamic_bsz: bool | None = doc(
        None, "teacher-log-prob micro-batches by token count; null = actor.use_dynamic_bsz")
    log_prob_max_token_len_per_gpu: int | None = doc(
        None, "teacher-log-prob token budget per micro-batch when dynamic; null = actor.ppo_max_token_len_per_gpu")
    mode: PlacementMode = doc("colocated", "colocated = on the training GPUs, beside the actor; disaggregated = on "
                                           "ranks of its own (nnodes × n_gpus_per_node), its layout over them")
    nnodes: int = doc(1, "disaggregated: machines of the teacher's pool")
    n_gpus_per_node: int | None = doc(None, "disaggregated: teacher ranks per machine (required there)")


@dataclass
class CustomRewardConfig:
    path: str | None = doc(None, "Python file with a reward function (trusted code)")
    name: str = doc(CUSTOM_REWARD_NAME, "function name in that file")
    reward_kwargs: dict[str, Any] = doc(
        factory=dict, text="keyword arguments passed to the function on every call, beside the sample's own "
                           "(verl's key), e.g. {format_weight: 0.1}")
    fallback_score: float | None = doc(None, "score for a sample whose scorer raises, returns NaN or times out; "
                                             "None = stop the run naming it")
    timeout_s: float | None = doc(
        300.0, "seconds each reward call may take (verl's reward_model.timeout), the rule scorers' too: calls run in a "
               "process of their own, killed past it, and the sample scores fallback_score (reward/timeouts); "
               "null = no limit, calls run in the trainer's process")
    num_workers: int = doc(
        1, "reward processes that score a batch's calls at once, each call under timeout_s (so timeout_s may not be "
           "null); 1 = one after another. A CPU-bound function (math-verify, running code) gains up to the trainer "
           "machine's cores, one that waits (a sandbox service, a judge) beyond them; an async def function's batch "
           "is split into num_workers shares, each awaited together. verl's reward_model.reward_manager=prime sets "
           "min(64, cores) where the job does not set it")


@dataclass
class KLControlConfig:
    type: KlControllerKind = doc("fixed", "KL coefficient: fixed, or adapted towards target_kl")
    kl_coef: float = doc(0.001, "initial KL coefficient")
    target_kl: float = doc(0.1, "adaptive: the KL to steer towards")
    horizon: int = doc(10000, "adaptive: steps over which the coefficient adapts")


@dataclass
class FilterGroupsConfig:
    enable: bool = doc(False, "DAPO dynamic sampling: drop groups whose samples all scored the same")
    max_num_gen_batches: int = doc(4, "generation rounds per step to fill the batch (then zero-spread groups)")


@dataclass
class OverlongBufferConfig:
    enable: bool = doc(False, "DAPO soft overlong punishment")
    len: int = doc(64, "tokens before max_response_length where the penalty starts")
    penalty_factor: float = doc(1.0, "penalty at max_response_length (linear from 0 over the buffer)")
    max_response_length: int | None = doc(
        None, "the length the buffer ends at (verl's reward_kwargs.max_resp_len); null = data.max_response_length")


@dataclass
class RolloutCorrectionConfig:
    """Rollout-mismatch correction of the PPO/GRPO policy loss (`hybridrl.algorithms.rollout_correction`).

    The ratio is rho = pi_old / mu per response token: mu the rollout engine's own log-prob of the
    sampled token (`rollout_log_probs`, the behaviour policy), pi_old the trainer's old policy (the
    old-log-prob pass; without that pass the update's own forward, detached, which is the old policy
    exactly), under the rollout's top-k/top-p truncation with `match_truncation`. Off by default.
    """

    is_level: RolloutIsLevel = doc(
        "none", "truncated importance sampling (TIS): each token's policy-gradient loss times min(rho, is_cap); "
                "token = the token's own ratio, sequence = the product of the sequence's ratios; none = off")
    is_cap: float = doc(2.0, "TIS cap C (>= 1): the weight is min(rho, C)")
    mask_level: RolloutMaskLevel = doc(
        "none", "masked IS (MIS): no policy gradient where rho leaves [mask_low, mask_high]: token = that token, "
                "sequence = the whole sequence by the product of its ratios, geometric = by their geometric "
                "mean; masked tokens still count in the loss's token/sequence normalizers; none = off")
    mask_low: float = doc(0.5, "MIS: lowest kept ratio, in [0, 1)")
    mask_high: float = doc(2.0, "MIS: highest kept ratio, > 1")
    match_truncation: bool = doc(
        False, "with rollout.top_k/top_p set: rho's pi_old is taken under the same truncation as vLLM's log-probs "
               "(top-k, then top-p, renormalized; hybridrl.algorithms.truncation); PPO's ratio keeps the whole "
               "vocabulary. Needed to correct a truncated rollout: false refuses is_level/mask_level there")


@dataclass
class DistillationConfig:
    """On-policy distillation (`hybridrl.algorithms.distillation`): the student (the actor) samples, the teacher
    scores every sampled token, and the per-token reverse KL log pi_student(y_t) - log pi_teacher(y_t) is the
    signal: each model token's advantage gains -kl_coef times it (no discount, as Thinking Machines' recipe)."""

    enable: bool = doc(False, "distil from the `teacher` model (teacher.model.path) on the student's own samples")
    loss: DistillationLoss = doc(
        "sampled_reverse_kl", "sampled_reverse_kl = the sampled token's reverse KL as its advantage (the policy "
        "gradient); top_k_forward_kl = at every response position, KL(teacher's top-k || student) on the teacher's "
        "top_k tokens, a loss term of the update (GKD's and verl's recipe: the student sees what the teacher would "
        "have written, not only its view of the student's own tokens); full_reverse_kl = at every response "
        "position, KL(student || teacher) summed over the whole vocabulary, a loss term of the update (the exact "
        "per-position reverse KL whose sampled estimate sampled_reverse_kl is; the teacher ships its whole "
        "distribution, so refused above 4 GiB a step)")
    kl_coef: float = doc(1.0, "weight of the distillation signal: of the reverse KL in the advantage, or of the "
                              "top-k or full-vocabulary loss term (> 0)")
    top_k: int | None = doc(None, "top_k_forward_kl: the teacher's tokens per position; None = 32")
    task_reward: bool = doc(
        False, "true = add the task reward's advantages (adv_estimator on the reward) to the distillation's; "
               "false = pure distillation (the reward is still computed and logged, but not trained on)")


@dataclass
class AlgorithmConfig:
    adv_estimator: AdvEstimator = doc("grpo", "advantage estimator (gae needs a critic)")
    gamma: float = doc(1.0, "discount")
    lam: float = doc(1.0, "GAE lambda")
    norm_adv_by_std_in_grpo: bool = doc(True, "divide by the group std (False = Dr.GRPO)")
    use_kl_in_reward: bool = doc(False, "subtract a KL penalty from the token rewards")
    kl_penalty: KlEstimator = doc("kl", "KL estimator for the in-reward penalty")
    kl_ctrl: KLControlConfig = doc(factory=KLControlConfig, text="KL coefficient controller")
    filter_groups: FilterGroupsConfig = doc(factory=FilterGroupsConfig, text="DAPO dynamic sampling")
    overlong_buffer: OverlongBufferConfig = doc(factory=OverlongBufferConfig, text="DAPO overlong penalty")
    rollout_correction: RolloutCorrectionConfig = doc(
        factory=RolloutCorrectionConfig, text="rollout/trainer mismatch correction of the policy loss (TIS, MIS)")
    reward_fn: str = doc(
        "auto", "rule-based scorer: auto = each row's by its data_source column, as verl's default reward does "
                "(openai/gsm8k -> gsm8k, lighteval/MATH and DigitalLearningGmbH/MATH-lighteval -> math, the demos' "
                "hybridrl/*), so one job mixes datasets; or one scorer name from the rewards registry for every row")
    custom_reward_function: CustomRewardConfig = doc(factory=CustomRewardConfig, text="user reward code")
    distillation: DistillationConfig = doc(
        factory=DistillationConfig, text="on-policy distillation from the teacher (per-token reverse KL)")


@dataclass
class TrainerConfig:
    nnodes: int = doc(1, "machines")
    n_gpus_per_node: int = doc(8, "GPUs per machine (on cpu: ranks per machine)")
    device: Device = doc("cuda", "where the ranks run")
    gpu_memory_gib: float = doc(80.0, "memory per GPU, for the plan's fit check")
    hardware: str | None = doc(
        None, "the GPU, for the plan's predicted step time: a100-80gb, h100-sxm, h200, b200, or a YAML file of the "
              "same fields (docs/performance.md); null = no prediction")
    total_epochs: int = doc(1, "passes over the training prompts")
    total_training_steps: int | None = doc(None, "stop after this many steps; None = epochs × batches")
    save_freq: int = doc(-1, "checkpoint every N steps and at the last; -1 = never")
    test_freq: int = doc(-1, "validate every N steps and after the last; -1 = never")
    val_before_train: bool = doc(False, "validate once before the first step")
    log_val_generations: int = doc(
        0, "at each validation, write this many samples (prompt, response, ground truth, score, the reward "
           "function's extra keys) to "
           "<run dir>/val_generations.jsonl (verl's key); 0 = none")
    default_local_dir: str = doc("checkpoints", "checkpoint root folder (…/<project>/<experiment>/global_step_N)")
    run_dir: str | None = doc(None, "logs, metrics.jsonl, TensorBoard, plot; None = runs/<project>/<experiment>")
    rollout_data_dir: str | None = doc(
        None, "write each step's trained samples (text, token ids, score, reward, advantage, the reward function's "
              "extra keys) to step_N.jsonl here")
    resume_mode: str = doc("auto", "auto | disable | <checkpoint path>")
    keep_last_n: int | None = doc(
        None, "keep this many newest checkpoints, up to the step just saved (a run resumed from an earlier step "
              "leaves the later ones of the run it left until it saves those steps again); None = all")
    export_hf_on_save: bool = doc(False, "also write an HF folder of the actor at each save")
    balance_batch: bool = doc(
        True, "dispatch each training pass's rows so every data-parallel rank gets the same number of rows and "
              "balanced real tokens (each mini-batch keeps its rows; results come back in the batch's order)")
    max_consecutive_nonfinite_steps: int = doc(
        3, "stop after this many steps in a row with a skipped (NaN/Inf loss or grads) optimizer step; 0 = never")
    max_restarts: int = doc(
        0, "on a worker failure, restart the workers in place this many times, each from the last checkpoint "
        "(step 0 before the first); 0 = stop at the first failure")
    restart_wait_s: float = doc(
        600.0, "how long a restart waits for the cluster to offer the workers' resources again (a replaced "
        "node joining), in seconds")
    logger: list[LoggerName] = doc(factory=lambda: ["console"], text="where metrics go")
    project_name: str = doc("hybridrl", "project (wandb / log folder)")
    experiment_name: str = doc("default", "run name")
    seed: int = doc(42, "data order and sampling seed")
    ray_address: str | None = doc(None, "existing Ray cluster; None = RAY_ADDRESS or a local one")
    torch_threads_per_rank: int | None = doc(
        None, "torch intra-op threads in each worker process; None = this machine's cores ÷ its ranks")
    nccl_timeout_s: float = doc(
        1800.0, "process-group timeout (nccl/gloo, megatron's groups too): the longest a rank waits in one "
        "collective, e.g. while rank 0 saves a checkpoint or an HF export")
    step_timeout_s: float = doc(
        3600.0, "the longest one worker call of a step (a generation, a sync, a log-prob pass, an update, a "
        "checkpoint save, the set-up) may take: past it the call counts as hung (a deadlock outside any "
        "collective, which nccl_timeout_s never sees) and the run stops, or restarts with max_restarts, naming "
        "the phase and the ranks that did not answer")

    @property
    def checkpoint_root(self) -> Path:
        """Where the step checkpoints go: default_local_dir/<project>/<experiment> (global_step_N under it)."""
        return Path(self.default_local_dir) / self.project_name / self.experiment_name

    @property
    def run_folder(self) -> Path:
        """Where a run's logs, metrics and failure.log go: run_dir, or runs/<project>/<experiment>."""
        return Path(self.run_dir) if self.run_dir else Path("runs", self.project_name, self.experiment_name)


@dataclass
class JobConfig:
    data: DataConfig = doc(factory=DataConfig, text="prompts")
    actor_rollout_ref: ActorRolloutRefConfig = doc(factory=ActorRolloutRefConfig, text="policy")
    critic: CriticConfig = doc(factory=CriticConfig, text="value model (PPO)")
    reward_model: RewardModelConfig = doc(factory=RewardModelConfig, text="reward model")
    teacher: TeacherConfig = doc(factory=TeacherConfig, text="distillation teacher (algorithm.distillation)")
    algorithm: AlgorithmConfig = doc(factory=AlgorithmConfig, text="RL algorithm")
    trainer: TrainerConfig = doc(factory=TrainerConfig, text="run control")
