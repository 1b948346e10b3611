"""Run tracking: console lines, JSONL records, TensorBoard events, the summary and the plot."""
import json
import math
import time

import pytest

from hybridrl.trainer.timing import PhaseTimer, throughput_metrics
from hybridrl.trainer.tracking import Tracker, active_kl, plot_run, render_summary


def _history(steps=5):
    return [{"critic/score/mean": 0.1 * s, "actor/kl_loss": 0.01 * s, "actor/entropy": 2.0 - 0.1 * s,
             "response_length/mean": 10.0 + s, "timing_s/step": 2.0, "timing_s/gen": 1.5,
             "timing_s/update_actor": 0.5, "perf/throughput_tokens_per_s": 100.0 + s} for s in range(1, steps + 1)]


def test_tracker_fans_out_to_console_jsonl_tensorboard(tmp_path):
    lines = []
    tracker = Tracker.create(["console", "jsonl", "tensorboard"], tmp_path, write=lines.append)
    for step, metrics in enumerate(_history(3), start=1):
        tracker.log(step, {**metrics, "weird": float("nan")})
    tracker.close()
    assert lines[0].split()[:3] == ["step", "score", "kl(loss)"] and len(lines) == 4
    assert lines[3].split()[0] == "3" and lines[3].split()[1] == "0.300"
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and records[1]["critic/score/mean"] == 0.2
    assert records[0]["weird"] == "nan"
    scalars = _tensorboard_scalars(tmp_path / "tensorboard")
    assert set(scalars) == {*_history(1)[0], "weird"}
    for key in _history(1)[0]:
        expected = [(step, metrics[key]) for step, metrics in enumerate(_history(3), start=1)]
        assert [step for step, _ in scalars[key]] == [step for step, _ in expected], key
        assert [value for _, value in scalars[key]] == pytest.approx([value for _, value in expected]), key
    assert [step for step, _ in scalars["weird"]] == [1, 2, 3]
    assert all(math.isnan(value) for _, value in scalars["weird"])


