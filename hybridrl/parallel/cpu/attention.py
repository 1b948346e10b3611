"""A CPU stand-in for megatron's core attention on packed (THD) sequences.

megatron-core 0.16's local layer spec (the only one on CPU: TransformerEngine cannot be installed
there) uses `DotProductAttention`, which asserts ``packed_seq_params is None``: only TE's attention
honours `cu_seqlens`. `CpuPackedDotProductAttention` takes its place in the local spec wherever the
device policy runs megatron through the CPU layer (`hybridrl.models.bridge.layer_spec`):

- unpacked input (`packed_seq_params` None) goes to megatron's own forward, unchanged;
- packed input (``qkv_format == "thd"``: query `[t, heads, d]`, key and value `[t, kv heads, d]`,
  `cu_seqlens_q == cu_seqlens_kv`) is cut at the segment boundaries into the rows of one batch padded
  to the longest segment, and runs through megatron's own forward once, causal within each row with
  the padding masked as keys. So a packed row sees exactly the numbers it would see alone (GQA's
  key/value repetition, the softmax scale, the causal mask and the attention dropout stream are
  megatron's), and no score is computed between rows: the cost is rows × the longest segment squared
  (only attention pads; the projections and the MLP around it run on the packed tokens).

The output is `[t, 1, heads * d]`; megatron's attention reshapes it as it does TE's `[t, heads * d]`.

Context parallelism (`context_parallel_size` > 1; megatron's local attention asserts CP = 1, TE's
ring attention serves it on GPUs): each CP rank holds its columns of every sequence in megatron's
load-balanced order (`hybridrl.parallel.context_parallel`). The stand-in all-gathers the keys and
values over the CP group (`gather_from_cp`: backward = reduce-scatter of their gradients), and runs
megatron's own forward for its local queries against the whole sequence's keys, with the causal mask
built from the queries' global columns (key column > query column is masked, with megatron's own
mask function, so the numbers are those of CP = 1). This is all-gather KV, not a ring: each rank
holds the whole sequence's keys and values for one layer at a time, which is what a CPU stand-in
can afford. Packed input under CP is TE's THD layout: `cu_seqlens` are the global boundaries of
segments padded to a multiple of 2 × CP, and the rank holds chunks r and 2CP−1−r of each segment
(its `[t / CP, heads, d]` query). The gathered keys are put back in global order with the same
boundaries, and each segment's local queries attend to that segment's keys, masked by position
within the segment.
The loop reads the boundaries on the host (`cu_seqlens.tolist()`), which is free on CPU, and is the
reason this stays a CPU stand-in: on GPUs TE's fused kernel does it without a device sync.

`fused_rope_thd` fills megatron's packed-RoPE slot the same way `cpu_rope` fills the unpacked one:
with `apply_rope_fusion=True` megatron calls `fused_apply_rotary_pos_emb_thd`, which is TE's and
None here. Each token's angle is that of its position within its own segment (megatron's unfused
THD formula; under CP the position of the global column the rank's token is), then
`cpu_rope.rotary_embedding_half_split` rotates.

Shared prompts (the training layer's `shared_prefix`; CPU only: TE's attention has no such mask). A
segment may hold one prompt and the responses sampled from it, `[prompt, response_1, ..., response_k]`
(`hybridrl.training.sequences`): each response attends to the prompt and causally to itself, never to
another response, and every token is rotated by its position in its own row (the prompt 0..P-1, each
response from P), not by its column in the segment. `shared_prefix_seq_params` builds the
`PackedSeqParams` of such a pack: its `cu_seqlens` tensor carries a `SharedPrefixPack` (each token's
position and the attention rows below) as an attribute, the way megatron tags tensors with
attributes, because megatron hands the RoPE slot nothing but that tensor. The attention then runs in
rows again: one row per segment's prompt (its queries against its own keys, causal) and one per
response (its queries against the prompt's keys followed by its own, causal from the prompt's end):
`AttentionRows`, whose plain case (every segment one row, queries = keys) is exactly the unshared
packed attention above. A prompt's keys and values are gathered into each of its responses' rows, so
their gradients sum over the responses in the backward.
"""
from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Any

import torch

from hybridrl.parallel.context_parallel import cp_columns, gather_from_cp
from hybridrl.parallel.cpu.rope import rotary_embedding_half_split

# The attribute of a shared-prefix pack's `cu_seqlens` tensor that holds its `SharedPrefixPack`.
SHARED_PREFIX_ATTRIBUTE = "hybridrl_shared_prefix"


