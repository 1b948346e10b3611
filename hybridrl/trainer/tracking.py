"""Where a run's metrics go: console table, JSONL, TensorBoard, wandb; the end summary and plot.

`Tracker.log(step, metrics)` fans one step's flat metrics dict out to every configured sink.
Sinks are chosen by name from `trainer.logger`; wandb and TensorBoard are imported only when
asked for, so a missing optional package fails with a message naming the logger, at start-up.
"""
from __future__ import annotations

import importlib
import json
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TextIO

from hybridrl.config.schema import LOGGER_PACKAGES
from hybridrl.names import TIMED_PHASES
from hybridrl.persistence import write_atomic
from hybridrl.trainer.timing import TIMELINE_PREFIX


@dataclass(frozen=True)
class KlCurve:
    """A KL the run is steered by, as the console column, the summary line and the plot show it."""

    column: str  # the console header
    label: str  # the summary's and the plot's
    key: str  # the metric
    fmt: str = "{:>8.4f}"


# The KL in the actor's loss (actor.use_kl_loss), and the KL(old || ref) subtracted from the rewards
# (algorithm.use_kl_in_reward; the KL itself, before its coefficient, as verl logs it)
LOSS_KL = KlCurve("kl(loss)", "kl (loss)", "actor/kl_loss")
REWARD_KL = KlCurve("kl(reward)", "kl (in reward)", "actor/reward_kl_penalty", "{:>10.4f}")


def active_kl(use_kl_loss: bool, use_kl_in_reward: bool) -> tuple[KlCurve, ...]:
    """The KLs a job is steered by (none, one or both): those the console, summary and plot show, so a job with
    the KL in its reward does not show the loss's, which it never computes (0)."""
    return (*((LOSS_KL,) if use_kl_loss else ()), *((REWARD_KL,) if use_kl_in_reward else ()))


# The few numbers the per-step console line shows, in order (others go to JSONL/TensorBoard); the KL columns
# (`active_kl`) follow the score.
CONSOLE_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("step", "training/global_step", "{:>5.0f}"),
    ("score", "critic/score/mean", "{:>7.3f}"),
    ("entropy", "actor/entropy", "{:>7.3f}"),
    ("pg_loss", "actor/pg_loss", "{:>8.4f}"),
    ("resp_len", "response_length/mean", "{:>8.1f}"),
    ("step_s", "timing_s/step", "{:>7.2f}"),
    ("tok/s", "perf/throughput_tokens_per_s", "{:>8.0f}"),
)
PHASES = TIMED_PHASES
# The curves the end-of-run summary shows (those a run logged), and those whose best is their least; the KL
# curves (`active_kl`) follow the score.
SUMMARY_CURVES = (("score", "critic/score/mean"),
                  ("teacher KL", "distillation/reverse_kl_per_token"), ("entropy", "actor/entropy"),
                  ("response length", "response_length/mean"), ("grad norm", "actor/grad_norm"))
LOWER_IS_BETTER = frozenset({"distillation/reverse_kl_per_token"})


def console_columns(kl: Sequence[KlCurve] = (LOSS_KL,)) -> tuple[tuple[str, str, str], ...]:
    return (*CONSOLE_COLUMNS[:2], *((c.column, c.key, c.fmt) for c in kl), *CONSOLE_COLUMNS[2:])


def summary_curves(kl: Sequence[KlCurve] = (LOSS_KL,)) -> tuple[tuple[str, str], ...]:
    return (*SUMMARY_CURVES[:1], *((c.label, c.key) for c in kl), *SUMMARY_CURVES[1:])


class MetricSink(Protocol):
    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...
    def event(self, step: int, record: Mapping[str, Any]) -> None: ...
    def rewind(self, step: int) -> None: ...
    def close(self) -> None: ...


class ConsoleSink:
    """One compact line per step under a header printed every 20 steps."""

    def __init__(self, write=print, header_every: int = 20, kl: Sequence[KlCurve] = (LOSS_KL,)):
        self._write = write
        self._header_every = header_every
        self._lines = 0
        self._columns = console_columns(kl)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._lines % self._header_every == 0:
            self._write("  ".join(f"{name:>{_width(fmt)}}" for name, _, fmt in self._columns))
        cells = []
        for name, key, fmt in self._columns:
            value = step if name == "step" else metrics.get(key)
            cells.append(fmt.format(value) if isinstance(value, (int, float)) else f"{'-':>{_width(fmt)}}")
        self._write("  ".join(cells))
        self._lines += 1

    def event(self, step: int, record: Mapping[str, Any]) -> None:
        # the trainer writes an event's sentence to the console itself, whatever the loggers are
        self._lines = 0  # the next step line gets a header again

    def rewind(self, step: int) -> None:
        pass  # lines already printed stay: the console is a log of what happened

    def close(self) -> None:
        pass


