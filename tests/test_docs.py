"""The README and the user guide stay true to the code: every command, path and config key they name exists,
and the guide's own-model walk-through runs as written.

Read from the documents' text: each `make` target is one of the Makefile's, each `hybridrl` command line
parses with hybridrl's own parser (subcommand and flags), each repository path in backquotes is a file or
folder of this tree, each dotted config key in backquotes is a field of the schema (a full path, or the
tail of one as the guide writes `rollout.n`).
"""
from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from hybridrl.cli import build_parser
from hybridrl.config.schema import JobConfig, without_none
from hybridrl.config.verl_default_values import VERL_DEFAULTS
from hybridrl.config.verl_keys import ROLE, VERL_KEYS, verl_key

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "docs" / "user-guide.md"]
# every document a user reads: the paths and links they name must exist too
USER_DOCS = [*DOCS, *sorted(p for p in (ROOT / "docs").glob("*.md") if p not in DOCS), ROOT / "launch" / "README.md"]
TOP_FOLDERS = ("configs/", "tools/", "launch/", "docs/", "bench/", "hybridrl/", "tests/", "docker/")


def _schema_paths(cls: type = JobConfig, prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    paths = set()
    for name, hint in typing.get_type_hints(cls).items():
        path = (*prefix, name)
        paths.add(path)
        inner = without_none(hint)
        if dataclasses.is_dataclass(inner):
            paths |= _schema_paths(inner, path)
    return paths


SCHEMA = _schema_paths()


def _sections() -> set[str]:
    """Names that open a dotted config key: every section of the schema (data, rollout, megatron, ...)."""
    names = set()
    for path in SCHEMA:
        for depth in range(1, len(path)):
            names.add(path[depth - 1])
    return names


def _is_schema_key(parts: tuple[str, ...]) -> bool:
    """A full path, or the tail of one (`rollout.n`), of the schema; a role's layout fields also sit on the role;
    or a verl key the loader reads (`hybridrl/config/verl_keys.py`) or takes at verl's default
    (`hybridrl/config/verl_default_values.py`)."""
    if verl_key(parts) is not None or ".".join(parts) in VERL_DEFAULTS:
        return True
    for path in SCHEMA:
        if path[-len(parts):] == parts:
            return True
        if "megatron" in path:  # `actor.tensor_model_parallel_size` spells `actor.megatron.tensor_model_parallel_size`
            short = tuple(p for p in path if p != "megatron")
            if short[-len(parts):] == parts:
                return True
    return False


def _fenced(text: str) -> tuple[list[tuple[str, str]], str]:
    """The fenced blocks as (info string, body), and the text outside them."""
    blocks, outside, body, info = [], [], None, ""
    for line in text.splitlines(keepends=True):
        if line.startswith("```"):
            if body is None:
                body, info = [], line[3:].strip()
            else:
                blocks.append((info, "".join(body)))
                body = None
        elif body is not None:
            body.append(line)
        else:
            outside.append(line)
    return blocks, "".join(outside)


def _code_spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", _fenced(text)[1])


def _code_blocks(text: str) -> list[str]:
    return [body for info, body in _fenced(text)[0] if info in ("", "bash", "sh", "console")]


def _command_lines(text: str) -> list[str]:
    """Each shell line of the fenced blocks, continuation lines joined, comments cut."""
    lines = []
    for block in _code_blocks(text):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split("  #", 1)[0].strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_make_target_exists(doc):
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
    named = set(re.findall(r"\bmake ([\w-]+)", doc.read_text()))
    assert named, "the document names no make target"
    assert named <= targets, f"{doc.name} names make targets the Makefile lacks: {sorted(named - targets)}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_hybridrl_command_parses(doc):
    parser = build_parser()
    # a command, not a line of its output ("hybridrl plan: 2 config error(s):")
    commands = [line for line in _command_lines(doc.read_text()) if re.match(r"hybridrl (-|[a-z]+( |$))", line)]
    assert commands, "the document shows no hybridrl command"
    for line in commands:
        argv = [a for a in shlex.split(line)[1:] if not re.fullmatch(r"\[.*\]|\.\.\.|\S*\.\.\.\S*", a)]
        argv = [re.sub(r"^[A-Z_]+$", "x", a) for a in argv]  # placeholders (CONFIG, HF_DIR) as values
        try:
            args, extra = parser.parse_known_args(argv)
        except SystemExit as exit_:
            pytest.fail(f"{doc.name}: `{line}` does not parse ({exit_})")
        flags = [a for a in extra if a.startswith("-")]
        assert not flags, f"{doc.name}: `{line}` uses flags hybridrl does not have: {flags}"


def _anchor(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation but hyphens and underscores dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(doc: Path) -> set[str]:
    return {_anchor(line.lstrip("#")) for line in _fenced(doc.read_text())[1].splitlines() if line.startswith("#")}


@pytest.mark.parametrize("doc", USER_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc):
    """A markdown link to a file of this tree (relative to the document, as GitHub resolves it) names one that
    exists, and its #anchor a heading of it."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _fenced(doc.read_text())[1]):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)} links to what does not exist: {broken}"


@pytest.mark.parametrize("doc", USER_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_path_exists(doc):
    text = doc.read_text()
    candidates = set()
    for span in _code_spans(text) + _command_lines(text):
        for token in re.split(r"[\s=,()\[\]`]+", span):
            token = token.strip("'\".:;")
            # a path has a folder and a file or folder name (`tools/calls` is a metric's name)
            looks_like_path = "." in token.rsplit("/", 1)[-1] or token.endswith("/") or (ROOT / token).exists()
            if token.startswith(TOP_FOLDERS) and looks_like_path and not set("*<{") & set(token):
                candidates.add(token.split("::")[0].split("#")[0])
    assert candidates
    missing = sorted(c for c in candidates if not (ROOT / c).exists() and not c.startswith("docs/notes/x"))
    assert not missing, f"{doc.name} names paths this tree lacks: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_config_key_is_a_schema_field(doc):
    sections = _sections()
    keys = set()
    for span in _code_spans(doc.read_text()):
        token = re.split(r"[\s=:]", span.strip(), maxsplit=1)[0]
        parts = tuple(token.split("."))
        is_file = parts[-1] in ("json", "safetensors", "yaml", "py", "jsonl", "parquet", "txt", "md")
        if len(parts) >= 2 and parts[0] in sections and not is_file and all(re.fullmatch(r"\w+", p) for p in parts):
            keys.add(parts)
    assert keys, "the document names no config key"
    unknown = sorted(".".join(k) for k in keys if not _is_schema_key(k))
    assert not unknown, f"{doc.name} names config keys the schema lacks: {unknown}"


def _walk_through() -> list[str]:
    """The command lines of the guide's own-model walk-through (its first fenced block)."""
    text = (ROOT / "docs" / "user-guide.md").read_text()
    section = text.split("## Your own model", 1)[1].split("\n## ", 1)[0]
    return _command_lines(section)


def test_the_walk_through_names_the_commands_this_test_runs():
    lines = _walk_through()
    assert [line.split()[:2] for line in lines] == [["hf", "download"], ["hybridrl", "plan"], ["hybridrl", "train"]]


@pytest.mark.slow
def test_the_guide_own_model_walk_through_runs(demo_assets, tmp_path):
    """The guide's commands as written, from a folder laid out as `make demo-assets` leaves the repository
    (the download is the one line that needs a network; its folder is the demo model here)."""
    work = tmp_path / "work"
    (work / "data" / "models").mkdir(parents=True)
    (work / "configs").symlink_to(ROOT / "configs")
    (work / "data" / "models" / "tiny-demo").symlink_to(demo_assets / "model")
    (work / "data" / "synthetic").symlink_to(demo_assets / "data")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for line in _walk_through()[1:]:
        result = subprocess.run(line, shell=True, cwd=work, capture_output=True, text=True, env=env, timeout=600)
        assert result.returncode == 0, f"`{line}`\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert "steps" in result.stdout  # the run's one-screen summary
    metrics = list((work / "runs").rglob("metrics.jsonl"))
    assert len(metrics) == 1 and len(metrics[0].read_text().splitlines()) >= 2


def test_the_verl_table_lists_every_verl_key():
    """The guide's migration table names each verl key the loader reads in verl's meaning."""
    section = (ROOT / "docs" / "user-guide.md").read_text().split("## Migrating from verl", 1)[1].split("\n## ", 1)[0]
    for entry in VERL_KEYS:
        key = entry.key.replace(ROLE, "<role>")
        assert key in section or key.rsplit(".", 1)[-1] in section, f"{entry.key} is not in the migration table"


def test_the_verl_section_states_the_defaults_that_differ_from_verls_as_the_code_has_them():
    """Two silent differences a verl user must know: no validation before training by default, and the checkpoint
    folder's project/experiment levels under default_local_dir (the trainer's own checkpoint root)."""
    from hybridrl.config.plan import plan_from_sources
    from hybridrl.config.schema import TrainerConfig
    from hybridrl.trainer.trainer import checkpoint_root_for

    section = (ROOT / "docs" / "user-guide.md").read_text().split("## Migrating from verl", 1)[1].split("\n## ", 1)[0]
    text = " ".join(section.split())
    assert TrainerConfig().val_before_train is False and "`trainer.val_before_train` is false here (verl: true" in text

    plan = plan_from_sources(ROOT / "configs/examples/seed_6gpu_grpo.yaml", [
        "trainer.default_local_dir=/ckpt/exp1", "trainer.project_name=p", "trainer.experiment_name=e"])
    assert str(checkpoint_root_for(plan)) == "/ckpt/exp1/p/e"
    assert "`<default_local_dir>/<project_name>/<experiment_name>/global_step_N`" in text
