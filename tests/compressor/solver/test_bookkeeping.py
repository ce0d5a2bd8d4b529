"""The swap phase's stack of moves and cache of columns (compressor/solver/bookkeeping.py), on their own."""

import pytest
import torch

from compressor.solver.bookkeeping import ColumnCache, MoveStack
from compressor.solver.sweep import sweep_dense


@pytest.fixture
def nan_new_empty(monkeypatch):
    """Memory never written must not be read: NaN in every buffer made by `new_empty`."""
    new_empty = torch.Tensor.new_empty
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **k: new_empty(self, *a, **k).fill_(torch.nan))


def swept_start(d1: int, seed: int = 0) -> torch.Tensor:
    """-H^-1: the swept matrix with every row in the support, for an SPD H."""
    X = torch.randn(3 * d1, d1, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return -torch.linalg.inv(X.T @ X)


def test_an_empty_stack_adds_nothing():
    moves = MoveStack(6, torch.float64, torch.device("cpu"))
    out = torch.ones(6, 2, dtype=torch.float64)
    rows = torch.tensor([1, 4])
    assert moves.add_to_columns(out, rows) is out and bool((out == 1).all())
    assert moves.slots == 0 and moves.seg == MoveStack.SEGMENT_ROWS


def test_stacked_sweeps_add_up_to_the_swept_matrix(monkeypatch, nan_new_empty):
    """Sweeps pushed with their column before and pivot inverse give, added to the start, the columns and blocks
    of the explicitly swept matrix: across a segment's unused tail (a gap), and after sweeps wider than the
    segments widen them."""
    monkeypatch.setattr(MoveStack, "SEGMENT_ROWS", 2)
    d1 = 16
    A0 = swept_start(d1)
    A, Z = A0.clone(), torch.zeros(d1, 1, dtype=torch.float64)
    moves = MoveStack(d1, A.dtype, A.device)
    # (rows, restore): prunes of kept rows and restores of pruned ones, so every pivot is definite after its sign
    for rows, restore in (([3], False), ([5, 9], False), ([0], False), ([11, 12, 13], False), ([9, 3], True),
                          ([1, 2, 4, 6, 7, 8, 10], False), ([0, 11], True)):
        P = torch.tensor(rows)
        sign = 1.0 if restore else -1.0
        moves.push(P, A[:, P].clone(), torch.linalg.inv(A[P][:, P]), sign)
        sweep_dense(A, Z, P, restore)
        every = torch.arange(d1)
        assert torch.allclose(moves.add_to_columns(A0.clone(), every), A, rtol=1e-10, atol=1e-12), rows
        some = torch.tensor([11, 2, 3, 8])
        assert torch.allclose(moves.add_to_block(A0[some][:, some], some), A[some][:, some], rtol=1e-10, atol=1e-12)
    assert moves.seg == 8  # widened twice: by the 3-row sweep, then by the 7-row one
    # segments of 2: [3], gap | [5, 9] | [0]; of 4: [0] + [11, 12, 13] | [9, 3]; of 8: ..., gap | [1, ..., 10], gap
    # | [0, 11]
    assert moves.slots == 3 * 8 + 2


def test_a_stack_grows_by_whole_segments():
    moves = MoveStack(4, torch.float64, torch.device("cpu"))
    col, pivot_inv = torch.zeros(4, 1, dtype=torch.float64), -torch.ones(1, 1, dtype=torch.float64)
    for r in range(3):
        moves.push(torch.tensor([r]), col, pivot_inv, -1.0)
    assert moves.slots == 3
    assert moves._C.shape[1] % moves.seg == 0 and moves._Pi.shape[0] == moves._C.shape[1] // moves.seg


def columns_of(rows: list[int], d1: int = 5) -> torch.Tensor:
    """A recognisable column per row: every entry is the row's number."""
    return torch.tensor(rows, dtype=torch.float64).expand(d1, len(rows)).clone()


def test_cache_gives_back_what_it_was_given():
    cache = ColumnCache(5, torch.float64, torch.device("cpu"))
    assert cache.missing([3, 1]) == [3, 1] and len(cache) == 0
    cache.put([3, 1], columns_of([3, 1]), keep={3, 1})
    cache.put([7], columns_of([7]), keep={7})
    assert cache.missing([1, 2, 7, 8]) == [2, 8]
    assert torch.equal(cache.get([7, 1, 7, 3]), columns_of([7, 1, 7, 3]))  # any order, repeats
    assert cache.capacity == 64  # the first growth: 64 columns (MAX_ROWS is larger)


def test_cache_drops_the_least_recently_used_rows_not_kept(monkeypatch):
    monkeypatch.setattr(ColumnCache, "MAX_ROWS", 4)
    cache = ColumnCache(5, torch.float64, torch.device("cpu"))
    cache.put([0, 1, 2, 3], columns_of([0, 1, 2, 3]), keep={0, 1, 2, 3})
    assert cache.capacity == 4  # never beyond MAX_ROWS
    cache.get([0, 2])  # 1 and 3 are now the least recently used, 1 first
    cache.put([4], columns_of([4]), keep={4, 1})  # 1 is about to be read: 3 goes
    assert cache.missing([0, 1, 2, 3, 4]) == [3]
    assert torch.equal(cache.get([4, 1, 0, 2]), columns_of([4, 1, 0, 2]))
    cache.put([5, 6], columns_of([5, 6]), keep={5, 6})  # least recently used first: 4 then 1
    assert cache.missing([0, 1, 2, 4, 5, 6]) == [1, 4]
    assert torch.equal(cache.get([6, 0, 5, 2]), columns_of([6, 0, 5, 2]))
    assert len(cache) == 4 and cache.capacity == 4


def test_a_cleared_cache_holds_nothing():
    cache = ColumnCache(5, torch.float64, torch.device("cpu"))
    cache.put([2, 4], columns_of([2, 4]), keep={2, 4})
    cache.clear()
    assert len(cache) == 0 and cache.capacity == 0 and cache.missing([2, 4]) == [2, 4]
    assert cache._buf.untyped_storage().nbytes() == 0  # its storage is released, not kept alive by a view
