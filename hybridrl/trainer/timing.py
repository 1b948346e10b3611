"""Per-phase wall and CPU time of a training step, and throughput derived from them."""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

TIMELINE_PREFIX = "timeline/"  # a step's phase start/end clock times: run_dir/timeline.jsonl, not the metrics


class PhaseTimer:
    """Accumulates seconds per named phase; `metrics()` gives `timing_s/<phase>` and `timing_s/step`, and
    each phase's first start and last end as Unix times (`timeline/<phase>/start`, `.../end`), which the
    tracker writes to the run's timeline (what else ran in that window, e.g. a link's bytes, can be set
    against each phase)."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.clock: dict[str, tuple[float, float]] = {}  # phase -> (first start, last end), Unix seconds
        self._start_wall = time.perf_counter()
        self._start_cpu = time.process_time()
        self._start_clock = time.time()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        wall, cpu, clock = time.perf_counter(), time.process_time(), time.time()
        try:
            yield
        finally:
            self.wall[name] = self.wall.get(name, 0.0) + time.perf_counter() - wall
            self.cpu[name] = self.cpu.get(name, 0.0) + time.process_time() - cpu
            self.clock[name] = (self.clock.get(name, (clock, 0.0))[0], time.time())

    def metrics(self) -> dict[str, float]:
        step = time.perf_counter() - self._start_wall
        out = {f"timing_s/{name}": seconds for name, seconds in self.wall.items()}
        out["timing_s/step"] = step
        out["timing_s/controller_cpu"] = time.process_time() - self._start_cpu
        out[f"{TIMELINE_PREFIX}step/start"], out[f"{TIMELINE_PREFIX}step/end"] = self._start_clock, time.time()
        for name, (start, end) in self.clock.items():
            out[f"{TIMELINE_PREFIX}{name}/start"], out[f"{TIMELINE_PREFIX}{name}/end"] = start, end
        return out


def throughput_metrics(total_tokens: int, num_sequences: int, step_seconds: float, world_size: int) -> dict[str, float]:
    """Tokens and sequences per second for the whole job and per device."""
    seconds = max(step_seconds, 1e-9)
    return {
        "perf/total_num_tokens": float(total_tokens),
        "perf/throughput_tokens_per_s": total_tokens / seconds,
        "perf/throughput_tokens_per_s_per_device": total_tokens / seconds / max(world_size, 1),
        "perf/sequences_per_s": num_sequences / seconds,
    }
