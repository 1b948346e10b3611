"""Turn rollout rows into the tensors one megatron forward takes: padding removed, responses located.

Rollout rows are `[prompt (left-padded) | response (right-padded)]`, so each row's real tokens
(`attention_mask == 1`) form one contiguous run that may start after some padding. Megatron's
local attention only knows the causal mask, and left padding would let real tokens attend to pad
tokens. We therefore *left-align* every row: rotate it so its real tokens start at column 0. The
row is then right-padded only, where the causal mask alone is exact (a real token never looks at a
later column), and no attention mask is needed. Each micro-batch is then trimmed to its longest
real length, which removes the padding megatron would otherwise compute on.

After alignment, response token j of row i sits at column `start_i + j` (`start_i` = the row's
real prompt length), and the logits (or hidden states) that predict it are those of column
`start_i + j - 1`: `ModelInputs.predict_index` holds those columns, clamped into the trimmed
width. Positions past a row's response are garbage by construction and must be masked with
`response_mask` (every consumer here does).

Packed micro-batches (`packed=True`, the model config's `use_remove_padding`): the aligned rows'
real tokens are concatenated into one sequence `[1, t]` (t = the real tokens of all rows, rounded
up to `pad_multiple` by a trailing padding segment) and `cu_seqlens` marks where each row starts,
so attention stays within a row (megatron's THD format, `PackedSeqParams`) and no column is spent
on padding. Under context parallelism each row's segment is itself padded to `segment_multiple`
(2 × CP: TE's THD layout cuts every segment into 2 × CP chunks); `cu_seqlens` then bounds the padded
segments, and a segment's padding columns follow its real tokens, where causality keeps them out of
every real token's attention. `predict_index` and `last_index` keep their per-row meaning (a column of the row);
`packed_columns` puts a row's column into the packed sequence, and `token_index`/`take` read the
model's output in either layout, so the consumers (log-probs, values, scores) do not depend on the choice.

Shared prompts (`shared_prefix=True`, packed only: the model section's `shared_prefix`): rows whose real
prompts are the same tokens at the same positions (GRPO's n samples of one prompt, and any repeated
prompt) that land in one micro-batch form one segment `[prompt, response_1, ..., response_k]`: the
prompt once, then each row's response tokens. `prefix_branches` marks each token's branch (0: the
prompt, i: the i-th response), from which the CPU layer's attention stand-in lets each response attend
to the prompt and causally to itself only; every token keeps its row's position (prompt 0..P-1, each
response from P), which the stand-in's packed RoPE slot rotates by. `packed_columns` maps a row's prompt
columns into the shared prompt and its response columns into its own run, so response token j of every
row is read from the same column as alone: the first from the prompt's last (shared) hidden state.
The prompt's forward runs once and its gradient is the sum of its responses' (the backward of the
shared columns), which are the numbers of training each row alone on (k - 1) * P fewer tokens. A row
alone in its micro-batch with its prompt is an ordinary segment.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

# Columns the model forward needs from a rollout batch.
MODEL_INPUT_KEYS: tuple[str, ...] = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")


class SequenceLayoutError(ValueError):
    """A batch whose rows are not `[left-padded prompt | right-padded response]`."""


@dataclass
class ModelInputs:
    """One micro-batch, aligned and trimmed, ready for `model(input_ids, position_ids, None)`.

    `input_ids`/`position_ids` are `[b, s]` (s = longest real row, rounded up to `pad_multiple`);
    `predict_index` `[b, R]` is the column whose output predicts response token j;
    `responses`/`response_mask` `[b, R]` are the labels and their mask; `last_index` `[b]` is each
    row's last real column (the reward model's score position). `extras` carries per-row tensors
    the loss needs (old log-probs, advantages, ...), sliced like the rows.
    """

    input_ids: Tensor
    position_ids: Tensor
    predict_index: Tensor
    responses: Tensor
    response_mask: Tensor
    last_index: Tensor
    extras: dict[str, Tensor] = field(default_factory=dict)
    # Packed layout only (see the module docstring): int32 `[segments + 1]` boundaries of the segments
    # in the packed sequence (a row's, padded to `segment_multiple`; a shared prompt's group; and a
    # trailing padding segment when `pad_multiple` needed one), the longest segment, and `[b, w]` the
    # packed column of each row's column (w = the longest row; past a row's end, its last column).
    cu_seqlens: Tensor | None = None
    max_seqlen: int = 0
    packed_columns: Tensor | None = None
    # Shared prompts (`shared_prefix`, packed only): `[t]` each packed token's branch in its segment, 0 for
    # a segment's shared prompt (and every token of an unshared segment), i for the i-th response sampled
    # from it; None when no segment of this micro-batch shares a prompt.
    prefix_branches: Tensor | None = None
    # Real tokens the model computes (a shared prompt once), the columns it computes (padding included) and
    # the rows' real tokens (a shared prompt once per row): counted where the batch is cut (the host), so
    # reading them costs no device sync.
    real_tokens: int = 0
    computed_tokens: int = 0
    row_tokens: int = 0
    # Routing replay (actor.router_replay: rollout): the rollout's `routed_experts` aligned like
    # `input_ids` ([b, s, moe_layers, top_k], or [1, t, ...] packed; -1 where vLLM routed nothing).
    routed_experts: Tensor | None = None
    # `response_token_positions`, computed once: a forward, its loss and the scatters back all read it,
    # and `nonzero` waits for the device each time it runs.
    _response_positions: tuple[Tensor, Tensor] | None = field(default=None, init=False, repr=False, compare=False)

    def map_tensors(self, fn: Callable[[Tensor], Tensor]) -> ModelInputs:
        """The same micro-batch with `fn` applied to every tensor (inputs and extras), e.g. a device move."""
        return ModelInputs(
            input_ids=fn(self.input_ids), position_ids=fn(self.position_ids), predict_index=fn(self.predict_index),
            responses=fn(self.responses), response_mask=fn(self.response_mask), last_index=fn(self.last_index),
            extras={k: fn(v) for k, v in self.extras.items()},
            cu_seqlens=None if self.cu_seqlens is None else fn(self.cu_seqlens), max_seqlen=self.max_seqlen,
            packed_columns=None if self.packed_columns is None else fn(self.packed_columns),
            prefix_branches=None if self.prefix_branches is None else fn(self.prefix_branches),
            real_tokens=self.real_tokens, computed_tokens=self.computed_tokens, row_tokens=self.row_tokens,
            routed_experts=None if self.routed_experts is None else fn(self.routed_experts),
        )

    @property
    def is_packed(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def row_starts(self) -> Tensor | None:
        """Packed: each row's first column `[b]` (a shared prompt's rows: the same one)."""
        return None if self.packed_columns is None else self.packed_columns[:, 0]

    def padding_mask(self) -> Tensor:
        """`[b, s]` bool, True at the columns that hold no token of a row (after each row's real run;
        packed: the columns no row's token is at, i.e. each segment's padding and the trailing padding
        segment): megatron's MoE `padding_mask`, which keeps them out of the router's aux and z-losses
        and its token counts."""
        columns = torch.arange(self.input_ids.shape[1], device=self.input_ids.device).unsqueeze(0)
        if self.is_packed:
            packed = self.packed_columns
            if packed is None:
                raise ValueError("a packed ModelInputs (cu_seqlens set) has no packed_columns")
            real = torch.arange(packed.shape[1], device=columns.device).unsqueeze(0) <= self.last_index.unsqueeze(1)
            held = torch.zeros(self.input_ids.shape[1], dtype=torch.bool, device=columns.device)
            return ~held.index_fill_(0, packed[real], True).unsqueeze(0)
        return columns > self.last_index.unsqueeze(1)

    def token_index(self, rows: Tensor, columns: Tensor) -> tuple[Tensor, Tensor]:
        """(batch index, sequence index) in the model's `[b, s]` input of column `columns` of row `rows`."""
        if self.packed_columns is None:
            return rows, columns
        return torch.zeros_like(rows), self.packed_columns[rows, columns]

    def take(self, output: Tensor, index: Tensor) -> Tensor:
        """The model's `output` `[b, s, ...]` (or `[1, t, ...]` packed) at columns `index` `[rows, k]` of
        each row -> `[rows, k, ...]`."""
        if self.packed_columns is None:
            return take_predictions(output, index)
        return output[0][self.packed_columns.gather(1, index)]

    def response_token_positions(self) -> tuple[Tensor, Tensor]:
        """(row, response column) of every real response token (`response_mask != 0`), row-major.

        A micro-batch without any real response token yields (0, 0) alone, a masked position: a
        forward and its backward need at least one column.
        """
        if self._response_positions is None:
            rows, cols = torch.nonzero(self.response_mask != 0, as_tuple=True)
            if rows.numel() == 0:
                rows = cols = torch.zeros(1, dtype=torch.long, device=self.response_mask.device)
            self._response_positions = (rows, cols)
        return self._response_positions

    def scatter_response_tokens(self, values: Tensor) -> Tensor:
        """Per-token `values` `[N, ...]` (in `response_token_positions` order) as `[b, R, ...]`, 0 elsewhere."""
        rows, cols = self.response_token_positions()
        out = values.new_zeros((*self.response_mask.shape, *values.shape[1:]))
        return out.index_put((rows, cols), values)

    @property
    def segment_bounds(self) -> list[int]:
        """The model input's segments along its sequence, as host ints: a packed micro-batch's
        `cu_seqlens`, else `[0, s]` (every row one segment of the trimmed width). Context parallelism
        cuts each segment into 2 × CP chunks (`hybridrl.parallel.context_parallel`)."""
        if self.cu_seqlens is None:
            return [0, self.seq_length]
        return [int(b) for b in self.cu_seqlens.tolist()]

    @property
    def num_rows(self) -> int:
        """Rows of the micro-batch (sequences), whatever the layout."""
        return int(self.responses.shape[0])

    @property
    def model_batch_size(self) -> int:
        """The batch dimension of the model's input: the rows, or 1 when packed."""
        return int(self.input_ids.shape[0])

    @property
    def seq_length(self) -> int:
        return int(self.input_ids.shape[1])


