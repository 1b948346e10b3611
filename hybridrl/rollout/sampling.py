"""Sampling parameters of a rollout, and their translation to vLLM's `SamplingParams`.

Training and validation sample differently: training draws `n` samples per prompt at the policy's
temperature (the log-probs fed to PPO must be those of this distribution), validation decodes one
greedy answer. Both are `RolloutSampling` values; `validation_sampling` builds the greedy one.

vLLM is imported only inside `to_vllm`, so configs and workers can build these without it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from hybridrl.config.schema import SEED_RANGE  # per-request seeds too: vLLM seeds a torch.Generator with them


@dataclass(frozen=True)
class RolloutSampling:
    """What to sample for each prompt.

    `top_k=None` and `top_p=1.0` disable those filters. `temperature=0` is greedy decoding (then
    `n` must be 1: n greedy samples would be identical). `seed=None` lets the engine derive the
    per-request seeds from its own seed and call counter (still explicit and equal on TP peers);
    a fixed `seed` makes every call with the same prompts on the same replica reproducible (replicas
    still draw apart).
    `logprobs=True` returns the log-prob of each sampled token (see `RolloutEngine` for which
    distribution that is).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    max_tokens: int = 64
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        errors = self.errors()
        if errors:
            raise ValueError("invalid rollout sampling: " + "; ".join(errors))

    def errors(self) -> list[str]:
        errors = []
        if self.n < 1:
            errors.append(f"n={self.n} must be >= 1")
        if self.temperature < 0:
            errors.append(f"temperature={self.temperature} must be >= 0")
        if self.is_greedy and self.n != 1:
            errors.append(f"temperature=0 (greedy) with n={self.n}: the samples would be identical; use n=1")
        if not 0 < self.top_p <= 1:
            errors.append(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k is not None and self.top_k < 1:
            errors.append(f"top_k={self.top_k} must be >= 1 or None (disabled)")
        if self.max_tokens < 1:
            errors.append(f"max_tokens={self.max_tokens} must be >= 1")
        if self.seed is not None and not 0 <= self.seed < SEED_RANGE:
            errors.append(f"seed={self.seed} must be in [0, 2**31)")
        return errors

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    def with_overrides(self, **changes: Any) -> RolloutSampling:
        return replace(self, **changes)

    def to_vllm(self, request_seed: int | None) -> Any:
        """vLLM `SamplingParams` for ONE sample (n=1): the engine expands n itself, one seed each."""
        from vllm import SamplingParams

        return SamplingParams(
            n=1,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=0 if self.top_k is None else self.top_k,  # vLLM 0.32: 0 disables (older: -1)
            max_tokens=self.max_tokens,
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            seed=request_seed,
            # 0 = only the sampled token's log-prob (no top-k alternatives).
            logprobs=0 if self.logprobs else None,
            detokenize=False,  # the engine has no tokenizer; token ids are the interface
        )


def validation_sampling(
    max_tokens: int, stop_token_ids: tuple[int, ...] = (), ignore_eos: bool = False
) -> RolloutSampling:
    """Greedy, one sample per prompt: the deterministic decode used for validation."""
    return RolloutSampling(
        n=1, temperature=0.0, max_tokens=max_tokens, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, seed=0
    )
