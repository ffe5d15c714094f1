"""AutoXLA._native.read_blocks / block_ranges: some blocks of a tensor in a file, reading
only the bytes that hold them (one host of a multi-host slice needs a few blocks).

The oracle for the values is torch: the tensor converted by torch and chunked dim by dim
into the row-major grid (as in test_shards.py), compared bit for bit (no NaNs: their bit
patterns are pinned in test_convert.py), and read_shards' blocks. The oracle for what is
read is an element-by-element construction of the wanted bytes in numpy: block_ranges
must equal it, read_blocks' bytes_read must equal block_ranges' total, and, measured
independently by the kernel, the process's /proc/self/io "rchar" must grow by that much.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from AutoXLA import _native

BITS = {
    torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
    torch.int8: torch.int8, torch.uint8: torch.uint8,
}
OFFSET = 13  # odd: the tensor's bytes have no alignment in the file


def split_grid(t: torch.Tensor, grid) -> list[torch.Tensor]:
    blocks = [t]
    for d, p in enumerate(grid):
        blocks = [c for b in blocks for c in b.chunk(p, d)]
    return blocks


def _values(shape, dtype, seed) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dtype in (torch.int8, torch.uint8):
        return torch.randint(-128 if dtype == torch.int8 else 0, 128 if dtype == torch.int8
                             else 256, (n,), generator=g, dtype=dtype).reshape(shape)
    scale = torch.pow(10.0, torch.empty(n).uniform_(-6, 6, generator=g))
    return (torch.randn(n, generator=g) * scale).to(dtype).reshape(shape)


def _write(path: Path, t: torch.Tensor, offset: int = OFFSET, tail: int = 7) -> Path:
    """t's bytes at `offset` of a file, junk before and after."""
    data = t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
    path.write_bytes(b"\x5a" * offset + data + b"\xa5" * tail)
    return path


def _assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous(), what
    assert torch.equal(got.view(BITS[got.dtype]), want.contiguous().view(BITS[want.dtype])), what


def _naive_ranges(shape, grid, wanted, itemsize, gap) -> list[tuple[int, int]]:
    """The wanted bytes found element by element: each element's block from its index
    (autoxla.h's definition), consecutive wanted elements joined, then ranges at most
    `gap` bytes apart merged."""
    idx = np.indices(shape).reshape(len(shape), -1)
    block = np.zeros(idx.shape[1], dtype=np.int64)
    for d, (size, parts) in enumerate(zip(shape, grid)):
        block = block * parts + idx[d] // (size // parts)
    mask = np.isin(block, list(wanted))
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    ranges = []
    for b, e in zip(edges[::2] * itemsize, edges[1::2] * itemsize):
        if ranges and b - ranges[-1][1] <= gap:
            ranges[-1] = (ranges[-1][0], int(e))
        else:
            ranges.append((int(b), int(e)))
    return ranges


