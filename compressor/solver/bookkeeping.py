"""The swap phase's memory: the stack of moves made since the greedy and the cache of A0's columns.

`SwapState` (in `sweep`) holds the swept matrix A as A0, its state at the end of the greedy, plus the moves
made since; neither ever holds all of A. This module keeps what that costs in memory bounded and its
reads cheap, and does none of the update maths:

  * `MoveStack`: every move's column c = A[:, P] and pivot inverse A_PP^-1, stored so that what all the
    moves add to any columns of A is two matmuls (`add_to_columns`, `add_to_block`);
  * `ColumnCache`: columns of A0 formed from the greedy's factors, kept by row for reuse, least recently
    used dropped beyond `ColumnCache.MAX_ROWS`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import Tensor

from .problem import host_index


def _round_up(n: int, step: int) -> int:
    """n rounded up to a multiple of step."""
    return -(-n // step) * step


class MoveStack:
    """The sweeps made since the greedy, as one low-rank change of the swept matrix.

    A sweep of rows P (sign s: +1 restore, -1 prune) with c = A[:, P] and Pi = A_PP^-1 is the symmetric
    low-rank change

        A' = A + [c, E_P] [[-Pi, s Pi], [s Pi, -Pi - 2 s I]] [c, E_P]^T      (E_P: unit columns at P)

    so the moves add up: their columns c are stacked in one d1 x N matrix and their pivot inverses in
    block-diagonal segments, and what they add to a column of A costs one matmul with the stack.
    Nothing here synchronises with the host.
    """

    # The stack's slots are cut into segments of SEGMENT_ROWS (doubled when one sweep is wider), each holding
    # whole sweeps and their pivot inverses as one dense block-diagonal core: the moves' cores are then one
    # batched matmul, whatever their number. A sweep that does not fit in what is left of a segment starts the
    # next one; the slots it skips stay zero (column, pivot row 0, sign, core), so they add nothing.
    SEGMENT_ROWS = 256

    def __init__(self, d1: int, dtype: torch.dtype, device: torch.device) -> None:
        self._C = torch.empty(d1, 0, dtype=dtype, device=device)  # columns c of every move, stacked
        self._P = torch.zeros(0, dtype=torch.long, device=device)  # their pivot rows, stacked alike
        self._sign = torch.zeros(0, dtype=dtype, device=device)  # their sweeps' signs (+1 restore, -1 prune)
        self._seg = self.SEGMENT_ROWS  # slots of a segment
        self._Pi = torch.zeros(0, self._seg, self._seg, dtype=dtype, device=device)  # (segments, seg, seg) cores
        self._n = 0  # slots of _C, _P and _sign in use (gaps included)

    @property
    def seg(self) -> int:
        """Slots of a segment: SEGMENT_ROWS, doubled for each sweep wider than the segments were."""
        return self._seg

    @property
    def slots(self) -> int:
        """Slots in use, the gaps before segments' first sweeps included."""
        return self._n

    def push(self, rows: Tensor, col: Tensor, pivot_inv: Tensor, sign: float) -> None:
        """Record the sweep of `rows` (P) whose column was col = A[:, P] (d1 x m) before it and pivot inverse
        A_PP^-1 (m x m); sign +1 for a restore, -1 for a prune."""
        m = rows.numel()
        while m > self._seg:  # a wider sweep: segments merged in pairs (their cores stay block-diagonal)
            self._widen()
        seg, n = self._seg, self._n
        if n % seg + m > seg:  # not within this segment: the next one
            n = _round_up(n, seg)
        if n + m > self._C.shape[1]:  # grow geometrically, by whole segments: appends stay amortised O(d1 m)
            capacity = _round_up(max(2 * self._C.shape[1], n + m, 64), seg)
            used = _round_up(self._n, seg)  # the segments in use, their free slots included
            grown = self._C.new_empty(self._C.shape[0], capacity)  # left untouched (not resident) until used
            grown[:, :used] = self._C[:, :used]
            self._C = grown
            self._P = torch.cat([self._P, self._P.new_zeros(capacity - self._P.numel())])
            self._sign = torch.cat([self._sign, self._sign.new_zeros(capacity - self._sign.numel())])
            self._Pi = torch.cat([self._Pi, self._Pi.new_zeros(capacity // seg - self._Pi.shape[0], seg, seg)])
        if n % seg == 0:  # a segment's first sweep: its free slots are multiplied too, so they must be zero
            self._C[:, n:n + seg].zero_()
        self._C[:, n:n + m] = col
        self._P[n:n + m] = rows
        self._sign[n:n + m] = sign
        at = n % seg
        self._Pi[n // seg, at:at + m, at:at + m] = pivot_inv
        self._n = n + m

    def _widen(self) -> None:
        """Segments twice as wide, each made of two (their slots do not move)."""
        k, seg = self._Pi.shape[0], self._seg
        Pi = self._Pi.new_zeros(_round_up(k, 2) // 2, 2 * seg, 2 * seg)
        Pi[: k // 2 + k % 2, :seg, :seg] = self._Pi[0::2]
        Pi[: k // 2, seg:, seg:] = self._Pi[1::2]
        self._Pi, self._seg = Pi, 2 * seg
        capacity = Pi.shape[0] * 2 * seg  # whole segments: the stack's buffers padded
        pad = capacity - self._C.shape[1]
        if pad:
            self._C = torch.cat([self._C, self._C.new_empty(self._C.shape[0], pad)], 1)
            self._P = torch.cat([self._P, self._P.new_zeros(pad)])
            self._sign = torch.cat([self._sign, self._sign.new_zeros(pad)])
        # the last segment in use may now take in slots no segment used before: zero them (as `push` does
        # for a segment's first sweep)
        self._C[:, _round_up(self._n, seg):_round_up(self._n, 2 * seg)].zero_()

    def add_to_columns(self, out: Tensor, rows: Tensor) -> Tensor:
        """out += what the moves add to A[:, rows] (out: d1 x m, in place); returns out."""
        terms = self._terms(rows)
        if terms is not None:
            _, _, Yc, YE = terms
            n = self._n  # the last segment's free slots add nothing: not multiplied (d1 work per slot)
            out.addmm_(self._C[:, :n], Yc[:n])
            out.index_add_(0, self._P[:n], YE[:n])
        return out

    def add_to_block(self, out: Tensor, rows: Tensor) -> Tensor:
        """out += what the moves add to A[rows, rows] (out: m x m, in place), O(N m^2); returns out."""
        terms = self._terms(rows)
        if terms is not None:
            Cr, Er, Yc, YE = terms
            out.addmm_(Cr.T, Yc).addmm_(Er.T, YE)
        return out

    def _terms(self, rows: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
        """The moves' part of A[:, rows] (None: no move yet), each (N, m) over the segments' N slots: c[rows] and
        E_P[rows] of every move, and Yc, YE with A[:, rows] = A0[:, rows] + C Yc + E_P YE (zero in the slots no
        move holds)."""
        if not self._n:
            return None
        seg, m = self._seg, rows.numel()
        N = _round_up(self._n, seg)  # the slots of the segments in use
        k = N // seg
        Cr = self._C[:, :N].index_select(0, rows).T  # (N, m): c[rows] of every move
        Er = (self._P[:N].unsqueeze(1) == rows.unsqueeze(0)).to(Cr.dtype)  # (N, m): E_P[rows]^T
        s = self._sign[:N].unsqueeze(1)
        sEr = s * Er
        # Yc = Pi (s er - cr), YE = Pi (s cr - er) - 2 s er, every segment's core in one batched matmul
        Y = torch.bmm(self._Pi[:k], torch.cat([sEr - Cr, s * Cr - Er], 1).view(k, seg, 2 * m)).view(N, 2 * m)
        return Cr, Er, Y[:, :m], Y[:, m:] - 2 * sEr


class ColumnCache:
    """Columns of A0 (d1 floats each) by row, for rows known on the host: A0 never changes, and a swap round's
    restore candidates are mostly last round's. The columns sit in one d1 x capacity buffer, grown
    geometrically up to MAX_ROWS; beyond that the least recently used are dropped. A gather from it gives
    d1 x m columns as they are (one copy, no transposition)."""

    # Most of A0's columns kept for reuse.
    MAX_ROWS = 1024

    def __init__(self, d1: int, dtype: torch.dtype, device: torch.device) -> None:
        self._buf = torch.empty(d1, 0, dtype=dtype, device=device)
        self._slot: OrderedDict[int, int] = OrderedDict()  # row -> column of _buf, least recently used first

    @property
    def capacity(self) -> int:
        """Columns the buffer has room for now (at most MAX_ROWS)."""
        return self._buf.shape[1]

    def __len__(self) -> int:
        return len(self._slot)

    def missing(self, rows: Sequence[int]) -> list[int]:
        """The rows not held, in their order."""
        return [r for r in rows if r not in self._slot]

    def put(self, rows: Sequence[int], cols: Tensor, keep: set[int]) -> None:
        """Hold cols (d1 x n) as the columns of `rows` (n distinct, none held), dropping least recently used
        rows not in `keep` (the rows the caller is about to `get`) where there is no room."""
        device = self._buf.device
        free = self._free_slots(len(rows), keep)
        self._buf[:, host_index(free, device)] = cols
        self._slot.update(zip(rows, free, strict=True))

    def get(self, rows: Sequence[int]) -> Tensor:
        """The columns of `rows` (all held, repeats allowed) as d1 x m, now the most recently used."""
        for r in dict.fromkeys(rows):
            self._slot.move_to_end(r)
        slots = host_index([self._slot[r] for r in rows], self._buf.device)
        return self._buf.index_select(1, slots)

    def clear(self) -> None:
        """Forget every row (once A0 is formed a gather from it is cheaper). A fresh empty buffer, not a view of
        the old one: a view would keep its MAX_ROWS x d1 storage alive for the rest of the solve."""
        self._buf, self._slot = self._buf.new_empty(self._buf.shape[0], 0), OrderedDict()

    def _free_slots(self, n: int, keep: set[int]) -> list[int]:
        """n slots for new rows: unused ones first (growing the buffer up to MAX_ROWS), then those of the least
        recently used rows not in `keep`, whose entries are dropped."""
        capacity = self._buf.shape[1]
        if len(self._slot) + n > capacity and capacity < self.MAX_ROWS:
            width = min(self.MAX_ROWS, max(2 * capacity, len(self._slot) + n, 64))
            grown = self._buf.new_empty(self._buf.shape[0], width)
            grown[:, :capacity] = self._buf
            self._buf, capacity = grown, grown.shape[1]
        taken = set(self._slot.values())
        free = [slot for slot in range(capacity) if slot not in taken][:n]
        for r in [r for r in self._slot if r not in keep][: n - len(free)]:  # least recently used first
            free.append(self._slot.pop(r))
        assert len(free) == n, "a call asks for at most MAX_ROWS rows, so the cache can hold them"
        return free