def _tensorboard_scalars(log_dir):
    """{tag: [(step, value), ...]} read back from the event files with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]}


def test_unknown_logger_named():
    try:
        Tracker.create(["console", "mlflow"], "/tmp/x")
    except ValueError as exc:
        assert "mlflow" in str(exc) and "tensorboard" in str(exc)
    else:
        raise AssertionError("an unknown logger must be refused")


def test_summary_shows_curves_and_phase_shares():
    history = [{"step": float(i), **m} for i, m in enumerate(_history(), start=1)]
    text = render_summary(history)
    assert "5 steps" in text
    score_line = next(line for line in text.splitlines() if "score" in line)
    assert "first    0.1000" in score_line and "last    0.5000" in score_line
    assert "gen 75%" in text and "update_actor 25%" in text
    assert "median 103 tokens/s" in text


def test_summary_counts_trained_steps_not_the_validation_row_before_them():
    history = [{"step": 0.0, "val/score/mean": 0.25}]
    history += [{"step": float(i), **m} for i, m in enumerate(_history(), start=1)]
    history[-1]["val/score/mean"] = 0.5  # the last step's row carries the final validation
    text = render_summary(history)
    assert "5 steps" in text, text
    assert "step 0: 0.250, step 5: 0.500" in text
    score_line = next(line for line in text.splitlines() if "score" in line)
    assert "first    0.1000" in score_line  # the first trained step's, not the validation row's


def _kl_in_reward_history():
    """A job with the KL in its reward (algorithm.use_kl_in_reward): the actor logs a kl_loss of 0 (no KL loss)."""
    return [{"step": float(s), **m, "actor/kl_loss": 0.0, "actor/reward_kl_penalty": 0.1 * s}
            for s, m in enumerate(_history(3), start=1)]


@pytest.mark.parametrize("use_kl_loss,use_kl_in_reward,columns", [
    (True, False, ["kl(loss)"]), (False, True, ["kl(reward)"]), (True, True, ["kl(loss)", "kl(reward)"]),
    (False, False, [])])
def test_the_console_and_the_summary_show_the_kl_that_is_active(tmp_path, use_kl_loss, use_kl_in_reward, columns):
    """The KL the job is steered by, named: the loss's (actor/kl_loss) with use_kl_loss, the reward's penalty
    (actor/reward_kl_penalty) with use_kl_in_reward, both with both, none with neither."""
    kl = active_kl(use_kl_loss, use_kl_in_reward)
    lines = []
    tracker = Tracker.create(["console"], tmp_path, write=lines.append, kl=kl)
    history = _kl_in_reward_history()
    for row in history:
        tracker.log(int(row["step"]), row)
    header = lines[0].split()
    assert header[:2 + len(columns)] == ["step", "score", *columns] and header[2 + len(columns)] == "entropy"
    if columns:
        shown = [float(line.split()[2 + columns.index(columns[-1])]) for line in lines[1:]]
        assert shown == ([0.1, 0.2, 0.3] if columns[-1] == "kl(reward)" else [0.0, 0.0, 0.0])
    summary = render_summary(history, kl=kl).splitlines()
    kl_lines = [line.strip() for line in summary if line.strip().startswith("kl")]
    assert [line.split(":")[0] for line in kl_lines] == [{"kl(loss)": "kl (loss)", "kl(reward)": "kl (in reward)"}[c]
                                                         for c in columns]
    if use_kl_in_reward:
        assert "last    0.3000" in kl_lines[-1]
    assert plot_run(history, tmp_path / "run.png", kl=kl).read_bytes()[:4] == b"\x89PNG"


def test_the_plot_draws_the_active_kl(tmp_path, monkeypatch):
    """run.png's KL panel is the reward's penalty when the KL is in the reward (matplotlib's own figure, read back
    before it is saved)."""
    import matplotlib.figure

    drawn = {}
    save = matplotlib.figure.Figure.savefig

    def keep(figure, *args, **kwargs):
        ax = figure.axes[1]
        drawn["title"] = ax.get_title()
        drawn["curves"] = [list(line.get_ydata()) for line in ax.get_lines()]
        return save(figure, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    plot_run(_kl_in_reward_history(), tmp_path / "run.png", kl=active_kl(False, True))
    assert drawn["title"] == "KL: (in reward)" and drawn["curves"] == [pytest.approx([0.1, 0.2, 0.3])]


def test_plot_writes_png(tmp_path):
    history = [{"step": float(i), **m} for i, m in enumerate(_history(), start=1)]
    path = plot_run(history, tmp_path / "run.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_phase_timer_and_throughput():
    timer = PhaseTimer()
    with timer.phase("gen"):
        time.sleep(0.05)
    with timer.phase("gen"):
        time.sleep(0.02)
    metrics = timer.metrics()
    assert 0.06 <= metrics["timing_s/gen"] < 0.5 and metrics["timing_s/step"] >= metrics["timing_s/gen"]
    perf = throughput_metrics(total_tokens=1000, num_sequences=10, step_seconds=2.0, world_size=4)
    assert perf["perf/throughput_tokens_per_s"] == 500 and perf["perf/throughput_tokens_per_s_per_device"] == 125
    assert math.isclose(perf["perf/sequences_per_s"], 5.0)


def test_phase_clock_times_go_to_the_timeline_not_the_metrics(tmp_path):
    """Each phase's first start and last end (Unix seconds) land in run_dir/timeline.jsonl, the metrics sinks
    never see them; a resumed run's timeline keeps the steps up to its checkpoint, as metrics.jsonl does."""

    before = time.time()
    timer = PhaseTimer()
    with timer.phase("gen"):
        time.sleep(0.02)
    with timer.phase("update_actor"):
        time.sleep(0.02)
    with timer.phase("gen"):  # a second pass of a phase stretches its window
        time.sleep(0.01)
    tracker = Tracker.create(["jsonl"], tmp_path)
    tracker.log(1, {"critic/score/mean": 0.5, **timer.metrics()})
    tracker.log(2, {"critic/score/mean": 0.6, **timer.metrics()})
    tracker.close()
    (row, _) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert not any(k.startswith("timeline/") or k.endswith("/start") for k in row)
    assert tracker.history[0].keys() == {"step", "critic/score/mean", *(k for k in row if k.startswith("timing_s/"))}
    first, second = [json.loads(line) for line in (tmp_path / "timeline.jsonl").read_text().splitlines()]
    assert first["step"] == 1 and second["step"] == 2
    assert before <= first["step/start"] <= first["gen/start"] < first["update_actor/start"]
    assert first["update_actor/start"] - first["gen/start"] >= 0.02 and first["gen/end"] > first["update_actor/end"]
    assert first["gen/end"] <= first["step/end"] <= time.time()
    resumed = Tracker.create(["jsonl"], tmp_path, resume_step=1)
    resumed.close()
    assert [json.loads(line)["step"] for line in (tmp_path / "timeline.jsonl").read_text().splitlines()] == [1]


