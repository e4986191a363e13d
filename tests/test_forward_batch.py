"""`ForwardBatch.build`'s CPU decode paths (the kernel library's `decode_batch_rows` op, and
numpy) and `ReqToTokenPool.write`'s numpy path give exactly what the general batched-torch code
gives (values and dtypes)."""

from __future__ import annotations

import random

import pytest
import torch

from radixrt.attention import cpu_kernels
from radixrt.core.forward_batch import ForwardBatch, ForwardMode
from radixrt.mem.memory_pool import ReqToTokenPool

FIELDS = ("input_ids", "positions", "req_pool_indices", "seq_lens", "prefix_lens",
          "extend_lens", "out_cache_loc", "qo_indptr", "kv_indptr", "kv_indices",
          "kv_last_page_len", "logits_indices")


@pytest.fixture(params=["op", "numpy"])
def decode_build(request: pytest.FixtureRequest) -> object:
    """A CPU decode build: through the kernel library's op (`build` takes it once loaded) or
    the numpy fallback."""
    if request.param == "numpy":
        return ForwardBatch._build_decode_numpy
    if not cpu_kernels.load_cpu_kernels():
        pytest.skip(f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
    return lambda ids, rows, prefix, table: ForwardBatch.build(
        ForwardMode.DECODE, ids, rows, prefix, [1] * len(rows), table)


@pytest.mark.parametrize("bs", [0, 1, 3, 17])
def test_cpu_decode_build_equals_the_general_build(bs: int, decode_build: object) -> None:
    rng = random.Random(bs)
    table = torch.randint(0, 10_000, (24, 300), dtype=torch.int32,
                          generator=torch.Generator().manual_seed(bs))
    rows = rng.sample(range(24), bs)
    prefix = [rng.randrange(0, 299) for _ in range(bs)]
    ids = [rng.randrange(50_000) for _ in range(bs)]
    fast = decode_build(ids, rows, prefix, table)  # type: ignore[operator]
    ref = ForwardBatch._build_general(ForwardMode.DECODE, ids, rows, prefix, [1] * bs, table,
                                      "cpu")
    for name in FIELDS:
        a, b = getattr(fast, name), getattr(ref, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert fast.seq_lens_cpu == ref.seq_lens_cpu and fast.prefix_lens_cpu == prefix
    assert fast.extend_lens_cpu == [1] * bs and fast.batch_size == bs and fast.is_decode
    # the batch does not alias the table: later writes to the table leave it unchanged
    before = fast.kv_indices.clone()
    table.fill_(-1)
    assert torch.equal(fast.kv_indices, before)


def test_decode_rows_op_refuses_bad_rows_naming_them() -> None:
    if not cpu_kernels.load_cpu_kernels():
        pytest.skip(f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
    op = torch.ops.radixrt.decode_batch_rows
    table = torch.zeros(4, 10, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="row 4 out of range"):
        op([1], [4], [0], table)
    with pytest.raises(RuntimeError, match="prefix 10 out of range"):
        op([1], [0], [10], table)
    with pytest.raises(RuntimeError, match="one entry per request"):
        op([1, 2], [0], [0], table)
    with pytest.raises(RuntimeError, match="int32"):
        op([1], [0], [0], table.long())
    # a tensor of ids goes through build as its list
    fb = ForwardBatch.build(ForwardMode.DECODE, torch.tensor([7, 8]), [1, 2], [3, 0], [1, 1],
                            table)
    assert fb.input_ids.tolist() == [7, 8] and fb.seq_lens_cpu == [4, 1]


def _reference_write(table: torch.Tensor, rows: list[int], starts: list[int], lens: list[int],
                     slots: torch.Tensor) -> None:
    off = 0
    for r, s, n in zip(rows, starts, lens, strict=True):
        for j in range(n):
            table[r, s + j] = int(slots[off + j])
        off += n


@pytest.mark.parametrize("lens", [[1, 1, 1, 1], [3, 0, 5, 1], [7], [1] * 150])
def test_write_fills_the_table_as_the_reference(lens: list[int]) -> None:
    """One slot per row (a decode step: a loop up to 128 rows, numpy's scatter above), several
    per row, empty rows."""
    pool = ReqToTokenPool(160, 40)
    expect = pool.req_to_token.clone()
    rows = ([5, 0, 3, 2] + list(range(6, 160)))[: len(lens)]
    starts = ([4, 0, 30, 12] + [r % 37 for r in range(6, 160)])[: len(lens)]
    slots = torch.arange(100, 100 + sum(lens), dtype=torch.int64)
    pool.write(rows, starts, lens, slots)
    _reference_write(expect, rows, starts, lens, slots)
    assert torch.equal(pool.req_to_token, expect)
    with pytest.raises(ValueError, match="slots for"):
        pool.write(rows, starts, lens, slots[:-1])
