"""Where a rollout rank's vLLM engine gets the adapters it serves (`lora.merge: false`), and the proof of each one.

Each sync writes the actor's current adapter (a `ShippedAdapter`: the PEFT folder's files and the digests vLLM must
hold) as a folder of its own and vLLM loads it as a new adapter id: one per load in this process, whatever policy
version it carries (a version served twice, after a resume, is still a new adapter to vLLM's caches). The folders
before it go: vLLM holds what it loaded. The digests of what vLLM's LoRA manager holds must then equal those the
trainer computed of what it sent (`reshard.adapter_sync.served_adapter_digests`). Used by the colocated policy (the
adapter gathered in the same process) and by a disaggregated rollout rank (the adapter shipped across the pools).
"""
from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile
from pathlib import Path

from hybridrl.persistence import write_folder
from hybridrl.reshard.adapter_sync import ShippedAdapter
from hybridrl.reshard.checksums import verify_checksums
from hybridrl.rollout.engine import RolloutEngine
from hybridrl.workers.probe import WeightSyncError

# A rank's root names the process that made it: hybridrl-adapter-rank<rank>-pid<pid>-<random>
ROOT_PREFIX = "hybridrl-adapter-rank{rank}-pid{pid}-"
_ROOT_NAME = re.compile(r"hybridrl-adapter-rank\d+-pid(\d+)-")


def remove_orphaned_roots(parent: Path) -> list[Path]:
    """Remove the adapter roots under `parent` whose process is gone; the ones removed.

    A rank's root goes at its process's exit, but a worker's process seldom exits: the run's end kills its actors
    (`kill_actors`), so `atexit` never runs, and each run serving adapters left a folder per rollout rank, each the
    size of the adapter (hundreds of MB at a large model's rank 64), on every host it ran on. The next rank made on
    the host removes those whose process no longer exists (a live one may be another run's)."""
    removed = []
    for root in parent.glob(ROOT_PREFIX.format(rank="*", pid="*") + "*"):
        found = _ROOT_NAME.match(root.name)
        if found is None or _process_exists(int(found.group(1))):
            continue
        shutil.rmtree(root, ignore_errors=True)
        removed.append(root)
    return removed


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class ServedAdapters:
    """One rank's adapter folders (a temporary root removed at exit, or by the next rank made on the host once this
    process is gone: `remove_orphaned_roots`) and the load-and-prove step of a sync."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        parent = Path(tempfile.gettempdir())
        remove_orphaned_roots(parent)
        self.root = Path(tempfile.mkdtemp(prefix=ROOT_PREFIX.format(rank=rank, pid=os.getpid()), dir=parent))
        atexit.register(shutil.rmtree, self.root, True)
        self.loaded = 0  # adapters vLLM has loaded in this process

    def serve(self, engine: RolloutEngine, adapter: ShippedAdapter, what: str) -> None:
        """vLLM serves `adapter` from now on (its files written as the next folder); raises `WeightSyncError`
        (naming `what`, the sync) when what its LoRA manager loaded is not the adapter's digests."""
        folder = write_folder(adapter.files, self.root / f"adapter{self.loaded}", force=True)
        engine.serve_adapter(folder, version=self.loaded)
        self.loaded += 1
        for old in self.root.iterdir():  # vLLM holds the adapter it loaded: earlier folders can go
            if old != folder:
                shutil.rmtree(old, ignore_errors=True)
        try:
            verify_checksums(adapter.digests, engine.adapter_digests(), self.rank)
        except Exception as exc:  # the error names tensors and rank; keep its type for the controller
            raise WeightSyncError(f"{what} (adapter): {exc}") from exc
