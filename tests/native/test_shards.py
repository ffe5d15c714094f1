"""AutoXLA._native.scatter_shards / read_shards against a pure-torch reference.

The oracle is `split_grid(t.to(dtype), grid)`: the tensor converted by torch, then chunked
dim by dim into the row-major grid of blocks. Every block must equal it bit for bit
(compared as integer views). Inputs hold no NaN: torch's own NaN bit patterns vary with
the CPU and the element's position (see test_convert.py), and the C core's NaN rule per
pair is already pinned there; here the question is where every element lands.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from AutoXLA import _native

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def split_grid(t: torch.Tensor, grid: tuple[int, ...]) -> list[torch.Tensor]:
    blocks = [t]
    for d, p in enumerate(grid):
        blocks = [c for b in blocks for c in b.chunk(p, d)]
    return blocks


def _assert_blocks_equal(got: list[torch.Tensor], src: torch.Tensor, grid, dtype, what=""):
    want = split_grid(src.to(dtype), grid)
    assert len(got) == len(want), what
    for k, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == dtype and g.shape == w.shape and g.is_contiguous(), (what, k)
        gb, wb = g.view(BITS[dtype]), w.contiguous().view(BITS[dtype])
        bad = (gb != wb).nonzero()
        if bad.numel():
            i = tuple(int(x) for x in bad[0])
            pytest.fail(
                f"{what} block {k} of {len(got)}: {bad.shape[0]} elements differ; first at "
                f"{i}: got {int(gb[i]) & 0xFFFFFFFF:#x}, want {int(wb[i]) & 0xFFFFFFFF:#x}"
            )


def _values(shape, dtype, seed) -> torch.Tensor:
    """Finite values over many magnitudes: f16 overflow and subnormals, bf16 ties, -0."""
    g = torch.Generator().manual_seed(seed)
    n = int(np.prod(shape)) if shape else 1
    scale = torch.pow(10.0, torch.empty(n).uniform_(-9, 9, generator=g))
    t = torch.randn(n, generator=g) * scale
    specials = torch.tensor([0.0, -0.0, 65504.0, 65520.0, -65520.0, 2.0**-24, 2.0**-25, 1e-40])
    t[: min(n, len(specials))] = specials[: min(n, len(specials))]
    return t.to(dtype).reshape(shape)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _random_cases(count: int, seed: int):
    """(shape, grid) pairs: ndim 1..4, sizes 1..12, grids from all-ones to full splits."""
    rng = np.random.default_rng(seed)
    cases = []
    for i in range(count):
        ndim = 1 + i % 4
        shape = tuple(int(x) for x in rng.integers(1, 13, size=ndim))
        if i % 5 == 0:
            grid = (1,) * ndim
        elif i % 5 == 1:
            grid = shape
        else:
            grid = tuple(int(rng.choice(_divisors(s))) for s in shape)
        cases.append((shape, grid))
    return cases


# ---- scatter_shards ---------------------------------------------------------------------


@pytest.mark.parametrize("isa", _native.available_isas())
@pytest.mark.parametrize("dst", DTYPES, ids=str)
@pytest.mark.parametrize("src_dtype", DTYPES, ids=str)
def test_scatter_equals_torch(src_dtype, dst, isa):
    for i, (shape, grid) in enumerate(_random_cases(40, seed=DTYPES.index(src_dtype))):
        src = _values(shape, src_dtype, seed=i)
        got = _native.scatter_shards(src, grid, dst, isa=isa, nthreads=1 + i % 3)
        _assert_blocks_equal(got, src, grid, dst, f"{shape} grid {grid}")


@pytest.mark.parametrize("nthreads", [1, 2, 3, 0])
@pytest.mark.parametrize(
    "shape, grid",
    [
        ((1024, 520), (1, 8)),
        ((1024, 520), (8, 1)),
        ((1024, 520), (4, 2)),
        ((1024, 520), (1, 1)),
        ((1024, 520), (1, 520)),
        ((3, 200000), (1, 8)),
        ((600000,), (8,)),
        ((8, 256, 130), (8, 1, 2)),
        ((2, 4, 96, 200), (1, 2, 1, 8)),
    ],
)
def test_scatter_large(shape, grid, nthreads):
    """Large enough that the C core splits the work over threads."""
    src = _values(shape, torch.bfloat16, seed=len(shape))
    for dst in DTYPES:
        got = _native.scatter_shards(src, grid, dst, nthreads=nthreads)
        _assert_blocks_equal(got, src, grid, dst, f"{shape} grid {grid} -> {dst}")


def test_scatter_odd_inputs():
    # Size-1 and empty dims, a list grid, numpy ints, a torch.Size-shaped grid.
    src = _values((1, 5, 1, 6), torch.float32, seed=3)
    _assert_blocks_equal(
        _native.scatter_shards(src, [1, np.int64(5), 1, 3], torch.float16), src, (1, 5, 1, 3),
        torch.float16,
    )
    empty = torch.empty(0, 6)
    blocks = _native.scatter_shards(empty, (4, 2), torch.bfloat16)
    assert len(blocks) == 8 and all(b.shape == (0, 3) for b in blocks)
    src = torch.randn(4, 6, requires_grad=True)
    blocks = _native.scatter_shards(src, (2, 1), torch.float32)
    assert not blocks[0].requires_grad
    _assert_blocks_equal(blocks, src.detach(), (2, 1), torch.float32)


# ---- read_shards ------------------------------------------------------------------------


def _safetensors_offsets(path: Path) -> dict[str, tuple[int, str, tuple[int, ...]]]:
    """name -> (absolute byte offset, dtype string, shape), from the file's own header."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, _ = info["data_offsets"]
        out[name] = (8 + header_len + begin, info["dtype"], tuple(info["shape"]))
    return out


