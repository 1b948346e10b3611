"""What an accelerator can do, for the plan's step-time prediction (`config.step_time`): peak matmul throughput per
dtype, memory bandwidth, and the bandwidth of the links between GPUs of one machine and between machines.

Torch-free. Shipped entries are the vendors' published dense (no sparsity) figures for one GPU of an 8-GPU HGX/DGX
machine with a 400 Gb/s (A100: 200 Gb/s) network port per GPU; a user names one (`trainer.hardware`) or writes
their own as a YAML file of the same fields (e.g. a cloud's slower network). Bandwidths are one direction, per GPU:
what one GPU can send while every other sends too (NVLink's and the NIC's per-GPU share).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from hybridrl.config.errors import ConfigError, ConfigIssue
from hybridrl.config.yaml_load import load_yaml


class HardwareError(ValueError):
    """An unknown hardware name, or a description file that is missing, unreadable or incomplete."""


@dataclass(frozen=True)
class Efficiency:
    """Fractions of the hardware's peak each kind of work reaches. Stated, not yet calibrated (issue 46):

    - `update_matmul` 0.40: Megatron-LM's published model-FLOPs utilisation for GPT models on H100 at 8-64 GPUs
      (~40-47 %), rounded down for RL's short sequences;
    - `forward_matmul` 0.45: forward-only passes overlap nothing with a backward but skip the optimizer;
    - `prefill_matmul` 0.50: vLLM's prefill of long prompts is large batched GEMMs;
    - `decode_memory` 0.70: the share of HBM bandwidth vLLM's decode kernels sustain at batch sizes of tens to
      hundreds of sequences;
    - `link` 0.70: NCCL's bus bandwidth against a link's datasheet figure (nccl-tests on NVLink/IB: 70-85 %);
    - `optimizer_memory` 0.50: Adam's fused multi-tensor pass over params, grads and two moments, and the weight
      sync's copy into vLLM's tensors: many tensors of a few MB, not one stream;
    - `stream_memory` 0.85: one pass reading a whole tensor at a time (the weight sync's checksums of each tensor),
      as a STREAM-like kernel reaches of HBM's datasheet figure (1.0 in a description `hybridrl hardware --measure`
      writes, whose memory figure is measured by such a pass, a copy; and `link` 1.0 there too)."""

    update_matmul: float = 0.40
    forward_matmul: float = 0.45
    prefill_matmul: float = 0.50
    decode_memory: float = 0.70
    link: float = 0.70
    optimizer_memory: float = 0.50
    stream_memory: float = 0.85


EFFICIENCY = Efficiency()


@dataclass(frozen=True)
class Hardware:
    name: str
    bf16_tflops: float       # dense matmul peak in bf16 / fp16, TFLOP/s
    fp32_tflops: float       # plain fp32 (no TF32: megatron trains fp32 jobs in true fp32)
    memory_gb_per_s: float   # device memory (HBM) bandwidth, GB/s
    intra_node_gb_per_s: float  # to another GPU of the same machine (NVLink), one direction, GB/s
    inter_node_gb_per_s: float  # to a GPU of another machine (its NIC), one direction, GB/s
    host_gb_per_s: float  # to the host's memory (PCIe), one direction, GB/s: what offloading moves over
    # Fixed costs no roofline sees, what a small model's step is made of: one decode step of a replica (scheduling,
    # sampling, launches) and one decoder layer's pass over a micro-batch (framework and launch work; a backward
    # counts two). 0 on the shipped GPUs: CUDA graphs (vLLM) and asynchronous launches (megatron) hide them behind
    # the GPU's work at the sizes these GPUs train; a CPU description fits them (configs/hardware/).
    decode_step_ms: float = 0.0
    layer_pass_ms: float = 0.0
    # a collective's or a send's own time whatever it moves (a ring pays it at each of its 2 (n - 1) steps): 0 on the
    # shipped GPUs, where a step's collectives are few and large enough for their bandwidth term to dominate;
    # `hybridrl hardware --measure` measures it (a gloo all-reduce of 8 floats)
    link_latency_us: float = 0.0
    # each tensor a colocated weight sync writes into vLLM: its own work whatever its size, on both sides (the
    # resharder's, vLLM's write and both checksums: calls, not bytes). 0 on the shipped GPUs, where a sync's few
    # hundred tensors of MBs to GBs each make it microseconds against their bytes; a CPU description fits it
    sync_tensor_ms: float = 0.0
    # the fractions of the figures above each kind of work reaches: a datasheet's peak (the shipped entries) or a
    # measured sustained rate (a measured description, near 1)
    efficiency: Efficiency = EFFICIENCY

    def peak_flops(self, dtype: str) -> float:
        """Peak matmul FLOP/s at a training or rollout dtype (`bf16`, `fp16`, `fp32`)."""
        return (self.fp32_tflops if dtype == "fp32" else self.bf16_tflops) * 1e12

    @property
    def memory_bytes_per_s(self) -> float:
        return self.memory_gb_per_s * 1e9

    def link_bytes_per_s(self, crosses_nodes: bool) -> float:
        return (self.inter_node_gb_per_s if crosses_nodes else self.intra_node_gb_per_s) * 1e9

    @property
    def host_bytes_per_s(self) -> float:
        return self.host_gb_per_s * 1e9


# Published datasheet figures (dense). NVLink: A100 600 GB/s, H100/H200 900 GB/s, B200 1.8 TB/s both directions
# together, halved here; networks: 200 Gb/s HDR (A100) and 400 Gb/s NDR (the others) per GPU = 25 / 50 GB/s; host:
# PCIe 4.0 x16 (A100) and 5.0 x16 (the others), 32 / 64 GB/s a direction.
SHIPPED: dict[str, Hardware] = {hw.name: hw for hw in (
    Hardware("a100-80gb", bf16_tflops=312, fp32_tflops=19.5, memory_gb_per_s=2039, intra_node_gb_per_s=300,
             inter_node_gb_per_s=25, host_gb_per_s=32),
    Hardware("h100-sxm", bf16_tflops=989, fp32_tflops=67, memory_gb_per_s=3350, intra_node_gb_per_s=450,
             inter_node_gb_per_s=50, host_gb_per_s=64),
    Hardware("h200", bf16_tflops=989, fp32_tflops=67, memory_gb_per_s=4800, intra_node_gb_per_s=450,
             inter_node_gb_per_s=50, host_gb_per_s=64),
    Hardware("b200", bf16_tflops=2250, fp32_tflops=80, memory_gb_per_s=8000, intra_node_gb_per_s=900,
             inter_node_gb_per_s=50, host_gb_per_s=64),
)}

# An efficiency is a fraction of the figure it scales: up to 1 against a datasheet's peak, somewhat above 1 in a
# measured description whose small benchmark the job's larger matrices outrun (configs/hardware/this-cpu-2-ranks.yaml:
# 1.724). A percent written for a fraction (70 for 0.70) is far above this bound.
MAX_EFFICIENCY = 4.0
FIXED_COST_FIELDS = ("decode_step_ms", "layer_pass_ms", "link_latency_us", "sync_tensor_ms")
NUMBER_FIELDS = tuple(f.name for f in fields(Hardware) if f.name not in ("name", "efficiency", *FIXED_COST_FIELDS))
EFFICIENCY_FIELDS = tuple(f.name for f in fields(Efficiency))


def load_hardware(value: str) -> Hardware:
    """A shipped entry by name, or a YAML file holding `name` (optional) and every number field (each > 0)."""
    if value in SHIPPED:
        return SHIPPED[value]
    path = Path(value)
    if path.suffix not in (".yaml", ".yml", ".json") or not path.is_file():
        raise HardwareError(f"is neither a shipped hardware name ({', '.join(SHIPPED)}) nor a YAML file of the "
                            f"fields {', '.join(NUMBER_FIELDS)}")
    try:
        data = load_yaml(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise HardwareError(f"could not be read as YAML: {exc}") from None
    if not isinstance(data, dict):
        raise HardwareError(f"must hold a mapping of the fields {', '.join(NUMBER_FIELDS)}")
    unknown = sorted(set(data) - set(NUMBER_FIELDS) - set(FIXED_COST_FIELDS) - {"name", "efficiency"})
    missing = [name for name in NUMBER_FIELDS if name not in data]
    bad = [f"{name}={data[name]!r}" for name in NUMBER_FIELDS if name in data and not _number(data[name], 0)]
    negative = [f"{name}={data[name]!r}" for name in FIXED_COST_FIELDS if name in data
                and not _number(data[name], None)]
    efficiency = data.get("efficiency", {})
    if not isinstance(efficiency, dict):
        bad.append(f"efficiency={efficiency!r}")
        efficiency = {}
    unknown += [f"efficiency.{name}" for name in sorted(set(efficiency) - set(EFFICIENCY_FIELDS))]
    bad += [f"efficiency.{name}={value!r}" for name, value in efficiency.items()
            if name in EFFICIENCY_FIELDS and not _number(value, 0)]
    percent = [f"efficiency.{name}={value!r}" for name, value in efficiency.items()
               if name in EFFICIENCY_FIELDS and _number(value, 0) and value > MAX_EFFICIENCY]
    name = data.get("name", path.stem)
    unnamed = [f"name={name!r}"] if not isinstance(name, str) or not name.strip() else []
    if unknown or missing or bad or negative or percent or unnamed:
        parts = ([f"unknown field(s) {', '.join(unknown)}"] if unknown else []) + \
                ([f"missing {', '.join(missing)}"] if missing else []) + \
                ([f"not a finite number > 0: {', '.join(bad)}"] if bad else []) + \
                ([f"not a finite number >= 0: {', '.join(negative)}"] if negative else []) + \
                ([f"above {MAX_EFFICIENCY:g}: {', '.join(percent)} (an efficiency is a fraction of the figure it "
                  "scales: 0.7 for 70 %)"] if percent else []) + \
                ([f"not a name (text): {unnamed[0]}"] if unnamed else [])
        raise HardwareError(f"{'; '.join(parts)} (the fields: {', '.join(NUMBER_FIELDS)}; optional: "
                            f"{', '.join(FIXED_COST_FIELDS)}, efficiency)")
    return Hardware(name=name, **{name: float(data[name]) for name in NUMBER_FIELDS},
                    **{name: float(data[name]) for name in FIXED_COST_FIELDS if name in data},
                    efficiency=Efficiency(**{name: float(value) for name, value in efficiency.items()}))


def _number(value: object, above: float | None) -> bool:
    """A finite real number (not a bool) > `above`, or >= 0 when `above` is None: YAML's .inf or .nan would make a
    phase take no time or forever."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    return value >= 0 if above is None else value > above


def load_job_hardware(value: str) -> Hardware:
    """`trainer.hardware`'s description, or a ConfigError naming the field, the value and the shipped names: the one
    refusal the plan's check and `--search` both give."""
    try:
        return load_hardware(value)
    except HardwareError as exc:
        raise ConfigError([ConfigIssue("trainer.hardware", value, str(exc), tuple(SHIPPED))]) from None