def _subsets(nblocks: int, rng) -> list[list[int]]:
    """Every subset of up to 4 blocks; else none, all, singles and random ones."""
    if nblocks <= 4:
        return [[k for k in range(nblocks) if s >> k & 1] for s in range(1 << nblocks)]
    singles = [[k] for k in sorted({0, nblocks // 2, nblocks - 1})]
    rand = [sorted(rng.choice(nblocks, size=int(rng.integers(1, nblocks)), replace=False))
            for _ in range(4)]
    return [[], list(range(nblocks))] + singles + [[int(k) for k in r] for r in rand]


CASES = [  # (shape, grid, src dtype, dtype): 1-4 dims, splitting first, last, middle dims
    ((12,), (4,), torch.float32, torch.float16),
    ((6, 8), (2, 4), torch.bfloat16, torch.float32),
    ((6, 8), (3, 1), torch.float16, torch.bfloat16),
    ((4, 6, 10), (1, 3, 1), torch.float32, torch.bfloat16),
    ((4, 6, 10), (2, 3, 5), torch.bfloat16, torch.float16),
    ((3, 4, 1, 10), (1, 2, 1, 5), torch.float16, torch.float32),
    ((8, 16), (4, 2), torch.int8, torch.int8),
    ((5, 6, 4), (5, 1, 2), torch.uint8, torch.uint8),
]


@pytest.mark.parametrize("shape, grid, src_dtype, dtype", CASES, ids=str)
def test_blocks_and_ranges_match_torch(tmp_path, shape, grid, src_dtype, dtype):
    t = _values(shape, src_dtype, seed=len(shape))
    path = _write(tmp_path / "t.bin", t)
    want = split_grid(t.to(dtype), grid)
    shards = _native.read_shards(path, OFFSET, src_dtype, shape, grid, dtype)
    nblocks, itemsize = math.prod(grid), t.element_size()
    block_bytes = t.numel() // nblocks * itemsize
    isas = _native.available_isas()
    rng = np.random.default_rng(sum(shape))
    for i, wanted in enumerate(_subsets(nblocks, rng)):
        for gap in (0, itemsize, 3 * block_bytes // 2 + 1):
            what = f"{shape} grid {grid} blocks {wanted} gap {gap}"
            ranges = _native.block_ranges(src_dtype, shape, grid, wanted, gap_bytes=gap)
            assert ranges == _naive_ranges(shape, grid, wanted, itemsize, gap), what
            total = sum(e - b for b, e in ranges)
            if gap == 0:
                assert total == len(wanted) * block_bytes, what
            assert all(b2 - e1 > gap for (_, e1), (b2, _) in zip(ranges, ranges[1:])), what
            got, bytes_read = _native.read_blocks(
                path, OFFSET, src_dtype, shape, grid, dtype, wanted, gap_bytes=gap,
                nthreads=1 + i % 3, isa=isas[i % len(isas)],
            )
            assert bytes_read == total, what
            assert list(got) == wanted, what
            for k, block in got.items():
                _assert_same(block, want[k], f"{what} block {k}")
                _assert_same(block, shards[k], f"{what} block {k} vs read_shards")


def test_worked_example():
    # (4, 8) float32 in 2 x 2 blocks of 2 x 4; rows are 32 bytes. Block 0 is bytes 0-15 of
    # rows 0 and 1, block 3 bytes 16-31 of rows 2 and 3.
    assert _native.block_ranges(torch.float32, (4, 8), (2, 2), [3, 0]) == [
        (0, 16), (32, 48), (80, 96), (112, 128)
    ]
    assert _native.block_ranges(torch.float32, (4, 8), (2, 2), [0, 3], gap_bytes=16) == [
        (0, 48), (80, 128)
    ]
    assert _native.block_ranges(torch.float32, (4, 8), (2, 2), [0, 1], gap_bytes=0) == [(0, 64)]
    assert _native.block_ranges(torch.float32, (4, 8), (2, 2), []) == []
    assert _native.block_ranges(torch.int8, (0, 8), (2, 2), [1]) == []


def test_wanted_forms_and_duplicates(tmp_path):
    shape, grid = (6, 8), (3, 2)
    t = _values(shape, torch.float32, seed=5)
    path = _write(tmp_path / "t.bin", t)
    want = split_grid(t.to(torch.bfloat16), grid)
    forms = [
        [4, 1, 4, 1], (1, 4), {4, 1}, (k for k in (1, 4)), np.array([4, 1, 1]),
        torch.tensor([1, 4]), [np.int64(1), np.int32(4)], range(1, 5, 3),
    ]
    for wanted in forms:
        got, n = _native.read_blocks(path, OFFSET, torch.float32, shape, grid, torch.bfloat16,
                                     wanted)
        assert list(got) == [1, 4] and n == 2 * 8 * 4, repr(wanted)
        for k in (1, 4):
            _assert_same(got[k], want[k], repr(wanted))
    assert _native.read_blocks(path, OFFSET, torch.float32, shape, grid, torch.bfloat16,
                               []) == ({}, 0)
    # Empty tensors: empty blocks, nothing read.
    empty = _write(tmp_path / "empty.bin", torch.empty(0, 4))
    got, n = _native.read_blocks(empty, OFFSET, torch.float32, (0, 4), (3, 2), torch.float16,
                                 [5, 0])
    assert n == 0 and list(got) == [0, 5] and all(b.shape == (0, 2) for b in got.values())


def test_bad_arguments(tmp_path):
    shape, grid = (4, 8), (2, 2)
    path = _write(tmp_path / "t.bin", _values(shape, torch.float32, seed=1))

    def read(wanted=(0,), **kw):
        args = dict(path=path, offset=OFFSET, src_dtype=torch.float32, shape=shape, grid=grid,
                    dtype=torch.bfloat16, wanted=wanted)
        args.update(kw)
        return _native.read_blocks(**args)

    for wanted, exc, words in [
        ([4], ValueError, ["wanted[0] = 4", "4 blocks"]),
        ([0, -1], ValueError, ["wanted[1] = -1"]),
        ([1.0], TypeError, ["wanted[0]", "float"]),
        ([True], TypeError, ["wanted[0]", "bool"]),
        (["1"], TypeError, ["wanted[0]", "str"]),
        ("01", TypeError, ["iterable of block indices"]),
        (3, TypeError, ["iterable of block indices", "int"]),
        (None, TypeError, ["iterable"]),
        (torch.tensor([0.5]), TypeError, ["wanted[0]"]),
        (itertools.cycle([0]), ValueError, ["more than", "once"]),
    ]:
        for fn in (lambda w: read(w), lambda w: _native.block_ranges(torch.float32, shape, grid,
                                                                      w)):
            with pytest.raises(exc) as e:
                fn(wanted)
            for w in words:
                assert w in str(e.value), (wanted, str(e.value))
    for gap, exc in [(-1, ValueError), (1.5, TypeError), (True, TypeError), (2**63, ValueError)]:
        with pytest.raises(exc, match="gap_bytes"):
            read(gap_bytes=gap)
        with pytest.raises(exc, match="gap_bytes"):
            _native.block_ranges(torch.float32, shape, grid, [0], gap_bytes=gap)
    with pytest.raises(ValueError, match="int8/uint8"):
        read(src_dtype=torch.int8, dtype=torch.float32)
    with pytest.raises(ValueError, match="does not divide"):
        read(grid=(3, 1))
    with pytest.raises(ValueError, match="negative"):
        read(offset=-1)
    with pytest.raises(FileNotFoundError, match="no such file"):
        read(path=tmp_path / "missing.bin")
    with pytest.raises(ValueError, match="not a regular file"):
        read(path=tmp_path)
    with pytest.raises(ValueError, match="truncated"):
        read(offset=OFFSET + 8)  # 7 junk bytes follow the tensor: one byte short
    with pytest.raises(ValueError, match="isa"):
        read(isa="avx9000")


def _rchar() -> int:
    with open("/proc/self/io", "rb") as f:
        for line in f.read().splitlines():
            if line.startswith(b"rchar:"):
                return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


# rchar is the process's total of bytes returned by read-family syscalls (read, pread,
# readv...), page cache hits included, from every thread. Besides the call, the window holds
# the read() of /proc/self/io that took the first sample (a few hundred bytes, counted after
# its value was taken) and whatever an idle background thread of the test process (torch,
# the XLA runtime started by conftest) might read; 64 KiB is far above the former and far
# below the bytes the test tells apart (MiBs).
RCHAR_SLACK = 64 << 10


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux /proc/self/io")
def test_rchar_counts_only_the_wanted_bytes(tmp_path):
    # 8 MiB of bf16 in 4 x 2 blocks of 1 MiB; blocks 1 and 6 are 512 rows x 2 KiB each,
    # 2 MiB in all, every other 2 KiB of the rows in two quarters of the file.
    shape, grid = (2048, 2048), (4, 2)
    t = _values(shape, torch.bfloat16, seed=7)
    path = _write(tmp_path / "big.bin", t, offset=4096)
    try:
        _rchar()
    except OSError as e:
        pytest.skip(f"/proc/self/io is not readable here: {e}")
    want = split_grid(t.to(torch.float32), grid)
    block_bytes = 1 << 20
    _native.block_ranges(torch.bfloat16, shape, grid, [0])  # library loaded before measuring
    for gap, wanted, nthreads in [(0, [1, 6], 2), (4096, [1, 6], 1), (0, [0, 1], 0)]:
        ranges = _native.block_ranges(torch.bfloat16, shape, grid, wanted, gap_bytes=gap)
        total = sum(e - b for b, e in ranges)
        before = _rchar()
        got, bytes_read = _native.read_blocks(path, 4096, torch.bfloat16, shape, grid,
                                              torch.float32, wanted, gap_bytes=gap,
                                              nthreads=nthreads)
        delta = _rchar() - before
        what = f"blocks {wanted} gap {gap}: rchar +{delta}, bytes_read {bytes_read}"
        assert bytes_read == total, what
        if gap == 0:
            assert total == len(wanted) * block_bytes, what
        else:  # the 2 KiB gaps inside each block's rows are bridged, the rest is not
            assert total == len(wanted) * (block_bytes + 511 * 2048), what
        assert total <= delta <= total + RCHAR_SLACK, what
        # ... a bound that reading the whole 8 MiB tensor would break.
        assert total + RCHAR_SLACK < t.numel() * t.element_size(), what
        for k in wanted:
            _assert_same(got[k], want[k], f"{what} block {k}")
