"""Continuous generation for `rollout.async_mode: fully_async`: requests stream through one vLLM
engine step by step, finished prompt groups are handed out as they complete, and a weight sync can
come between any two steps.

`RolloutEngine.generate_sequences` runs a batch to its end. Here the caller drives vLLM's engine
itself (`LLMEngine.add_request` / `step`, delta outputs), so it can
  - `submit` prompts at any time (the controller keeps the pool busy),
  - `advance` until some prompt groups have all their `n` samples (GRPO needs whole groups),
  - `pause` every request in flight at a weight sync and `resume` it afterwards (a partial rollout).

Every generated token is tagged with the policy version that produced it. A paused request is
aborted in vLLM (its KV cache freed: it was computed by the old weights) and, on resume, submitted
again with its prompt plus the tokens it has, for the tokens it still may generate, under a fresh
seed. vLLM then recomputes the whole prefix with the new weights, so each token's log-prob is exactly
that of the weights of its version given its full prefix: the behaviour policy the trainer's
rollout correction needs, token by token. (A request that kept its old KV cache would sample from a
mixture no single weight version defines.)

TP peers of a replica (infer_tp > 1) make the same calls with the same arguments and see the same
tokens (equal seeds), so they step in lock-step: every stopping rule here depends only on tokens and
counts, never on time.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridrl.data.batch import Batch
from hybridrl.rollout.engine import ResponseRow, RolloutEngine, assemble_response_rows, request_seed, sampled_log_probs
from hybridrl.rollout.sampling import RolloutSampling


@dataclass
class _Sample:
    """One of a group's n samples: what it generated so far, and under which weight versions."""

    request_id: str
    seed: int
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    resumes: int = 0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _Group:
    """A prompt and its n samples; `row` is the prompt's row of the batch it was submitted in."""

    uid: Any
    prompt: list[int]
    row: Batch
    sampling: RolloutSampling
    samples: list[_Sample]
    order: int  # submission order, for handing out finished groups oldest first

    @property
    def done(self) -> bool:
        return all(s.done for s in self.samples)


class ContinuousGeneration:
    """Step-driven generation on one `RolloutEngine`; see the module docstring."""

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine
        self._groups: dict[str, _Group] = {}  # by uid
        self._active: dict[str, tuple[_Group, _Sample]] = {}  # request id -> its sample, while in vLLM
        self._paused: list[tuple[_Group, _Sample]] = []
        self._submitted = 0
        self._next_request = 0

    @property
    def in_flight(self) -> int:
        """Samples not finished yet (running in vLLM, or paused)."""
        return sum(1 for g in self._groups.values() for s in g.samples if not s.done)

    @property
    def paused(self) -> int:
        return len(self._paused)

    def _add(self, group: _Group, sample: _Sample) -> None:
        """Start (or continue) `sample` in vLLM: its prompt is the group's prompt plus what it generated."""
        from vllm.sampling_params import RequestOutputKind

        remaining = group.sampling.max_tokens - len(sample.tokens)
        params = group.sampling.with_overrides(max_tokens=remaining).to_vllm(sample.seed)
        params.output_kind = RequestOutputKind.DELTA
        sample.request_id = f"stream-{self._next_request}"
        self._next_request += 1
        self.engine.llm.llm_engine.add_request(sample.request_id,
                                               {"prompt_token_ids": group.prompt + sample.tokens}, params,
                                               lora_request=self.engine.adapter)
        self._active[sample.request_id] = (group, sample)

    def submit(self, prompt_token_ids: Sequence[Sequence[int]], uids: Sequence[Any], sampling: RolloutSampling,
               prompts: Batch) -> None:
        """Start `sampling.n` samples of each prompt (`prompts`: the rows they come from, one per prompt)."""
        if self._paused:
            raise RuntimeError("submit while requests are paused: resume them first (the engine serves new weights)")
        sampling, seed_of = self.engine._prepare(prompt_token_ids, sampling, uids)
        for p, (prompt, uid) in enumerate(zip(prompt_token_ids, uids)):
            key = str(uid)
            if key in self._groups:
                raise ValueError(f"prompt uid {uid!r} is already being generated")
            samples = [_Sample("", seed_of(p, s)) for s in range(sampling.n)]
            group = _Group(uid, [int(t) for t in prompt], prompts.index([p]), sampling, samples, self._submitted)
            self._submitted += 1
            self._groups[key] = group
            for sample in samples:
                self._add(group, sample)

    def advance(self, version: int, *, min_groups: int, max_steps: int) -> list[tuple[Batch, Batch]]:
        """Step vLLM under policy `version` until `min_groups` groups are whole (or `max_steps` steps,
        or nothing runs); the finished groups, oldest first, as (rows, prompt row) pairs."""
        if self._paused:
            raise RuntimeError("advance while requests are paused: resume them first")
        core = self.engine.llm.llm_engine
        started, steps = time.perf_counter(), 0
        new_tokens = 0
        while core.has_unfinished_requests() and steps < max_steps:
            if sum(1 for g in self._groups.values() if g.done) >= min_groups:
                break
            steps += 1
            for output in core.step():
                group, sample = self._active[output.request_id]
                completion = output.outputs[0]
                tokens = list(completion.token_ids)
                sample.tokens += tokens
                sample.log_probs += sampled_log_probs(completion, tokens, group.sampling.logprobs,
                                                      f"request {output.request_id}")
                sample.versions += [version] * len(tokens)
                new_tokens += len(tokens)
                if output.finished:
                    sample.finish_reason = str(completion.finish_reason)
                    del self._active[output.request_id]
        seconds = time.perf_counter() - started
        finished = sorted((g for g in self._groups.values() if g.done), key=lambda g: g.order)
        out = []
        for group in finished:
            del self._groups[str(group.uid)]
            batch = self._rows(group)
            batch.meta["metrics"] = {"rollout/stream_steps": float(steps), "rollout/generate_s": seconds,
                                     "rollout/stream_new_tokens": float(new_tokens)}
            out.append((batch, group.row))
        return out

    def _rows(self, group: _Group) -> Batch:
        """The group's n samples as rollout rows, with `token_versions` ([n, R], -1 on padding)."""
        sampling = group.sampling
        rows = [ResponseRow(s.tokens, [1] * len(s.tokens), s.log_probs, s.finish_reason or "length")
                for s in group.samples]
        batch = assemble_response_rows([group.prompt], rows, sampling.n, sampling.max_tokens,
                                       self.engine.config.pad_token_id, uids=[group.uid])
        versions = torch.full((sampling.n, sampling.max_tokens), -1, dtype=torch.long)
        for i, sample in enumerate(group.samples):
            versions[i, :len(sample.versions)] = torch.tensor(sample.versions, dtype=torch.long)
        batch["token_versions"] = versions
        batch["resumed"] = torch.tensor([s.resumes for s in group.samples], dtype=torch.long)
        return batch

    def pause(self) -> int:
        """Abort every request running in vLLM, keeping what each generated; returns how many."""
        if not self._active:
            return 0
        self.engine.llm.llm_engine.abort_request(list(self._active))
        self._paused = list(self._active.values())
        self._active.clear()
        return len(self._paused)

    def resume(self) -> int:
        """Submit the paused samples again (prompt + their tokens) under fresh seeds; returns how many."""
        paused, self._paused = self._paused, []
        for group, sample in paused:
            sample.resumes += 1
            # a fresh seed: the request's generator restarts, and reusing its noise would correlate
            # the tokens after the pause with those before it
            sample.seed = request_seed(sample.seed, sample.resumes)
            self._add(group, sample)
        return len(paused)
