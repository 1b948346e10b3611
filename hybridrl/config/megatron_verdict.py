"""megatron-core's own verdict on a role's settings, before any process starts.

`hybridrl plan` checks each `override_transformer_config` name and value against a table generated from
the installed megatron-core (`config/megatron_fields.py`) and applies the rules it knows (activation
recompute, CUDA kernels on cpu). megatron's `TransformerConfig.__post_init__` holds many more (about a
hundred: recompute modules, CPU offloading with pipelines, fp8 recipes, MoE router options ...), which a
worker would otherwise meet at start-up as a traceback. So when a role carries megatron settings of the
user's, the plan builds that role's `TransformerConfig` as its workers will (the model's shape, the layout,
hybridrl's own settings and the user's) and reports what megatron refuses as a problem of the section, in
megatron's words. Two things are left to the workers, which see their own packages: the fusions hybridrl
turns on by itself (`parallel/speed_settings.py`: each one's availability is decided on the worker), and a
refusal that only says a package is missing here (megatron's "Please install TE ..."): the process that
plans need not have TransformerEngine or Apex (`hybridrl doctor` on a worker says whether it does).

Building the config imports megatron-core (seconds): done only for roles whose
`override_transformer_config` is not empty. Nothing is allocated and no CPU stand-in is installed.
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from hybridrl.config.errors import ConfigIssue
from hybridrl.config.schema import MegatronConfig
from hybridrl.models.arch import ModelShape


def moe_aux_loss(megatron: MegatronConfig, model: ModelShape) -> tuple[float, str]:
    """The load-balancing loss coefficient a role built from `model` trains with, and where it comes from (the plan
    prints it): the job's `moe_aux_loss_coeff` when set; else off with `moe_router_load_balancing_type` none; else
    config.json's as transformers trains the model: `router_aux_loss_coef` when `output_router_logits` is true (the
    only case in which transformers adds the loss), off when it is false."""
    if not model.is_moe:
        return 0.0, "a dense model"
    coeff, kind = megatron.moe_aux_loss_coeff, megatron.moe_router_load_balancing_type
    if coeff is not None:
        return float(coeff), "the job's moe_aux_loss_coeff"
    if kind == "none":
        return 0.0, "moe_router_load_balancing_type=none"
    if model.output_router_logits:
        return (model.router_aux_loss_coef, f"config.json's router_aux_loss_coef={model.router_aux_loss_coef:g} with "
                "output_router_logits=true, as transformers trains the model")
    return 0.0, (f"as transformers trains the model: config.json's output_router_logits=false leaves its "
                 f"router_aux_loss_coef={model.router_aux_loss_coef:g} unused")


def role_transformer_settings(megatron: MegatronConfig, model: ModelShape, *, gradient_checkpointing: bool,
                              router_replay: bool) -> dict[str, Any]:
    """The TransformerConfig settings hybridrl gives a role built from `model` itself (the workers' and the plan's
    one source)."""
    moe = model.is_moe
    settings: dict[str, Any] = {
        "variable_seq_lengths": True,
        # Dense models route no tokens; megatron still rejects its default MoE dispatcher
        # ("allgather") together with variable sequence lengths.
        "moe_token_dispatcher_type": "alltoall",
        "sequence_parallel": megatron.sequence_parallel_in_effect,
    }
    if gradient_checkpointing:
        settings.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if moe:
        # The router losses act only in a training forward with gradients (megatron's router), so
        # a frozen role's forward is unchanged by them.
        settings.update(moe_router_load_balancing_type=megatron.moe_router_load_balancing_type,
                        moe_aux_loss_coeff=moe_aux_loss(megatron, model)[0],
                        moe_z_loss_coeff=megatron.moe_z_loss_coeff,
                        moe_token_dispatcher_type=megatron.moe_token_dispatcher_type,
                        moe_expert_capacity_factor=megatron.moe_expert_capacity_factor,
                        moe_token_drop_policy=megatron.moe_token_drop_policy,
                        moe_pad_expert_input_to_capacity=megatron.moe_pad_expert_input_to_capacity)
        if megatron.moe_token_dispatcher_type == "allgather":
            # megatron refuses the allgather dispatcher with variable lengths; at PP 1 (checked) no
            # pipeline stage exchanges activation shapes, so nothing else reads the flag
            settings["variable_seq_lengths"] = False
    if router_replay:
        settings["moe_enable_routing_replay"] = True
    return settings


def megatron_settings(values: Mapping[str, Any]) -> dict[str, Any]:
    """`override_transformer_config` as megatron's TransformerConfig takes it: an enum field's value (written by
    name, e.g. attention_backend: flash) as that enum's member."""
    from megatron.core.transformer import enums

    from hybridrl.config.megatron_fields import TRANSFORMER_CONFIG_FIELDS

    settings = {}
    for name, value in values.items():
        enum_form = next((f for f in TRANSFORMER_CONFIG_FIELDS.get(name, ()) if f.startswith("enum:")), None)
        if enum_form is not None and isinstance(value, str):
            value = getattr(enums, enum_form.split(":")[1])[value]
        settings[name] = value
    return settings


def megatron_refusal(where: str, megatron: MegatronConfig, shape: ModelShape, *, device: str, dtype: str,
                     fixed: Mapping[str, Any]) -> ConfigIssue | None:
    """Build the role's TransformerConfig as its workers will; megatron's refusal as a problem of `where`."""
    from hybridrl.models.bridge import transformer_config
    from hybridrl.parallel.device import default_dtype_for

    user = megatron.override_transformer_config
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # megatron warns about settings it accepts; the plan shows its own
            transformer_config(
                shape, megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size,
                megatron.virtual_pipeline_model_parallel_size, device=device, dtype=default_dtype_for(device, dtype),
                ep=megatron.expert_model_parallel_size, etp=megatron.expert_tensor_parallel_size,
                first_stage_layers=megatron.num_layers_in_first_pipeline_stage,
                last_stage_layers=megatron.num_layers_in_last_pipeline_stage, cpu_stand_ins=False,
                context_parallel_size=megatron.context_parallel_size,
                **{**megatron_settings(user), **fixed})
    except ImportError:
        return None  # a kernel of a package this process lacks (TE's fused permute ...): the workers judge it
    except (ValueError, AssertionError, TypeError, NotImplementedError, KeyError) as error:
        reason = str(error).strip() or type(error).__name__
        if "install" in reason.lower():
            return None  # a package this process lacks; the workers judge with their own
        return ConfigIssue(where, dict(user), f"is refused by megatron-core's TransformerConfig: {reason}")
    return None