_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tensors = {
        "embed": _values((96, 40), torch.bfloat16, seed=1),
        "bias": _values((7,), torch.float16, seed=2),
        "mlp": _values((64, 48), torch.float32, seed=3),
        "experts": _values((4, 12, 10), torch.bfloat16, seed=4),
        "conv": _values((6, 2, 3, 4), torch.float16, seed=5),
        "big": _values((1024, 1104), torch.bfloat16, seed=6),  # > 1 MiB: several threads
        "vector": _values((300000,), torch.float32, seed=7),
    }
    path = tmp_path_factory.mktemp("shards") / "model.safetensors"
    save_file(tensors, str(path))
    return path, tensors


GRIDS = {
    "embed": [(1, 1), (8, 1), (1, 8), (4, 2), (96, 40)],
    "bias": [(1,), (7,)],
    "mlp": [(1, 8), (8, 1), (2, 4)],
    "experts": [(4, 1, 1), (1, 2, 5), (2, 3, 2)],
    "conv": [(2, 1, 3, 2), (1, 2, 1, 4)],
    "big": [(1, 8), (8, 1), (2, 4)],
    "vector": [(8,), (1,)],
}


@pytest.mark.parametrize("nthreads", [1, 3, 0])
@pytest.mark.parametrize("dst", DTYPES, ids=str)
def test_read_equals_torch_and_scatter(checkpoint, dst, nthreads):
    path, tensors = checkpoint
    offsets = _safetensors_offsets(path)
    for name, src in tensors.items():
        offset, st_dtype, shape = offsets[name]
        assert _ST_DTYPES[st_dtype] == src.dtype and shape == tuple(src.shape)
        for grid in GRIDS[name]:
            what = f"{name} {shape} grid {grid} -> {dst}"
            got = _native.read_shards(path, offset, src.dtype, shape, grid, dst, nthreads=nthreads)
            _assert_blocks_equal(got, src, grid, dst, what)
            scattered = _native.scatter_shards(src, grid, dst, nthreads=nthreads)
            for g, s in zip(got, scattered):
                assert torch.equal(g.view(BITS[dst]), s.view(BITS[dst])), what


