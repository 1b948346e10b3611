"""One set of metrics from the metrics of several parts of a rollout: the generation rounds of a step, the rollout
replicas of one round, the groups an asynchronous rollout streamed (`merge_part_metrics`)."""
from __future__ import annotations


def merge_part_metrics(rounds: list[dict[str, float]], rows: list[int], concurrent: bool = False) -> dict[str, float]:
    """One set of generation and reward metrics from several parts of `rows` samples each: the
    generation rounds of a step, or (`concurrent`) the rollout replicas of one round.

    Means are weighted by the parts' sample counts, minima and maxima taken over all parts, counts,
    tokens and seconds summed (seconds of concurrent parts: the longest; `tools/` counts and call
    time are always summed); the rollout's tokens/s is
    recomputed from those; any other figure (e.g. the KV-cache size) is its largest. (A
    per-data-source mean is weighted by all of a part's samples: `_dynamic_sampling` recomputes the
    scorer's figures from its per-sample scores.)
    """
    def column(key: str) -> list[tuple[float, int]]:
        return [(round_[key], n) for round_, n in zip(rounds, rows) if key in round_]

    summed = ("fallbacks", "timeouts", "empty_responses", "generate_s", "response_tokens", "prompt_tokens",
              "model_tokens", "observation_tokens")
    merged: dict[str, float] = {}
    for key in dict.fromkeys(k for round_ in rounds for k in round_):
        values = column(key)
        if key.endswith(("_mean", "acc")):
            merged[key] = sum(v * n for v, n in values) / max(sum(n for _, n in values), 1)
        elif key.endswith("_min"):
            merged[key] = min(v for v, _ in values)
        elif key.endswith(summed) and not (concurrent and key.endswith("_s")):
            merged[key] = sum(v for v, _ in values)
        elif key.startswith("tools/") and not key.endswith("_max"):
            merged[key] = sum(v for v, _ in values)  # call counts, and tool time summed over calls
        else:
            merged[key] = max(v for v, _ in values)
    if "rollout/tokens_per_s" in merged and merged.get("rollout/generate_s", 0) > 0:
        merged["rollout/tokens_per_s"] = merged["rollout/response_tokens"] / merged["rollout/generate_s"]
    return merged