def test_jsonl_fresh_run_truncates_and_resume_keeps_prefix(tmp_path):
    from hybridrl.trainer.tracking import JsonlSink

    first = JsonlSink(tmp_path / "m.jsonl")
    for step in (1, 2, 3):
        first.log(step, {"x": float(step)})
    first.close()
    resumed = JsonlSink(tmp_path / "m.jsonl", resume_step=2)  # checkpoint at 2; step 3 is redone
    resumed.log(3, {"x": 30.0})
    resumed.close()
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [(r["step"], r["x"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    fresh = JsonlSink(tmp_path / "m.jsonl")
    fresh.close()
    assert (tmp_path / "m.jsonl").read_text() == ""


def test_a_resume_drops_a_record_cut_by_a_full_disk_or_a_crash(tmp_path):
    """A run that ended mid-write (its disk full, the machine down) leaves a cut last line: the resume refused with a
    JSONDecodeError traceback. That record is a step's after the checkpoint (a step logs before it saves): dropped."""
    from hybridrl.trainer.tracking import JsonlSink

    first = JsonlSink(tmp_path / "m.jsonl")
    for step in (1, 2):
        first.log(step, {"x": float(step)})
    first.close()
    whole = (tmp_path / "m.jsonl").read_text()
    (tmp_path / "m.jsonl").write_text(whole + json.dumps({"step": 3, "x": 3.0})[:9])  # step 3's record, cut
    resumed = JsonlSink(tmp_path / "m.jsonl", resume_step=2)
    resumed.log(3, {"x": 30.0})
    resumed.close()
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [(r["step"], r["x"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_rewind_forgets_later_steps_and_keeps_events(tmp_path):
    """An in-place restart goes back to its checkpoint's step: the steps after it are run again, so the
    history and metrics.jsonl drop them; the restart's own record stays."""
    tracker = Tracker.create(["jsonl"], tmp_path)
    for step in (1, 2, 3):
        tracker.log(step, {"x": float(step)})
    tracker.event(3, {"event": "restart", "restart": 1, "cause": "rank 1 died"})
    tracker.rewind(1)
    for step in (2, 3, 4):
        tracker.log(step, {"x": 10.0 * step})
    tracker.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r.get("x"), r.get("event")) for r in rows] == [
        (1, 1.0, None), (3, None, "restart"), (2, 20.0, None), (3, 30.0, None), (4, 40.0, None)]
    assert rows[1]["cause"] == "rank 1 died"
    assert [(h["step"], h["x"]) for h in tracker.history] == [(1, 1.0), (2, 20.0), (3, 30.0), (4, 40.0)]
    # a later resume from step 3's checkpoint keeps the event and the steps up to 3
    resumed = Tracker.create(["jsonl"], tmp_path, resume_step=3)
    resumed.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 3, 2, 3]


def test_failure_cost_at_the_checkpoint_cadence():
    from hybridrl.config.report import failure_cost_lines

    (line,) = failure_cost_lines(save_freq=10, max_restarts=2, step_s=30.0)
    assert "restart in place" in line and "max_restarts=2" in line
    assert "on average save_freq/2 = 5 steps ≈ 150 s, at most 10 ≈ 300 s" in line
    (line,) = failure_cost_lines(save_freq=3, max_restarts=0)
    assert "the run stops" in line and "1.5 steps, at most 3." in line
    (line,) = failure_cost_lines(save_freq=-1, max_restarts=1)
    assert "every step since the start" in line


def test_summary_lists_validation_scores():
    text = render_summary([{"step": 1.0, "val/score/mean": 0.25}, {"step": 2.0, "val/score/mean": 0.75}])
    assert "step 1: 0.250, step 2: 0.750" in text