@dataclass(frozen=True)
class AttentionRows:
    """Packed attention as one batch of rows, each row a set of queries and the keys they may see.

    `key_index` `[rows, k]`: the packed tokens that are each row's keys, in order (padding cells: token 0);
    `query_index` `[rows, q]`: its queries, the trailing run of its keys (a response's row: its keys after
    the prompt's), `query_real` marking the real cells; `masked` `[rows, 1, q, k]` (True = not attended):
    a query sees its row's keys up to itself, never a padding cell. Every packed token is the query of
    exactly one row.
    """

    key_index: torch.Tensor
    query_index: torch.Tensor
    query_real: torch.Tensor
    masked: torch.Tensor


def attention_rows(bounds: list[int], branches: list[int] | None = None) -> AttentionRows:
    """The rows of a pack with segments at `bounds`: one per segment; with `branches` (each token's
    branch in its segment, 0 = the shared prompt), a segment's prompt is one row and each response
    another, whose keys are the prompt's followed by its own (queries from the prompt's end)."""
    if branches is None or not any(branches):  # every segment one row, queries = keys: vectorized
        starts = torch.tensor([a for a, b in zip(bounds[:-1], bounds[1:]) if b > a], dtype=torch.long)
        lengths = torch.tensor([b - a for a, b in zip(bounds[:-1], bounds[1:]) if b > a], dtype=torch.long)
        column = torch.arange(int(lengths.max()))
        real = column.unsqueeze(0) < lengths.unsqueeze(1)  # [rows, longest]
        index = torch.where(real, starts.unsqueeze(1) + column.unsqueeze(0), 0)
        later = column.view(1, 1, -1) > column.view(1, -1, 1)  # [1, q, k]: a later key
        return AttentionRows(index, index, real, (later | ~real.unsqueeze(1)).unsqueeze(1))
    rows: list[tuple[list[int], int]] = []  # (key tokens, query offset)
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b == a:
            continue
        if not any(branches[a:b]):
            rows.append((list(range(a, b)), 0))
            continue
        prompt = a
        while prompt < b and branches[prompt] == 0:
            prompt += 1
        keys = list(range(a, prompt))
        if prompt > a:
            rows.append((keys, 0))
        start = prompt
        while start < b:
            end = start
            while end < b and branches[end] == branches[start]:
                end += 1
            if branches[start] == 0:
                raise ValueError(f"segment [{a}, {b}): branch 0 (the shared prompt) must come first, found it at "
                                 f"{start}")
            rows.append((keys + list(range(start, end)), len(keys)))
            start = end
    longest_keys = max(len(k) for k, _ in rows)
    longest_queries = max(len(k) - o for k, o in rows)
    count = len(rows)
    key_index = torch.zeros(count, longest_keys, dtype=torch.long)
    key_real = torch.zeros(count, longest_keys, dtype=torch.bool)
    query_index = torch.zeros(count, longest_queries, dtype=torch.long)
    query_real = torch.zeros(count, longest_queries, dtype=torch.bool)
    offsets = torch.zeros(count, dtype=torch.long)
    for u, (keys, offset) in enumerate(rows):
        key_index[u, :len(keys)] = torch.tensor(keys)
        key_real[u, :len(keys)] = True
        query_index[u, :len(keys) - offset] = torch.tensor(keys[offset:])
        query_real[u, :len(keys) - offset] = True
        offsets[u] = offset
    later = (torch.arange(longest_keys).view(1, 1, -1)
             > (offsets.view(-1, 1, 1) + torch.arange(longest_queries).view(1, -1, 1)))  # [rows, q, k]
    masked = (later | ~key_real.unsqueeze(1)).unsqueeze(1)
    return AttentionRows(key_index, query_index, query_real, masked)


@dataclass(frozen=True)
class SharedPrefixPack:
    """What a shared-prefix pack's `cu_seqlens` carries: each packed token's position in its own row `[t]`
    (the RoPE slot) and the attention's rows (module docstring)."""

    positions: torch.Tensor
    rows: AttentionRows


def shared_prefix_seq_params(cu_seqlens: torch.Tensor, max_seqlen: int, positions: torch.Tensor,
                             branches: torch.Tensor) -> Any:
    """megatron's `PackedSeqParams` of a pack whose segments may share a prompt (`branches` `[t]`: each
    token's branch in its segment, 0 = the prompt; `positions` `[t]`: its position in its row). CPU only:
    the tree is read by this module's attention stand-in and RoPE slot."""
    from megatron.core.packed_seq_params import PackedSeqParams

    bounds = [int(b) for b in cu_seqlens.tolist()]
    if positions.shape != branches.shape or positions.shape[0] != bounds[-1]:
        raise ValueError(f"positions {tuple(positions.shape)} and branches {tuple(branches.shape)} must both cover "
                         f"the {bounds[-1]} packed tokens")
    if int(positions.max()) >= max_seqlen:
        raise ValueError(f"a token at position {int(positions.max())} is past max_seqlen={max_seqlen}: megatron "
                         "computes RoPE angles for positions below it only")
    pack = SharedPrefixPack(positions.to(torch.long), attention_rows(bounds, [int(b) for b in branches.tolist()]))
    tagged = cu_seqlens.clone()  # our own tensor to carry the tree: megatron passes it on untouched
    setattr(tagged, SHARED_PREFIX_ATTRIBUTE, pack)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=tagged, cu_seqlens_kv=tagged,
                           max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)


