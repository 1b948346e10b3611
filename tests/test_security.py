"""Security rules, enforced on the source: what loads files and starts processes, and where Ray listens.

* weights come only from safetensors; other state (optimizer, RNG, schedules) goes through
  `torch.load(..., weights_only=True)`: every `torch.load` call must pass it literally;
* no `shell=True`, `os.system` or `pickle.load(s)` (the forked test launcher, which unpickles results of
  children it forked itself, is a test helper: `tests/support/forked.py`, outside the scanned sources);
* a local Ray cluster listens on loopback only (auth disabled there: documented in the README);
* reward code from a file is executed as trusted code: documented where it is loaded.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for d in ("hybridrl", "tools", "bench", "launch") for p in sorted((ROOT / d).glob("**/*.py"))
           if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)]  # no venvs, caches
PICKLE_ALLOWED: set[str] = set()  # no exception left in the product, its tools, benches and launchers


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def _calls() -> list[tuple[str, ast.Call]]:
    out = []
    for path in SOURCES:
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
            if isinstance(node, ast.Call):
                out.append((f"{rel}:{node.lineno}", node))
    return out


def test_scan_sees_the_sources():
    assert len(SOURCES) > 50 and any(p.name == "checkpointing.py" for p in SOURCES)


def test_every_torch_load_is_weights_only():
    offenders, seen = [], 0
    for where, call in _calls():
        if _dotted(call.func) == "torch.load":
            seen += 1
            kw = {k.arg: k.value for k in call.keywords}
            value = kw.get("weights_only")
            if not (isinstance(value, ast.Constant) and value.value is True):
                offenders.append(where)
    assert seen >= 1  # the role checkpoints' optimizer/RNG state
    assert not offenders, f"torch.load without weights_only=True: {offenders}"


def test_no_shell_or_pickle():
    offenders = []
    for where, call in _calls():
        name = _dotted(call.func)
        if any(k.arg == "shell" and not (isinstance(k.value, ast.Constant) and k.value.value is False)
               for k in call.keywords):
            offenders.append(f"{where} shell=")
        if name in ("os.system", "os.popen"):
            offenders.append(f"{where} {name}")
        if name in ("pickle.load", "pickle.loads") and where.split(":")[0] not in PICKLE_ALLOWED:
            offenders.append(f"{where} {name}")
    assert not offenders, offenders


def test_weights_are_read_from_safetensors_only(tmp_path):
    import shutil

    from hybridrl.models.checkpoint import CheckpointError, HFCheckpointReader

    shutil.copy(ROOT / "configs" / "models" / "tiny-demo" / "config.json", tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    try:
        HFCheckpointReader(tmp_path)
    except CheckpointError as error:
        assert "only safetensors are supported" in str(error)
    else:
        raise AssertionError("a pickle weights file was accepted")


def test_reward_files_are_documented_as_trusted_code():
    import hybridrl.rewards.custom as custom

    assert "TRUSTED CODE" in (custom.__doc__ or "")
    assert "trusted code" in (ROOT / "README.md").read_text().lower()


def test_tool_files_are_trusted_code_and_the_hook_says_what_it_is_not():
    import hybridrl.tool_calling.python_tool as python_tool
    import hybridrl.tool_calling.user_tools as user_tools

    assert "TRUSTED CODE" in (user_tools.__doc__ or "")
    assert "it is not a\nsecurity boundary against hostile code" in (python_tool.__doc__ or "")
    assert "tools file" in (ROOT / "README.md").read_text()


def test_local_ray_cluster_listens_on_loopback(ray_cluster):
    import ray

    assert ray_cluster.address.split(":")[0] == "127.0.0.1", ray_cluster.address
    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