def real_token_runs(attention_mask: Tensor) -> tuple[Tensor, Tensor]:
    """(first real column, number of real tokens) per row; raise unless each row's real tokens are contiguous."""
    mask = attention_mask != 0
    lengths = mask.sum(-1)
    if bool((lengths == 0).any()):
        rows = torch.nonzero(lengths == 0).flatten().tolist()
        raise SequenceLayoutError(f"rows {rows[:8]} have no real token (attention_mask all 0)")
    first = mask.to(torch.int8).argmax(-1)
    columns = torch.arange(mask.shape[1], device=mask.device).unsqueeze(0)
    expected = (columns >= first.unsqueeze(1)) & (columns < (first + lengths).unsqueeze(1))
    if not torch.equal(expected, mask):
        bad = torch.nonzero((expected != mask).any(-1)).flatten().tolist()
        raise SequenceLayoutError(
            f"rows {bad[:8]}: attention_mask has holes; rows must be [left-padded prompt | right-padded "
            "response] with one contiguous run of real tokens"
        )
    return first, lengths


def build_model_inputs(
    input_ids: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor,
    responses: Tensor,
    response_mask: Tensor,
    *,
    extras: dict[str, Tensor] | None = None,
    pad_multiple: int = 1,
    packed: bool = False,
    segment_multiple: int = 1,
    routed_experts: Tensor | None = None,
    min_width: int | None = None,
    shared_prefix: bool = False,
) -> ModelInputs:
    """Left-align rows, trim to the longest real row (rounded up to `pad_multiple`), locate responses;
    with `packed`, concatenate the rows' real tokens instead, each row's segment padded to
    `segment_multiple` and the whole to `pad_multiple` (see the module docstring). `min_width`
    (padded only): at least this many columns, e.g. the same width on ranks whose rows differ.
    `shared_prefix` (packed only): rows whose prompts are the same tokens hold that prompt once (module
    docstring); the model needs the CPU layer's attention stand-in to honour the segment's tree.

    `input_ids` must end with `responses` (`input_ids[:, -R:] == responses`), as the rollout lays
    them out. Every row needs at least one real prompt token (the first response token is predicted
    from the last prompt token).
    """
    full_width = input_ids.shape[1]
    resp_len = responses.shape[1]
    if resp_len > full_width or not torch.equal(input_ids[:, full_width - resp_len:], responses):
        raise SequenceLayoutError("input_ids must end with the responses ([prompt | response] rows)")
    first, lengths = real_token_runs(attention_mask)
    prompt_width = full_width - resp_len
    prompt_lengths = prompt_width - first
    if bool((prompt_lengths < 1).any()):
        raise SequenceLayoutError("every row needs at least one real prompt token")

    longest = int(lengths.max())
    if packed and min_width is not None:
        raise ValueError("min_width applies to padded micro-batches, not packed ones")
    if shared_prefix and not packed:
        raise ValueError("shared_prefix needs packed micro-batches: a padded row holds its own prompt")
    # Rounding up may pass the rollout's width (e.g. 2 × CP chunks of a full row): the columns past it
    # wrap around like the others after a row's real run, and nothing real ever reads them.
    trimmed = longest if packed else -(-max(longest, min_width or 0) // pad_multiple) * pad_multiple
    # Rotating by `first` puts the real run at column 0; whatever wraps around lands after it.
    source = (torch.arange(trimmed, device=input_ids.device).unsqueeze(0) + first.unsqueeze(1)) % full_width
    aligned_ids = torch.gather(input_ids, 1, source)
    aligned_positions = torch.gather(position_ids, 1, source)
    aligned_routing = None
    if routed_experts is not None:
        if routed_experts.shape[:2] != input_ids.shape:
            raise SequenceLayoutError(f"routed_experts {tuple(routed_experts.shape)} is not aligned with "
                                      f"input_ids {tuple(input_ids.shape)}")
        # the same rotation as the tokens; columns that wrap around are padding (-1)
        routing_source = source.reshape(*source.shape, 1, 1).expand(*source.shape, *routed_experts.shape[2:])
        aligned_routing = torch.gather(routed_experts, 1, routing_source)
        past = torch.arange(trimmed, device=input_ids.device).unsqueeze(0) >= lengths.unsqueeze(1)
        aligned_routing = aligned_routing.masked_fill(past.reshape(*past.shape, 1, 1), -1)

    steps = torch.arange(resp_len, device=input_ids.device).unsqueeze(0)
    # A row's columns stop at its own last real token when packed (the next column is another row's).
    limit = (lengths - 1).unsqueeze(1) if packed else trimmed - 1
    predict_index = torch.minimum(prompt_lengths.unsqueeze(1) - 1 + steps, torch.as_tensor(limit))
    real_tokens = int(lengths.sum())
    if not packed:
        return ModelInputs(
            input_ids=aligned_ids.contiguous(),
            position_ids=aligned_positions.contiguous(),
            predict_index=predict_index,
            responses=responses,
            response_mask=response_mask,
            last_index=lengths - 1,
            extras=dict(extras or {}),
            real_tokens=real_tokens,
            computed_tokens=int(aligned_ids.numel()),
            row_tokens=real_tokens,
            routed_experts=aligned_routing,
        )
    groups = (prompt_groups(input_ids, attention_mask, position_ids, prompt_width) if shared_prefix
              else [[r] for r in range(lengths.shape[0])])
    if shared_prefix and segment_multiple > 1:
        raise ValueError("shared_prefix with context parallelism (segment_multiple > 1) is not served: a shared "
                         "segment is not a causal run TE's THD split could cut into 2 x CP chunks")
    if shared_prefix and routed_experts is not None:
        raise ValueError("shared_prefix with routing replay is not served: each row carries the rollout's own "
                         "routing of its prompt, and a shared prompt is routed once")
    layout = _pack_layout(groups, prompt_lengths.tolist(), lengths.tolist(), segment_multiple, pad_multiple)
    device = input_ids.device
    segments = torch.tensor(layout.segments, dtype=torch.long, device=device)
    total = int(segments.sum())
    cu_seqlens = torch.cat([segments.new_zeros(1), segments.cumsum(0)]).to(torch.int32)
    # packed column of every (row, column): the prompt's columns from where the row's prompt sits (shared
    # by its group), the response's from where the row's own response sits; past a row's end, its last column
    column = torch.minimum(torch.arange(trimmed, device=device).unsqueeze(0), (lengths - 1).unsqueeze(1))
    prompt_start = torch.tensor(layout.prompt_starts, dtype=torch.long, device=device).unsqueeze(1)
    response_start = torch.tensor(layout.response_starts, dtype=torch.long, device=device).unsqueeze(1)
    in_prompt = column < prompt_lengths.unsqueeze(1)
    packed_columns = torch.where(in_prompt, prompt_start + column,
                                 response_start + column - prompt_lengths.unsqueeze(1))
    real = torch.arange(trimmed, device=device).unsqueeze(0) < lengths.unsqueeze(1)
    dest = packed_columns[real]  # a shared prompt's columns appear once per row, with the same token each time
    segment_starts = torch.repeat_interleave(cu_seqlens[:-1].to(torch.long), segments, output_size=total)
    # Padding columns are token 0 at their position within their segment.
    flat_ids = aligned_ids.new_zeros(total).index_put_((dest,), aligned_ids[real])
    flat_positions = (torch.arange(total, device=device) - segment_starts).to(aligned_positions.dtype)
    flat_positions = flat_positions.index_put_((dest,), aligned_positions[real])
    branches = None
    if layout.branch_runs:
        branches = torch.zeros(total, dtype=torch.long, device=device)
        for start, length, branch in layout.branch_runs:
            branches[start:start + length] = branch
    flat_routing = None
    if aligned_routing is not None:
        flat_routing = aligned_routing.new_full((total, *aligned_routing.shape[2:]), -1)
        flat_routing = flat_routing.index_put_((dest,), aligned_routing[real])
    return ModelInputs(
        input_ids=flat_ids.unsqueeze(0).contiguous(),
        position_ids=flat_positions.unsqueeze(0).contiguous(),
        predict_index=predict_index,
        responses=responses,
        response_mask=response_mask,
        last_index=lengths - 1,
        extras=dict(extras or {}),
        cu_seqlens=cu_seqlens,
        max_seqlen=int(segments.max()),
        packed_columns=packed_columns,
        prefix_branches=branches,
        real_tokens=layout.real_tokens,
        computed_tokens=total,
        row_tokens=real_tokens,
        routed_experts=None if flat_routing is None else flat_routing.unsqueeze(0).contiguous(),
    )


def prompt_groups(input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor,
                  prompt_width: int) -> list[list[int]]:
    """Rows of rollout rows `[B, T]` whose real prompts (the first `prompt_width` columns, left-padded) are
    the same tokens at the same positions, as lists of rows in the order of each group's first row."""
    mask = attention_mask[:, :prompt_width] != 0
    key = torch.cat([mask.to(input_ids.dtype), torch.where(mask, input_ids[:, :prompt_width], -1),
                     torch.where(mask, position_ids[:, :prompt_width].to(input_ids.dtype), -1)], dim=1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    groups: dict[int, list[int]] = {}
    for row, label in enumerate(inverse.tolist()):
        groups.setdefault(label, []).append(row)
    return list(groups.values())


@dataclass(frozen=True)
class _PackLayout:
    """Where each row's prompt and response start in the packed sequence (host ints), the segments' lengths,
    the runs of each shared segment's responses `(start, length, branch)` (branch 1, 2, ... in a segment),
    and the real tokens the pack holds (a shared prompt counted once)."""

    prompt_starts: list[int]
    response_starts: list[int]
    segments: list[int]
    branch_runs: list[tuple[int, int, int]]
    real_tokens: int


def _pack_layout(groups: list[list[int]], prompt_lengths: list[int], lengths: list[int], segment_multiple: int,
                 pad_multiple: int) -> _PackLayout:
    """One segment per group: a lone row's real tokens (padded to `segment_multiple`), or a shared prompt
    followed by each row's response; then a padding segment up to a multiple of `pad_multiple`."""
    rows = len(lengths)
    prompt_starts, response_starts = [0] * rows, [0] * rows
    segments: list[int] = []
    runs: list[tuple[int, int, int]] = []
    position = real = 0
    for group in groups:
        start = position
        if len(group) == 1:
            (row,) = group
            prompt_starts[row], response_starts[row] = start, start + prompt_lengths[row]
            real += lengths[row]
            position = start + -(-lengths[row] // segment_multiple) * segment_multiple
        else:
            prompt = prompt_lengths[group[0]]
            position += prompt
            real += prompt
            for branch, row in enumerate(group, start=1):
                prompt_starts[row], response_starts[row] = start, position
                runs.append((position, lengths[row] - prompt, branch))
                position += lengths[row] - prompt
                real += lengths[row] - prompt
        segments.append(position - start)
    total = -(-position // pad_multiple) * pad_multiple
    if total > position:
        # Padding columns form their own segment: they attend only to each other, never to a row.
        segments.append(total - position)
    return _PackLayout(prompt_starts, response_starts, segments, runs, real)


def take_predictions(output: Tensor, index: Tensor) -> Tensor:
    """`output` `[b, s, ...]` at columns `index` `[b, k]` per row -> `[b, k, ...]`."""
    expand = index.reshape(*index.shape, *([1] * (output.dim() - 2))).expand(*index.shape, *output.shape[2:])
    return torch.gather(output, 1, expand)


def micro_batch_inputs(
    tensors: dict[str, Tensor], rows: list[int], *, extra_keys: tuple[str, ...] = (), pad_multiple: int = 1,
    min_width: int | None = None, packed: bool = False, segment_multiple: int = 1, routed_experts: bool = False,
    shared_prefix: bool = False,
) -> ModelInputs:
    """`build_model_inputs` for the given rows of a batch's tensors (the `MODEL_INPUT_KEYS` + `extra_keys`,
    and with `routed_experts` the rollout's `routed_experts` column, aligned like the tokens)."""
    keys = (*MODEL_INPUT_KEYS, *extra_keys, *(("routed_experts",) if routed_experts else ()))
    missing = [k for k in keys if k not in tensors]
    if missing:
        raise KeyError(f"batch lacks columns {missing}")
    index = torch.tensor(rows, dtype=torch.long)
    pick = {k: tensors[k].index_select(0, index.to(tensors[k].device)) for k in keys}
    return build_model_inputs(
        pick["input_ids"], pick["attention_mask"], pick["position_ids"], pick["responses"], pick["response_mask"],
        extras={k: pick[k] for k in extra_keys}, pad_multiple=pad_multiple, packed=packed,
        segment_multiple=segment_multiple, routed_experts=pick.get("routed_experts"), min_width=min_width,
        shared_prefix=shared_prefix,
    )