def shared_prefix_pack(cu_seqlens: torch.Tensor | None) -> SharedPrefixPack | None:
    """The `SharedPrefixPack` a pack's `cu_seqlens` carries, None for an ordinary pack."""
    return getattr(cu_seqlens, SHARED_PREFIX_ATTRIBUTE, None)


def segment_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Each of the `total` packed tokens' position within its segment (0 at every boundary)."""
    starts = cu_seqlens[:-1].to(torch.long)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.long)
    token_start = torch.repeat_interleave(starts, lengths, output_size=total)
    return torch.arange(total, device=cu_seqlens.device) - token_start


def fused_rope_thd(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor, cp_size: int = 1,
                   cp_rank: int = 0) -> torch.Tensor:
    """megatron's packed fused-RoPE slot signature (TE's): `t` `[t, h, d]` (this CP rank's tokens),
    `cu_seqlens` the global segment boundaries, `freqs` `[max_s, 1, 1, rot_dim]`."""
    local = t.shape[0]
    total = int(cu_seqlens[-1])
    if total != local * cp_size:
        raise ValueError(f"cu_seqlens ends at {total}, the packed tensor has {local} tokens"
                         + (f" on each of {cp_size} CP ranks" if cp_size > 1 else ""))
    shared = shared_prefix_pack(cu_seqlens)
    if shared is not None:  # each token at its position in its own row (a response continues its prompt)
        if cp_size > 1:
            raise ValueError("a shared-prefix pack under context parallelism is not served")
        return rotary_embedding_half_split(t.unsqueeze(1), freqs[shared.positions.to(t.device)]).squeeze(1)
    positions = segment_positions(cu_seqlens, total)  # every global column's position in its segment
    if cp_size > 1:
        positions = positions[cp_columns(cu_seqlens.tolist(), cp_size, cp_rank, positions.device)]
    packed_freqs = freqs[positions]  # [t, 1, 1, rot_dim]
    return rotary_embedding_half_split(t.unsqueeze(1), packed_freqs).squeeze(1)


def install_cpu_packed_rope() -> bool:
    """Put `fused_rope_thd` in megatron's empty packed fused-RoPE slot (idempotent); True when it is there."""
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils.fused_apply_rotary_pos_emb_thd is None:
        rope_utils.fused_apply_rotary_pos_emb_thd = fused_rope_thd
    return rope_utils.fused_apply_rotary_pos_emb_thd is fused_rope_thd