def _width(fmt: str) -> int:
    return int(fmt.split(">")[1].split(".")[0])


class JsonlSink:
    """One JSON record per step, and one per event (a record with an "event" key, e.g. an in-place
    restart). A resumed run keeps the records up to its checkpoint's step and continues after them; a
    fresh run starts the file anew."""

    def __init__(self, path: Path, resume_step: int = 0):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        if resume_step > 0 and path.is_file():
            self._file = self._kept_up_to(resume_step)
        else:
            self._file = open(path, "w")

    def _kept_up_to(self, step: int) -> TextIO:
        """Keep the step records up to `step` (and every event record), drop later ones; the file to append to.
        A last line that is not a whole record is dropped too: the run that wrote it ended mid-write (a full disk,
        a crash), after its last checkpoint (a step's record is written before its save), so it is a later step's."""
        lines = [line for line in self.path.read_text().splitlines() if line.strip()]
        if lines and not _is_json(lines[-1]):
            lines.pop()
        kept = [line for line in lines if "event" in (record := json.loads(line)) or record.get("step", 0) <= step]
        write_atomic(self.path, "".join(line + "\n" for line in kept))
        return open(self.path, "a")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        record = {"step": step, **{k: _json_number(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def event(self, step: int, record: Mapping[str, Any]) -> None:
        self._file.write(json.dumps({"step": step, **record}, default=str) + "\n")
        self._file.flush()

    def rewind(self, step: int) -> None:
        self._file.close()
        self._file = self._kept_up_to(step)

    def close(self) -> None:
        self._file.close()


def _is_json(line: str) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True


def _json_number(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/Inf; keep them visible as strings
    return value


class TensorBoardSink:
    def __init__(self, log_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise RuntimeError("trainer.logger has 'tensorboard' but the tensorboard package is missing") from exc
        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)):
                self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def event(self, step: int, record: Mapping[str, Any]) -> None:
        self._writer.add_text("events", json.dumps(dict(record), default=str), step)
        self._writer.flush()

    def rewind(self, step: int) -> None:
        pass  # TensorBoard keeps both values of a step logged twice; it shows the newest

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    def __init__(self, project: str, name: str, config: Mapping[str, Any]):
        try:  # the package the plan checks imports (LOGGER_PACKAGES)
            wandb = importlib.import_module(LOGGER_PACKAGES["wandb"])
        except ImportError as exc:
            raise RuntimeError(
                "trainer.logger has 'wandb' but the wandb package is missing (pip install wandb)"
            ) from exc
        self._run = wandb.init(project=project, name=name, config=dict(config))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def event(self, step: int, record: Mapping[str, Any]) -> None:
        self._run.alert(title=str(record.get("event", "event")), text=json.dumps(dict(record), default=str))

    def rewind(self, step: int) -> None:
        pass  # wandb cannot take steps back: it ignores steps at or below the last one it logged

    def close(self) -> None:
        self._run.finish()


class Tracker:
    """Fans a step's metrics out to the sinks; a step's phase clock times (`timeline/...` keys) go to
    `timeline` (run_dir/timeline.jsonl, whatever the loggers) instead."""

    def __init__(self, sinks: Sequence[MetricSink], run_dir: Path, timeline: MetricSink | None = None):
        self.sinks = list(sinks)
        self.run_dir = run_dir
        self.timeline = timeline
        self.history: list[dict[str, float]] = []

    @classmethod
    def create(cls, names: Iterable[str], run_dir: str | Path, *, project: str = "hybridrl",
               experiment: str = "run", config: Mapping[str, Any] | None = None, write=print,
               resume_step: int = 0, kl: Sequence[KlCurve] = (LOSS_KL,)) -> Tracker:
        run_dir = Path(run_dir)
        sinks: list[MetricSink] = []
        for name in names:
            if name == "console":
                sinks.append(ConsoleSink(write, kl=kl))
            elif name == "jsonl":
                sinks.append(JsonlSink(run_dir / "metrics.jsonl", resume_step))
            elif name == "tensorboard":
                sinks.append(TensorBoardSink(run_dir / "tensorboard"))
            elif name == "wandb":
                sinks.append(WandbSink(project, experiment, config or {}))
            else:
                raise ValueError(f"trainer.logger: unknown logger {name!r}; valid: console, jsonl, tensorboard, wandb")
        return cls(sinks, run_dir, JsonlSink(run_dir / "timeline.jsonl", resume_step))

    @property
    def _outputs(self) -> list[MetricSink]:
        return [*self.sinks, *([self.timeline] if self.timeline is not None else [])]

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        flat = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        timed = [k for k in flat if k.startswith(TIMELINE_PREFIX)]
        clock = {k.removeprefix(TIMELINE_PREFIX): flat.pop(k) for k in timed}
        if clock and self.timeline is not None:
            self.timeline.log(step, clock)
        self.history.append({"step": float(step), **flat})
        for sink in self.sinks:
            sink.log(step, flat)

    def event(self, step: int, record: Mapping[str, Any]) -> None:
        """Something that happened to the run (not a step's metrics): every sink records it."""
        for sink in self.sinks:
            sink.event(step, record)

    def rewind(self, step: int) -> None:
        """Forget the steps after `step`: the run goes back to its checkpoint of `step` and runs them again."""
        self.history = [h for h in self.history if h["step"] <= step]
        for sink in self._outputs:
            sink.rewind(step)

    def close(self) -> None:
        for sink in self._outputs:
            sink.close()


def render_summary(history: Sequence[Mapping[str, float]], title: str = "run summary",
                   kl: Sequence[KlCurve] = (LOSS_KL,)) -> str:
    """One screen: start/end/best of the key curves (`kl`: the KLs the job is steered by) and where the step time
    went."""
    if not history:
        return f"{title}: no steps ran"
    # `trainer.val_before_train` logs a row of its own at step 0: a step is a row with training metrics.
    trained = sum(1 for h in history if any(k != "step" and not k.startswith("val/") for k in h))
    lines = [f"== {title}: {trained} steps =="]
    first, last = history[0], history[-1]
    for label, key in summary_curves(kl):
        values = [h[key] for h in history if key in h]
        if values:
            best = min(values) if key in LOWER_IS_BETTER else max(values)
            lines.append(f"{label:>16}: first {first.get(key, values[0]):9.4f}  last {last.get(key, values[-1]):9.4f}"
                         f"  best {best:9.4f}")
    val = [(h["step"], h["val/score/mean"]) for h in history if "val/score/mean" in h]
    if val:
        lines.append(f"{'validation':>16}: " + ", ".join(f"step {s:.0f}: {v:.3f}" for s, v in val[-6:]))
    step_times = [h["timing_s/step"] for h in history if "timing_s/step" in h]
    if step_times:
        total = sum(step_times)
        lines.append(f"{'step time':>16}: median {statistics.median(step_times):.2f} s, total {total:.1f} s")
        shares = []
        for phase in PHASES:
            spent = sum(h.get(f"timing_s/{phase}", 0.0) for h in history)
            if spent > 0:
                shares.append(f"{phase} {100 * spent / total:.0f}%")
        if shares:
            lines.append(f"{'where it went':>16}: " + ", ".join(shares))
    tokens = [h["perf/throughput_tokens_per_s"] for h in history if "perf/throughput_tokens_per_s" in h]
    if tokens:
        lines.append(f"{'throughput':>16}: median {statistics.median(tokens):,.0f} tokens/s")
    return "\n".join(lines)


def plot_run(history: Sequence[Mapping[str, float]], path: str | Path, kl: Sequence[KlCurve] = (LOSS_KL,)) -> Path:
    """PNG of reward, KL (`kl`: the KLs the job is steered by, each its own curve), entropy, response length and
    the per-phase step-time breakdown."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    steps = [h["step"] for h in history]
    kl_title = "KL: " + (", ".join(curve.label.removeprefix("kl ") for curve in kl) if kl else "none (no KL "
                                                                                            "loss or penalty)")
    panels = [(("score", "critic/score/mean"),), tuple((curve.label, curve.key) for curve in kl),
              (("entropy", "actor/entropy"),), (("response length", "response_length/mean"),)]
    titles = ["score", kl_title, "entropy", "response length"]
    fig, axes = plt.subplots(1, 5, figsize=(22, 4))
    for ax, curves, title in zip(axes, panels, titles):
        for label, key in curves:
            points = [(h["step"], h[key]) for h in history if key in h]
            if points:
                ax.plot(*zip(*points), marker=".", label=label)
        if len(curves) > 1:
            ax.legend(fontsize=7)
        ax.set_title(title)
        ax.set_xlabel("step")
    ax = axes[-1]
    bottom = [0.0] * len(history)
    for phase in PHASES:
        values = [h.get(f"timing_s/{phase}", 0.0) for h in history]
        if any(values):
            ax.bar(steps, values, bottom=bottom, label=phase)
            bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_title("step time by phase (s)")
    ax.set_xlabel("step")
    if any(bottom):
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
