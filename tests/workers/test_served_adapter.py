"""A rank's served-adapter folders: those of a process that is gone are removed by the next rank made on the host."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hybridrl.workers import served_adapter
from hybridrl.workers.served_adapter import ServedAdapters, remove_orphaned_roots


def _root(parent: Path, rank: int, pid: int, tag: str) -> Path:
    root = parent / (served_adapter.ROOT_PREFIX.format(rank=rank, pid=pid) + tag)
    (root / "adapter0").mkdir(parents=True)
    (root / "adapter0" / "adapter_model.safetensors").write_bytes(b"x" * 1024)
    return root


def test_a_killed_ranks_adapter_folder_is_removed_by_the_next_rank(tmp_path, monkeypatch):
    """A run's end kills its workers (atexit never runs there): the folder a killed rank left is removed when the next
    rank is made; a live process's folder (another run's) and other files stay."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid names a process that no longer exists
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        orphan = _root(tmp_path, 0, gone.pid, "abc")
        others = _root(tmp_path, 1, live.pid, "def")
        unrelated = tmp_path / "hybridrl-adapter-rank0-notapid"
        unrelated.mkdir()
        monkeypatch.setattr(served_adapter.tempfile, "gettempdir", lambda: str(tmp_path))
        served = ServedAdapters(rank=0)
        assert not orphan.exists()
        assert others.exists() and unrelated.exists()
        assert served.root.parent == tmp_path
        assert served.root.name.startswith(f"hybridrl-adapter-rank0-pid{os.getpid()}-")
        assert remove_orphaned_roots(tmp_path) == []  # this process's own root stays: it is alive
    finally:
        live.kill()
        live.wait()
    assert remove_orphaned_roots(tmp_path) == [others]  # its process gone now