@pytest.mark.parametrize("isa", _native.available_isas())
def test_read_every_isa(checkpoint, isa):
    path, tensors = checkpoint
    offsets = _safetensors_offsets(path)
    offset, _, shape = offsets["big"]
    got = _native.read_shards(str(path), offset, torch.bfloat16, list(shape), (2, 4),
                              torch.float32, isa=isa)
    _assert_blocks_equal(got, tensors["big"], (2, 4), torch.float32)


def test_read_empty_tensor(tmp_path):
    path = tmp_path / "empty.safetensors"
    save_file({"e": torch.empty(0, 4, dtype=torch.bfloat16)}, str(path))
    offset, _, shape = _safetensors_offsets(path)["e"]
    blocks = _native.read_shards(path, offset, torch.bfloat16, shape, (2, 2), torch.float32)
    assert len(blocks) == 4 and all(b.shape == (0, 2) for b in blocks)


# ---- bad arguments: always a Python exception, never a crash -------------------------------


@pytest.mark.parametrize(
    "grid, error, match",
    [
        ((3, 1), ValueError, r"grid\[0\] = 3 does not divide dim 0 of size 4"),
        ((1, 5), ValueError, r"grid\[1\] = 5 does not divide dim 1 of size 6"),
        ((1,), ValueError, "1 entries but the tensor of shape"),
        ((1, 1, 1), ValueError, "3 entries"),
        ((0, 1), ValueError, r"grid\[0\] = 0 is out of range"),
        ((2, -3), ValueError, r"grid\[1\] = -3 is out of range"),
        ((2, 1.0), TypeError, r"grid\[1\] must be an int"),
        ((True, 1), TypeError, r"grid\[0\] must be an int"),
        ("21", TypeError, "tuple of ints"),
        (2, TypeError, "tuple of ints"),
    ],
)
def test_rejects_bad_grid(grid, error, match):
    with pytest.raises(error, match=match):
        _native.scatter_shards(torch.zeros(4, 6), grid, torch.float16)


def test_rejects_bad_tensors():
    with pytest.raises(ValueError, match=r"\.contiguous\(\)"):
        _native.scatter_shards(torch.randn(4, 6).t(), (1, 2), torch.bfloat16)
    with pytest.raises(ValueError, match="expected one of"):
        _native.scatter_shards(torch.zeros(4, 6, dtype=torch.float64), (1, 2), torch.float32)
    with pytest.raises(ValueError, match="expected one of"):
        _native.scatter_shards(torch.zeros(4, 6), (1, 2), torch.int8)
    with pytest.raises(TypeError, match="torch.dtype"):
        _native.scatter_shards(torch.zeros(4, 6), (1, 2), "float16")
    with pytest.raises(ValueError, match="meta"):
        _native.scatter_shards(torch.empty(4, 6, device="meta"), (1, 2), torch.float16)
    with pytest.raises(ValueError, match="scalar"):
        _native.scatter_shards(torch.tensor(1.0), (), torch.float16)
    with pytest.raises(ValueError, match="at most 8"):
        _native.scatter_shards(torch.zeros((1,) * 9), (1,) * 9, torch.float16)
    with pytest.raises(TypeError, match="torch.Tensor"):
        _native.scatter_shards([1.0, 2.0], (1,), torch.float16)
    with pytest.raises(ValueError, match="nthreads"):
        _native.scatter_shards(torch.zeros(4), (2,), torch.float16, nthreads=-1)
    with pytest.raises(ValueError, match="isa"):
        _native.scatter_shards(torch.zeros(4), (2,), torch.float16, isa="sse")


@pytest.fixture()
def small_file(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"w": torch.randn(8, 16)}, str(path))
    offset, _, shape = _safetensors_offsets(path)["w"]
    return path, offset, shape


