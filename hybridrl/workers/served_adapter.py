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
import shutil
import tempfile
from pathlib import Path

from hybridrl.persistence import write_folder
from hybridrl.reshard.adapter_sync import ShippedAdapter
from hybridrl.reshard.checksums import verify_checksums
from hybridrl.rollout.engine import RolloutEngine
from hybridrl.workers.probe import WeightSyncError


class ServedAdapters:
    """One rank's adapter folders (a temporary root removed at exit) and the load-and-prove step of a sync."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.root = Path(tempfile.mkdtemp(prefix=f"hybridrl-adapter-rank{rank}-"))
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
