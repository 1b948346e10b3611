"""Split rows into groups with even token sums: micro-batches of one rank, and DP chunks of a batch.

One place for the partition logic both sides use (the training backend's token-budget micro-batches,
`hybridrl.training.micro_batching`; the controller's balanced DP dispatch,
`hybridrl.controller.dispatch.balanced_dp_order`):

* `balanced_partition(lengths, k)`: k non-empty groups of any size (greedy LPT: longest row first
  into the lightest group). Micro-batches need no equal row count.
* `balanced_partition(lengths, k, equal_size=True)`: k groups of exactly len/k rows each, by
  Karmarkar–Karp's largest differencing method (as verl's seq-len balancing does): the sorted rows
  are cut into sets of k consecutive rows, each set a partial partition with one row per group; the
  two partial partitions with the largest spread are merged (the heaviest group of one with the
  lightest of the other) until one is left, so every group holds one row of every set; then rows
  are swapped between the heaviest group and another while a swap lowers the heavier of the two
  (the differencing alone leaves a long-tailed set's longest row with too much company). DP chunks
  need equal row counts (the dispatch cuts equal chunks, and every rank runs the same number of
  micro-batches and mini-batches).

Indices inside a group are sorted (rows keep their relative order); equal-size groups come out
heaviest first.
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence

Partition = list[list[int]]


def balanced_partition(lengths: Sequence[int], num_parts: int, *, equal_size: bool = False) -> Partition:
    """`num_parts` groups of row indices with even token sums (see the module docstring)."""
    values = [int(n) for n in lengths]
    if not 1 <= num_parts <= len(values):
        raise ValueError(f"cannot make {num_parts} non-empty groups from {len(values)} rows")
    if not equal_size:
        return [sorted(p) for p in _greedy(values, num_parts)]
    if len(values) % num_parts:
        raise ValueError(f"{len(values)} rows do not split into {num_parts} groups of equal size")
    groups = [sorted(p) for p in _refine_by_swaps(values, _largest_differencing(values, num_parts))]
    # heaviest first; ties by first index, so the order does not depend on the merge history
    return sorted(groups, key=lambda g: (-sum(values[r] for r in g), g[0]))


def _greedy(values: list[int], num_parts: int) -> Partition:
    # Rows longest first into the currently lightest group (ties: fewer rows, then lower index), so
    # every group gets at least one row.
    loads = [0] * num_parts
    parts: Partition = [[] for _ in range(num_parts)]
    for row in sorted(range(len(values)), key=lambda r: (-values[r], r)):
        target = min(range(num_parts), key=lambda p: (loads[p], len(parts[p]), p))
        parts[target].append(row)
        loads[target] += values[row]
    return parts


def _largest_differencing(values: list[int], num_parts: int) -> Partition:
    order = sorted(range(len(values)), key=lambda r: (values[r], r))
    # a partial partition: num_parts (load, rows) pairs, kept heaviest first
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for counter, start in enumerate(range(0, len(order), num_parts)):
        state = sorted(((values[r], [r]) for r in order[start:start + num_parts]), key=lambda s: -s[0])
        heapq.heappush(heap, (-(state[0][0] - state[-1][0]), counter, state))
    counter = len(heap)
    while len(heap) > 1:
        _, _, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        # the heaviest group of one with the lightest of the other: the spreads cancel
        merged = sorted(((a[0] + b[0], a[1] + b[1]) for a, b in zip(first, reversed(second))),
                        key=lambda s: -s[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), counter, merged))
        counter += 1
    return [rows for _, rows in heap[0][2]]


def _refine_by_swaps(values: list[int], parts: Partition, max_swaps: int | None = None) -> Partition:
    """Swap one row of the heaviest group with one of another group while that lowers the heaviest
    group's load and keeps the other below it (row counts never change). Each swap lowers the sum
    of squared loads, so this ends; `max_swaps` bounds it anyway."""
    import numpy as np

    lengths = np.asarray(values, dtype=np.int64)
    parts = [list(p) for p in parts]
    loads = [int(lengths[p].sum()) for p in parts]
    for _ in range(max_swaps if max_swaps is not None else 4 * len(values)):
        heavy = max(range(len(parts)), key=lambda g: (loads[g], -g))
        best: tuple[int, int, int, int] | None = None  # (new max of the pair, other group, heavy pos, other pos)
        heavy_rows = lengths[parts[heavy]]
        for other in range(len(parts)):
            gap = loads[heavy] - loads[other]
            if other == heavy or gap <= 1:
                continue
            other_rows = lengths[parts[other]]
            order = np.argsort(other_rows, kind="stable")
            sorted_rows = other_rows[order]
            # a swap moves d = a - b from heavy to other; the best d is as close to gap / 2 as can be
            target = heavy_rows - gap / 2
            at = np.clip(np.searchsorted(sorted_rows, target), 0, len(sorted_rows) - 1)
            for cand in (at, np.clip(at - 1, 0, len(sorted_rows) - 1)):
                d = heavy_rows - sorted_rows[cand]
                pair_max = np.maximum(loads[heavy] - d, loads[other] + d)
                pair_max = np.where((d > 0) & (d < gap), pair_max, loads[heavy])
                i = int(np.argmin(pair_max))
                if pair_max[i] < loads[heavy] and (best is None or pair_max[i] < best[0]):
                    best = (int(pair_max[i]), other, i, int(order[cand[i]]))
        if best is None:
            break
        _, other, i, j = best
        a, b = parts[heavy][i], parts[other][j]
        parts[heavy][i], parts[other][j] = b, a
        moved = int(lengths[a] - lengths[b])
        loads[heavy] -= moved
        loads[other] += moved
    return parts