def test_read_rejects_missing_and_truncated_files(small_file, tmp_path):
    path, offset, shape = small_file
    end = offset + 8 * 16 * 4
    missing = tmp_path / "missing.safetensors"
    with pytest.raises(FileNotFoundError, match=rf"missing\.safetensors.*\[{offset}, {end}\)"):
        _native.read_shards(missing, offset, torch.float32, shape, (1, 2), torch.bfloat16)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(path.read_bytes()[: end - 1])
    with pytest.raises(ValueError, match=rf"is {end - 1} bytes.*\[{offset}, {end}\).*truncated"):
        _native.read_shards(truncated, offset, torch.float32, shape, (1, 2), torch.bfloat16)
    with pytest.raises(ValueError, match="truncated"):  # the tensor read one byte too late
        _native.read_shards(path, offset + 1, torch.float32, shape, (1, 2), torch.bfloat16)
    with pytest.raises(ValueError, match="not a regular file"):
        _native.read_shards(tmp_path, 0, torch.float32, (1,), (1,), torch.bfloat16)


def test_read_rejects_bad_arguments(small_file):
    path, offset, shape = small_file
    args = dict(src_dtype=torch.float32, shape=shape, grid=(1, 2), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="negative"):
        _native.read_shards(path, -1, **args)
    with pytest.raises(TypeError, match="offset must be an int"):
        _native.read_shards(path, 1.5, **args)
    with pytest.raises(TypeError, match="path"):
        _native.read_shards(bytes(path), offset, **args)
    with pytest.raises(TypeError, match="path"):
        _native.read_shards(None, offset, **args)
    with pytest.raises(ValueError, match="NUL"):
        _native.read_shards(str(path) + "\0x", offset, **args)
    with pytest.raises(ValueError, match="does not divide"):
        _native.read_shards(path, offset, **{**args, "grid": (3, 1)})
    with pytest.raises(ValueError, match=r"shape\[1\] = -16"):
        _native.read_shards(path, offset, **{**args, "shape": (8, -16)})
    with pytest.raises(ValueError, match="scalar"):
        _native.read_shards(path, offset, **{**args, "shape": (), "grid": ()})
    with pytest.raises(ValueError, match="src_dtype"):
        _native.read_shards(path, offset, **{**args, "src_dtype": torch.float64})
    with pytest.raises(ValueError, match="dtype"):
        _native.read_shards(path, offset, **{**args, "dtype": torch.int32})
    with pytest.raises(ValueError, match="too large"):
        _native.read_shards(path, offset, **{**args, "shape": (2**40, 2**40), "grid": (1, 1)})
    with pytest.raises(ValueError, match="nthreads"):
        _native.read_shards(path, offset, **args, nthreads=-2)


def test_read_error_from_the_c_core(small_file, monkeypatch):
    """If the file shrinks after the size check, the C core's AXL_ERR_IO is a NativeError."""
    path, offset, shape = small_file
    real_stat = os.stat

    def stat_claiming_a_larger_file(p, *a, **k):
        st = real_stat(p, *a, **k)
        if os.fspath(p) == os.fspath(path):
            fields = list(st)
            fields[6] = st.st_size + 4096  # st_size
            return os.stat_result(fields)
        return st

    monkeypatch.setattr(os, "stat", stat_claiming_a_larger_file)
    with pytest.raises(_native.NativeError, match=r"ends too early \(status 10\)") as info:
        _native.read_shards(path, offset + 1024, torch.float32, shape, (1, 2), torch.bfloat16)
    assert info.value.code == 10


# ---- the ABI --------------------------------------------------------------------------------


def test_abi_version_matches_the_header():
    header = (Path(__file__).resolve().parents[2] / "csrc/include/autoxla.h").read_text()
    assert f"#define AXL_ABI_VERSION {_native.ABI_VERSION}\n" in header
    assert _native._get_lib().axl_abi_version() == _native.ABI_VERSION


def test_stale_library_is_refused_before_missing_symbols(monkeypatch):
    """A library of another ABI fails with the rebuild hint, not an AttributeError for a
    function it lacks."""
    monkeypatch.setattr(_native.library, "ABI_VERSION", _native.ABI_VERSION - 1)
    monkeypatch.setattr(_native.library, "_lib", None)
    with pytest.raises(_native.NativeLibraryError, match=r"ABI version \d+.*pip install -e \."):
        _native.scatter_shards(torch.zeros(4), (2,), torch.float16)