def _packed_attention_class() -> type:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class CpuPackedDotProductAttention(DotProductAttention):
        """megatron's `DotProductAttention`, plus packed (THD) input run segment by segment and context
        parallelism by all-gathered keys and values (module docstring)."""

        def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
            # megatron asserts CP = 1 here (only TE's attention implements CP); nothing else in its
            # __init__ reads the CP size, so it is built from a copy that says 1 and keeps the real config.
            built_with = config
            if config.context_parallel_size > 1:
                built_with = copy.copy(config)
                built_with.context_parallel_size = 1
            super().__init__(built_with, *args, **kwargs)
            self.config = config

        def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, attn_mask_type: Any = None,
                    attention_bias: torch.Tensor | None = None, packed_seq_params: Any = None) -> torch.Tensor:
            cp = self.config.context_parallel_size
            if packed_seq_params is None and cp == 1:
                return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                       attention_bias=attention_bias)
            if packed_seq_params is None:  # [s / cp, b, heads, d]: every row one segment of s
                if attention_mask is not None:
                    raise ValueError("context parallelism takes no attention mask here: causality over the "
                                     "global columns defines it")
                return self._context_parallel_forward(query, key, value, [0, query.shape[0] * cp],
                                                      attn_mask_type, attention_bias)
            bounds = self._packed_bounds(query, packed_seq_params, attention_mask, cp)
            shared = shared_prefix_pack(packed_seq_params.cu_seqlens_q)
            if cp > 1:  # [t / cp, heads, d] -> one row: [t / cp, 1, heads, d]
                if shared is not None:
                    raise ValueError("a shared-prefix pack under context parallelism is not served")
                return self._context_parallel_forward(query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1),
                                                      bounds, attn_mask_type, attention_bias)
            rows = attention_rows(bounds) if shared is None else shared.rows
            return self._packed_forward(query, key, value, rows, attn_mask_type, attention_bias)

        def _packed_forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: AttentionRows,
                            attn_mask_type: Any, attention_bias: torch.Tensor | None) -> torch.Tensor:
            """The pack's attention rows (`AttentionRows`: every segment, or a shared segment's prompt and each
            of its responses) as one batch padded to the longest, in one call of megatron's forward: each
            query row sees its keys causally, the padding masked as keys (its query cells are dropped), so
            each segment's numbers are those it would get alone. `[t, heads, d]` -> `[t, 1, heads * d]`."""
            device = query.device
            count, longest_queries = rows.query_index.shape
            longest_keys = rows.key_index.shape[1]

            def to_rows(x: torch.Tensor, index: torch.Tensor, length: int) -> torch.Tensor:
                # [t, h, d] -> [length, rows, h, d], column-major like megatron's [s, b]
                return x.index_select(0, index.t().reshape(-1).to(device)).view(length, count, *x.shape[1:])

            out = super().forward(to_rows(query, rows.query_index, longest_queries),
                                  to_rows(key, rows.key_index, longest_keys),
                                  to_rows(value, rows.key_index, longest_keys), rows.masked.to(device),
                                  attn_mask_type=attn_mask_type, attention_bias=attention_bias)  # [q, rows, h * d]
            keep = rows.query_real.t().reshape(-1).to(device)  # the cells that are tokens, in the same order
            flat = out.reshape(longest_queries * count, -1)[keep]  # column-major: query j of every row, then j + 1
            order = rows.query_index.t().reshape(-1).to(device)[keep]  # their packed positions
            packed = torch.empty_like(flat).index_copy(0, order, flat)
            return packed.unsqueeze(1)  # [t, 1, heads * d]

        @staticmethod
        def _packed_bounds(query: torch.Tensor, params: Any, attention_mask: torch.Tensor | None,
                           cp: int) -> list[int]:
            """The segments' global boundaries (`cu_seqlens`), checked against what this stand-in serves."""
            if params.qkv_format != "thd":
                raise ValueError(f"packed sequences in format {params.qkv_format!r}; this stand-in serves 'thd'")
            cu_q, cu_kv = params.cu_seqlens_q, params.cu_seqlens_kv
            if cu_kv is not None and cu_kv is not cu_q and not torch.equal(cu_q, cu_kv):
                raise ValueError("cu_seqlens_q and cu_seqlens_kv differ: only self-attention is served")
            for padded in (params.cu_seqlens_q_padded, params.cu_seqlens_kv_padded):
                # TE reads real lengths from cu_seqlens and offsets from the padded ones; here the
                # segments are the padded ones, given in cu_seqlens (their padding is causal-masked junk)
                if padded is not None and padded is not cu_q and not torch.equal(padded, cu_q):
                    raise ValueError("cu_seqlens_q_padded differs from cu_seqlens_q: this stand-in takes the "
                                     "padded segments as cu_seqlens_q")
            if attention_mask is not None:
                raise ValueError("packed sequences take no attention mask: cu_seqlens and causality define it")
            bounds = cu_q.tolist()
            if bounds[0] != 0 or bounds[-1] != query.shape[0] * cp:
                raise ValueError(f"cu_seqlens {bounds[:4]}...{bounds[-1:]} does not cover the {query.shape[0]} "
                                 f"packed tokens" + (f" of each of {cp} CP ranks" if cp > 1 else ""))
            return bounds

        def _context_parallel_forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                      bounds: list[int], attn_mask_type: Any,
                                      attention_bias: torch.Tensor | None) -> torch.Tensor:
            """This rank's chunks of every segment (`[s / cp, b, heads, d]`, segments at the global `bounds`)
            against the segment's keys and values, all-gathered over CP: `[s / cp, b, heads * d]`."""
            from megatron.core import parallel_state

            group = parallel_state.get_context_parallel_group()
            cp, rank = group.size(), group.rank()
            full_key, full_value = gather_from_cp(key, 0, group, bounds), gather_from_cp(value, 0, group, bounds)
            q_columns = cp_columns(bounds, cp, rank, query.device)
            outputs = []
            for a, b in zip(bounds[:-1], bounds[1:]):
                la, lb = a // cp, b // cp  # the segment's local tokens: its two chunks, one after the other
                keys = torch.arange(a, b, device=query.device)
                masked = keys.unsqueeze(0) > q_columns[la:lb].unsqueeze(1)  # [sq, sk], True = not attended
                outputs.append(super().forward(query[la:lb], full_key[a:b], full_value[a:b], masked,
                                               attn_mask_type=attn_mask_type, attention_bias=attention_bias))
            return torch.cat(outputs, dim=0)

    return CpuPackedDotProductAttention


@functools.cache
def cpu_packed_attention_class() -> type:
    """The `CpuPackedDotProductAttention` class (built once: it subclasses a megatron class, imported lazily)."""
    return _packed_attention_class()
