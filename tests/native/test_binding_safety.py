"""No argument of AutoXLA._native can crash or hang the interpreter (issue 12).

Each dangerous case would kill the process running it if its check regressed (SIGSEGV,
SIGBUS) or never return, so the cases run in child interpreters, a few groups per child
(each child imports torch: a couple of seconds). A child prints one JSON line per case:
the exception's type and message, or "ok"; the test asserts a clean exit (no signal, no
timeout) and, per case, the expected exception type and the words that name the argument
and the fix.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from AutoXLA import _native

TIMEOUT = 120  # seconds per child; each needs a few

# Runs `fn`, prints {"case", "type", "message"}; the parent checks them.
PRELUDE = '''
import json, math, mmap, os, sys, warnings
import numpy as np
import torch
from AutoXLA import _native
warnings.simplefilter("ignore")

def case(name, fn):
    try:
        fn()
    except BaseException as e:
        print(json.dumps({"case": name, "type": type(e).__name__, "message": str(e)}), flush=True)
    else:
        print(json.dumps({"case": name, "type": "ok", "message": ""}), flush=True)

def shrunk(n, keep_bytes, start=0, dtype=torch.float32):
    """A view of n elements from element `start` whose storage is then cut to keep_bytes."""
    base = torch.zeros(start + n, dtype=dtype)
    view = base[start:]
    base.untyped_storage().resize_(keep_bytes)
    return view
'''


def run_child(body: str, tmp_path=None) -> dict[str, dict]:
    """Runs PRELUDE + body in a fresh interpreter; returns its cases by name."""
    env = dict(os.environ)
    if tmp_path is not None:
        env["AXL_TEST_DIR"] = str(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(body)],
        capture_output=True, text=True, timeout=TIMEOUT, env=env,
    )
    assert proc.returncode == 0, (
        f"child exited with {proc.returncode} (negative = killed by that signal)\n"
        f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    )
    cases = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            cases[record["case"]] = record
    return cases


def check(cases: dict, name: str, exc: str, *words: str) -> None:
    assert name in cases, f"case {name} did not run; got {sorted(cases)}"
    got = cases[name]
    assert got["type"] == exc, f"{name}: expected {exc}, got {got['type']}: {got['message']}"
    for w in words:
        assert w in got["message"], f"{name}: {w!r} not in message: {got['message']}"


# ---- storage smaller than the shape ---------------------------------------------------------

STORAGE_CASES = '''
q8 = _native.quantize(torch.randn(4, 64), bits=8, symmetric=False, block_size=32)
bad = lambda: shrunk(1000, 16, start=10)          # offset already past the end
case("convert_src", lambda: _native.convert(bad(), torch.bfloat16))
case("convert_src_null", lambda: _native.convert(shrunk(1000, 0), torch.bfloat16))
case("convert_src_near_end", lambda: _native.convert(shrunk(10, 3990, start=990), torch.float16))
# 40 MB: freeing it unmaps the pages, so reading them would be SIGSEGV (it was, before).
case("convert_src_unmapped", lambda: _native.convert(shrunk(10**7, 16, start=10), torch.bfloat16))
case("convert_out_unmapped", lambda: _native.convert(
    torch.zeros(10**7), torch.float32, out=shrunk(10**7, 64)))
case("convert_out", lambda: _native.convert(
    torch.zeros(1000), torch.float32, out=shrunk(1000, 400)))
case("convert_out_null", lambda: _native.convert(
    torch.zeros(1000), torch.bfloat16, out=shrunk(1000, 0, dtype=torch.bfloat16)))
case("scatter_src", lambda: _native.scatter_shards(shrunk(64, 8).view(8, 8), (2, 2), torch.float32))
case("scatter_src_int8", lambda: _native.scatter_shards(
    shrunk(4096, 100, dtype=torch.int8).view(64, 64), (1, 8), torch.int8))
case("quantize_w", lambda: _native.quantize(
    shrunk(64 * 64, 1000).view(64, 64), bits=8, symmetric=True, block_size=-1))
case("quantize_out_q", lambda: _native.quantize(
    torch.randn(4, 64), bits=8, symmetric=False, block_size=32,
    out=_native.Quantized(shrunk(256, 10, dtype=torch.int8).view(4, 64), torch.empty(4, 2),
                          torch.empty(4, 2, dtype=torch.int8), None, None)))
case("quantize_out_zero_point", lambda: _native.quantize(
    torch.randn(4, 64), bits=8, symmetric=False, block_size=32,
    out=_native.Quantized(torch.empty(4, 64, dtype=torch.int8), torch.empty(4, 2),
                          shrunk(8, 0, dtype=torch.int8).view(4, 2), None, None)))
case("quantize_out_sqnr", lambda: _native.quantize(
    torch.randn(4, 64), bits=4, symmetric=True, block_size=-1, stats=True,
    out=_native.Quantized(torch.empty(4, 32, dtype=torch.uint8), torch.empty(4, 1), None,
                          torch.empty(4), shrunk(4, 12))))
case("dequantize_q", lambda: _native.dequantize(
    shrunk(256, 3, dtype=torch.int8).view(4, 64), q8.scale, q8.zero_point, bits=8, cols=64,
    block_size=32))
case("dequantize_scale", lambda: _native.dequantize(
    q8.q, shrunk(8, 4).view(4, 2), q8.zero_point, bits=8, cols=64, block_size=32))
case("dequantize_zero_point", lambda: _native.dequantize(
    q8.q, q8.scale, shrunk(8, 0, dtype=torch.int8).view(4, 2), bits=8, cols=64, block_size=32))
case("dequantize_out", lambda: _native.dequantize(
    q8.q, q8.scale, q8.zero_point, bits=8, cols=64, block_size=32,
    out=shrunk(256, 1020).view(4, 64)))
print("survived", flush=True)
'''


def test_storage_smaller_than_shape_is_refused_for_every_tensor_argument():
    cases = run_child(STORAGE_CASES)
    check(cases, "convert_src", "ValueError", "src (shape (1000,)", "needs 4040 bytes",
          "storage has 16 bytes", ".clone()")
    check(cases, "convert_src_null", "ValueError", "src (shape (1000,)", "needs 4000 bytes",
          "has 0 bytes")
    check(cases, "convert_src_near_end", "ValueError", "src (shape (10,)", "storage offset 990",
          "needs 4000 bytes", "has 3990 bytes")
    check(cases, "convert_src_unmapped", "ValueError", "src (shape (10000000,)",
          "needs 40000040 bytes", "has 16 bytes")
    check(cases, "convert_out_unmapped", "ValueError", "out (shape (10000000,)",
          "needs 40000000 bytes", "has 64 bytes")
    check(cases, "convert_out", "ValueError", "out (shape (1000,)", "needs 4000", "has 400")
    check(cases, "convert_out_null", "ValueError", "out (shape (1000,)", "needs 2000", "has 0")
    check(cases, "scatter_src", "ValueError", "src (shape (8, 8)", "needs 256", "has 8")
    check(cases, "scatter_src_int8", "ValueError", "src (shape (64, 64)", "needs 4096", "has 100")
    check(cases, "quantize_w", "ValueError", "w (shape (64, 64)", "needs 16384", "has 1000")
    check(cases, "quantize_out_q", "ValueError", "out.q (shape (4, 64)", "needs 256", "has 10")
    check(cases, "quantize_out_zero_point", "ValueError", "out.zero_point (shape (4, 2)",
          "needs 8", "has 0")
    check(cases, "quantize_out_sqnr", "ValueError", "out.sqnr_db (shape (4,)", "needs 16",
          "has 12")
    check(cases, "dequantize_q", "ValueError", "q (shape (4, 64)", "needs 256", "has 3")
    check(cases, "dequantize_scale", "ValueError", "scale (shape (4, 2)", "needs 32", "has 4")
    check(cases, "dequantize_zero_point", "ValueError", "zero_point (shape (4, 2)", "has 0")
    check(cases, "dequantize_out", "ValueError", "out (shape (4, 64)", "needs 1024", "has 1020")


SUBCLASS_CASES = '''
from torch._subclasses.fake_tensor import FakeTensorMode

class Lying(torch.Tensor):
    """Claims a data pointer that is not its own; the C core must never see it."""
    def data_ptr(self):
        return 16
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})

x = torch.linspace(-3, 3, 1000)
lying = x.clone().as_subclass(Lying)
def lying_convert():
    y = _native.convert(lying, torch.bfloat16)
    assert torch.equal(y, x.to(torch.bfloat16)), "wrong values"
case("lying_src", lying_convert)
def lying_out():
    out = torch.empty(1000, dtype=torch.float16).as_subclass(Lying)
    res = _native.convert(x, torch.float16, out=out)
    assert res is out, "out is not returned"
    assert torch.equal(torch.Tensor.as_subclass(out, torch.Tensor), x.to(torch.float16))
case("lying_out", lying_out)
def param_quantize():
    w = torch.nn.Parameter(torch.randn(8, 64))
    qz = _native.quantize(w, bits=8, symmetric=True, block_size=-1)
    ref = _native.quantize(w.detach().clone(), bits=8, symmetric=True, block_size=-1)
    assert torch.equal(qz.q, ref.q) and torch.equal(qz.scale, ref.scale)
case("parameter_w", param_quantize)
with FakeTensorMode():
    fake = torch.empty(1000)
    fake_q = torch.empty(4, 64, dtype=torch.int8)
case("fake_src", lambda: _native.convert(fake, torch.bfloat16))
case("fake_out", lambda: _native.convert(torch.zeros(1000), torch.float32, out=fake))
case("fake_scatter", lambda: _native.scatter_shards(fake.view(10, 100), (2, 1), torch.float32))
case("fake_dequantize_q", lambda: _native.dequantize(
    fake_q, torch.ones(4, 1), None, bits=8, cols=64, block_size=-1))
case("meta_src", lambda: _native.convert(torch.empty(1000, device="meta"), torch.bfloat16))
nested = torch.nested.nested_tensor([torch.randn(3), torch.randn(5)])
case("nested_src", lambda: _native.convert(nested, torch.bfloat16))
case("jagged_w", lambda: _native.quantize(
    torch.nested.nested_tensor([torch.randn(3, 64), torch.randn(5, 64)], layout=torch.jagged),
    bits=8, symmetric=True, block_size=-1))
case("vmap_src", lambda: torch.vmap(lambda t: _native.convert(t, torch.bfloat16))(torch.randn(3, 4)))
case("grad_src", lambda: torch.func.grad(
    lambda t: _native.convert(t, torch.float32).sum())(torch.randn(4)))
case("sparse_src", lambda: _native.convert(torch.randn(4).to_sparse(), torch.bfloat16))
case("meta_out", lambda: _native.convert(
    torch.zeros(10), torch.bfloat16, out=torch.empty(10, dtype=torch.bfloat16, device="meta")))
print("survived", flush=True)
'''


def test_tensor_subclasses_and_meta_tensors():
    cases = run_child(SUBCLASS_CASES)
    check(cases, "lying_src", "ok")  # the real pointer is used, not the one data_ptr() claims
    check(cases, "lying_out", "ok")
    check(cases, "parameter_w", "ok")
    for name, arg in [("fake_src", "src"), ("fake_out", "out"), ("fake_scatter", "src"),
                      ("fake_dequantize_q", "q")]:
        check(cases, name, "ValueError", f"{arg} is a FakeTensor", "__torch_dispatch__",
              "plain CPU torch.Tensor")
    check(cases, "meta_src", "ValueError", "src is on device meta", ".cpu()")
    check(cases, "nested_src", "ValueError", "src is a nested tensor", ".unbind()")
    check(cases, "jagged_w", "ValueError", "w is a nested tensor", ".unbind()")
    check(cases, "vmap_src", "ValueError", "src has no storage of its own", "BatchedTensorImpl",
          "outside the transform")
    check(cases, "grad_src", "ValueError", "src has no storage of its own", "outside the transform")
    check(cases, "sparse_src", "ValueError", "src has layout torch.sparse_coo", ".to_dense()")
    check(cases, "meta_out", "ValueError", "out is on device meta", ".cpu()")


# ---- read-only (or unreadable) memory -------------------------------------------------------

READONLY_CASES = '''
d = os.environ["AXL_TEST_DIR"]
def ro_memmap(name, n, dtype):
    path = os.path.join(d, name)
    np.zeros(n, dtype=dtype).tofile(path)
    return torch.from_numpy(np.memmap(path, mode="r", dtype=dtype))
x = torch.randn(4096)
case("convert_out_memmap_r", lambda: _native.convert(x, torch.float32, out=ro_memmap("a", 4096, np.float32)))
ro = mmap.mmap(-1, 8192, prot=mmap.PROT_READ)
case("convert_out_prot_read", lambda: _native.convert(
    x, torch.float16, out=torch.frombuffer(ro, dtype=torch.float16)))
w = torch.randn(16, 64)
case("quantize_out_q_ro", lambda: _native.quantize(
    w, bits=8, symmetric=True, block_size=-1,
    out=_native.Quantized(ro_memmap("q", 16 * 64, np.int8).view(16, 64), torch.empty(16, 1),
                          None, None, None)))
case("quantize_out_scale_ro", lambda: _native.quantize(
    w, bits=8, symmetric=True, block_size=-1,
    out=_native.Quantized(torch.empty(16, 64, dtype=torch.int8),
                          ro_memmap("s", 16, np.float32).view(16, 1), None, None, None)))
case("quantize_out_max_err_ro", lambda: _native.quantize(
    w, bits=8, symmetric=True, block_size=-1, stats=True,
    out=_native.Quantized(torch.empty(16, 64, dtype=torch.int8), torch.empty(16, 1), None,
                          torch.frombuffer(ro, dtype=torch.float32, count=16), torch.empty(16))))
q = _native.quantize(w, bits=8, symmetric=True, block_size=-1)
case("dequantize_out_ro", lambda: _native.dequantize(
    q.q, q.scale, None, bits=8, cols=64, block_size=-1,
    out=ro_memmap("o", 16 * 64, np.float32).view(16, 64)))
# Inputs over memory the process may not even read.
none = mmap.mmap(-1, 8192, prot=0)  # PROT_NONE
case("convert_src_prot_none", lambda: _native.convert(
    torch.frombuffer(none, dtype=torch.float32), torch.bfloat16))
case("scatter_src_prot_none", lambda: _native.scatter_shards(
    torch.frombuffer(none, dtype=torch.float32).view(64, 32), (2, 2), torch.float32))
case("quantize_w_prot_none", lambda: _native.quantize(
    torch.frombuffer(none, dtype=torch.float32).view(32, 64), bits=4, symmetric=False,
    block_size=32))
case("dequantize_q_prot_none", lambda: _native.dequantize(
    torch.frombuffer(none, dtype=torch.int8, count=1024).view(16, 64), q.scale, None, bits=8,
    cols=64, block_size=-1))
# Read-only inputs are fine: they are only read.
def ro_input():
    src = ro_memmap("i", 4096, np.float32)
    y = _native.convert(src, torch.bfloat16)
    assert torch.equal(y, torch.zeros(4096, dtype=torch.bfloat16))
case("convert_src_memmap_r", ro_input)
# Writable file mappings and copy-on-write mappings are valid outputs.
def writable_maps():
    for mode in ("r+", "c"):
        path = os.path.join(d, "w" + mode)
        np.zeros(4096, dtype=np.float32).tofile(path)
        out = torch.from_numpy(np.memmap(path, mode=mode, dtype=np.float32))
        assert _native.convert(x, torch.float32, out=out) is out
        assert torch.equal(out, x), mode
    out = torch.frombuffer(bytearray(4096 * 2), dtype=torch.bfloat16)
    _native.convert(x, torch.bfloat16, out=out)
    assert torch.equal(out, x.to(torch.bfloat16))
case("writable_maps", writable_maps)
print("survived", flush=True)
'''


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")
def test_read_only_memory_is_refused_as_output(tmp_path):
    cases = run_child(READONLY_CASES, tmp_path)
    for name, arg in [("convert_out_memmap_r", "out (shape (4096,)"),
                      ("convert_out_prot_read", "out (shape (4096,)"),
                      ("quantize_out_q_ro", "out.q (shape (16, 64)"),
                      ("quantize_out_scale_ro", "out.scale (shape (16, 1)"),
                      ("quantize_out_max_err_ro", "out.max_err (shape (16,)"),
                      ("dequantize_out_ro", "out (shape (16, 64)")]:
        check(cases, name, "ValueError", arg, "cannot write", "read-only", "pass a writable tensor")
    for name, arg in [("convert_src_prot_none", "src (shape (2048,)"),
                      ("scatter_src_prot_none", "src (shape (64, 32)"),
                      ("quantize_w_prot_none", "w (shape (32, 64)"),
                      ("dequantize_q_prot_none", "q (shape (16, 64)")]:
        check(cases, name, "ValueError", arg, "cannot read", "not readable")
    check(cases, "convert_src_memmap_r", "ok")
    check(cases, "writable_maps", "ok")


# ---- argument sizes that would never return ---------------------------------------------------

GRID_CASES = '''
import time
d = os.environ["AXL_TEST_DIR"]
case("scatter_empty_huge_grid", lambda: _native.scatter_shards(
    torch.empty(0, 10**6), (1, 10**6), torch.float32))
case("scatter_empty_enormous_grid", lambda: _native.scatter_shards(
    torch.empty(0, 2**40, 2**20), (1, 2**40, 2**20), torch.bfloat16))
case("scatter_tiny_blocks", lambda: _native.scatter_shards(
    torch.zeros(2**17, dtype=torch.int8), (2**17,), torch.int8))
path = os.path.join(d, "empty.bin")
open(path, "wb").close()
case("read_empty_huge_grid", lambda: _native.read_shards(
    path, 0, torch.float32, (0, 2**50), (1, 2**50), torch.float32))
case("read_shape_endless", lambda: _native.read_shards(
    path, 0, torch.float32, range(10**18), (1,), torch.float32))
case("read_shape_len_overflow", lambda: _native.read_shards(
    path, 0, torch.float32, range(10**20), (1,), torch.float32))
case("scatter_grid_endless", lambda: _native.scatter_shards(
    torch.zeros(4, 4), range(1, 10**18), torch.float32))
def limit():
    t0 = time.monotonic()
    blocks = _native.scatter_shards(torch.empty(0, 2**16), (1, 2**16), torch.float32)
    assert len(blocks) == 2**16 and blocks[0].shape == (0, 1)
    assert time.monotonic() - t0 < 30
case("scatter_at_limit", limit)
def huge_threads():
    x = torch.randn(1 << 16)
    assert torch.equal(_native.convert(x, torch.bfloat16, nthreads=2**31 - 1), x.to(torch.bfloat16))
    blocks = _native.scatter_shards(x.view(256, 256), (2, 4), torch.float16, nthreads=2**31 - 1)
    assert torch.equal(blocks[5], x.view(256, 256)[128:, 64:128].to(torch.float16))
case("huge_nthreads", huge_threads)
print("survived", flush=True)
'''


def test_block_count_is_bounded(tmp_path):
    cases = run_child(GRID_CASES, tmp_path)
    check(cases, "scatter_empty_huge_grid", "ValueError", "grid (1, 1000000)",
          "1000000 blocks", "more than the 65536 allowed")
    check(cases, "scatter_empty_enormous_grid", "ValueError", f"{2**60} blocks", "65536")
    check(cases, "scatter_tiny_blocks", "ValueError", "grid (131072,)", "131072 blocks")
    check(cases, "read_empty_huge_grid", "ValueError", f"{2**50} blocks", "65536 allowed")
    check(cases, "read_shape_endless", "ValueError", f"shape has {10**18} entries", "at most 8 dims")
    check(cases, "read_shape_len_overflow", "ValueError", "shape has too many entries")
    check(cases, "scatter_grid_endless", "ValueError", "grid has", "at most 8 dims")
    check(cases, "scatter_at_limit", "ok")
    check(cases, "huge_nthreads", "ok")


# ---- files that are not regular files ---------------------------------------------------------

FIFO_CASES = '''
import ctypes
d = os.environ["AXL_TEST_DIR"]
fifo = os.path.join(d, "pipe")
os.mkfifo(fifo)
case("read_fifo", lambda: _native.read_shards(fifo, 0, torch.float32, (4, 4), (2, 1), torch.float32))
case("read_dir", lambda: _native.read_shards(d, 0, torch.float32, (4, 4), (2, 1), torch.float32))
case("read_device", lambda: _native.read_shards(
    "/dev/zero", 0, torch.float32, (4, 4), (2, 1), torch.float32))
# The C core itself, past the Python checks (a path swapped for a FIFO after os.stat).
def c_fifo():
    lib = _native._get_lib()
    blocks = [torch.empty(2, 4) for _ in range(2)]
    ptrs = (ctypes.c_void_p * 2)(*(b.data_ptr() for b in blocks))
    scratch = torch.empty(1 << 12, dtype=torch.uint8)
    shape, grid = (ctypes.c_int64 * 2)(4, 4), (ctypes.c_int64 * 2)(2, 1)
    status = lib.axl_read_shards(os.fsencode(fifo), 0, 0, 2, shape, grid, ptrs, 0,
                                 scratch.data_ptr(), 1 << 12, 1, 0)
    raise RuntimeError(f"status {status}")
case("c_fifo", c_fifo)
def good_file():
    x = torch.randn(6, 8)
    path = os.path.join(d, "good.bin")
    with open(path, "wb") as f:
        f.write(b"header--")
        f.write(x.numpy().tobytes())
    blocks = _native.read_shards(path, 8, torch.float32, (6, 8), (3, 2), torch.bfloat16)
    assert len(blocks) == 6
    assert torch.equal(blocks[3], x[2:4, 4:].to(torch.bfloat16))
case("read_regular_file", good_file)
print("survived", flush=True)
'''


def test_read_shards_never_opens_a_fifo(tmp_path):
    cases = run_child(FIFO_CASES, tmp_path)
    check(cases, "read_fifo", "ValueError", "pipe is a FIFO (named pipe)", "not a regular file",
          "checkpoint file's path")
    check(cases, "read_dir", "ValueError", "is a directory", "not a regular file")
    check(cases, "read_device", "ValueError", "/dev/zero is a device", "not a regular file")
    # AXL_ERR_IO (10), returned at once instead of waiting for a writer.
    check(cases, "c_fifo", "RuntimeError", "status 10")
    check(cases, "read_regular_file", "ok")


# ---- quantize(): the truth about huge finite weights (in process: no crash risk) -------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_asymmetric_range_overflow_names_row_values_and_fix(dtype):
    w = torch.zeros(6, 128)
    w[4, 70] = 3e38
    w[4, 90] = -3e38
    w = w.to(dtype)
    with pytest.raises(_native.NativeError) as info:
        _native.quantize(w, bits=8, symmetric=False, block_size=32)
    e = info.value
    assert (e.code, e.row, e.reason) == (7, 4, "range_overflow")
    message = str(e)
    assert "NaN or Inf" not in message
    hi, lo = float(w[4, 70]), float(w[4, 90])
    for words in ["row 4 of the weight is finite", "block 2 (columns 64 to 95)",
                  f"{lo:.6g} (column 90)", f"{hi:.6g} (column 70)",
                  f"max - min = {hi - lo:.6g} overflows float32 arithmetic",
                  "scale the weights down", "symmetric=True", "exclude_layers"]:
        assert words in message, (words, message)
    # The same weight is fine where the arithmetic does not overflow: symmetric, or halved.
    sym = _native.quantize(w, bits=8, symmetric=True, block_size=32)
    assert float(sym.scale[4, 2]) == pytest.approx(float(w[4, 70].float()) / 127, rel=1e-6)
    assert int(sym.q[4, 70]) == 127 and int(sym.q[4, 90]) == -127
    _native.quantize(w / 2, bits=8, symmetric=False, block_size=32)


def test_one_huge_value_alone_is_quantized():
    # 3e38 with the row's other values in [0, 3e38]: hi - lo = 3e38 fits float32.
    w = torch.zeros(2, 64)
    w[1, 5] = 3e38
    for symmetric in (True, False):
        r = _native.quantize(w, bits=4, symmetric=symmetric, block_size=-1, stats=True)
        assert math.isfinite(float(r.scale[1, 0])) and float(r.scale[1, 0]) > 1e37
        back = _native.dequantize(r.q, r.scale, r.zero_point, bits=4, cols=64, block_size=-1)
        assert float(back[1, 5]) == pytest.approx(3e38, rel=0.1)


def test_nan_row_keeps_its_reason():
    w = torch.ones(3, 64)
    w[2, 7] = float("inf")
    with pytest.raises(_native.NativeError, match=r"row 2 .*NaN or Inf.*column 7: inf.*exclude_layers") as info:
        _native.quantize(w, bits=8, symmetric=False, block_size=-1)
    assert (info.value.row, info.value.reason) == (2, "non_finite")


# ---- the checks do not reject good input -----------------------------------------------------


def test_valid_outputs_are_filled_and_returned():
    x = torch.randn(33, 70)
    out = torch.empty(33, 70, dtype=torch.float16)
    assert _native.convert(x, torch.float16, out=out) is out
    assert torch.equal(out, x.to(torch.float16))
    # A view into the middle of a larger storage is a valid output.
    big = torch.zeros(5000, dtype=torch.bfloat16)
    view = big[100:100 + 33 * 70].view(33, 70)
    _native.convert(x, torch.bfloat16, out=view)
    assert torch.equal(view, x.to(torch.bfloat16)) and not big[:100].any() and not big[2410:].any()

    w = torch.randn(8, 64)
    fresh = _native.quantize(w, bits=4, symmetric=False, block_size=32, stats=True)
    out_q = _native.Quantized(torch.empty(8, 32, dtype=torch.uint8), torch.empty(8, 2),
                              torch.empty(8, 2, dtype=torch.int8), torch.empty(8), torch.empty(8))
    got = _native.quantize(w, bits=4, symmetric=False, block_size=32, stats=True, out=out_q)
    assert got is out_q
    for a, b in zip(got, fresh):  # offset is None in both (not the offset scheme)
        assert (a is None and b is None) or torch.equal(a, b)
    y = torch.empty(8, 64)
    assert _native.dequantize(got.q, got.scale, got.zero_point, bits=4, cols=64,
                              block_size=32, out=y) is y
    assert torch.equal(y, _native.dequantize(fresh.q, fresh.scale, fresh.zero_point, bits=4,
                                             cols=64, block_size=32))


def test_empty_tensors_and_zero_storage_are_fine():
    empty = torch.empty(0, 16)
    assert _native.convert(empty, torch.bfloat16).shape == (0, 16)
    assert _native.convert(empty, torch.float16, out=torch.empty(0, 16, dtype=torch.float16)).numel() == 0
    assert len(_native.scatter_shards(empty, (1, 4), torch.float32)) == 4
    r = _native.quantize(torch.empty(0, 64), bits=8, symmetric=True, block_size=-1)
    assert r.q.shape == (0, 64)


def test_memory_check_helpers():
    maps = [(0x1000, 0x3000, b"rw-p"), (0x3000, 0x4000, b"r--p"), (0x5000, 0x6000, b"---p")]
    assert _native._range_problem(maps, 0x1000, 0x3000, True) is None
    assert _native._range_problem(maps, 0x2000, 0x4000, False) is None
    assert "read-only" in _native._range_problem(maps, 0x2000, 0x3001, True)
    assert "not mapped" in _native._range_problem(maps, 0x3800, 0x4800, False)
    assert "not mapped" in _native._range_problem(maps, 0x0, 0x10, False)
    assert "not readable" in _native._range_problem(maps, 0x5000, 0x5001, False)
    t = torch.empty(1 << 20)  # before reading the maps: its memory may be a new mapping
    own = _native._read_mappings()
    if own is not None:  # this process's heap tensor is readable and writable
        start, end = _native._byte_range(t)
        assert _native._range_problem(own, start, end, True) is None


@pytest.mark.parametrize("symmetric", [True, False])
def test_a_grid_overflowing_float32_is_named_not_reported_as_a_bug(symmetric):
    """FLT_MAX with a bf16 scale (rounded up): scale x levels overflows, found by the fuzzer."""
    w = torch.zeros(3, 32)
    w[2, 5] = torch.finfo(torch.float32).max
    with pytest.raises(_native.NativeError, match=r"row 2 of the weight is finite.*column 5.*"
                                                  r"grid.*overflows float32.*exclude_layers") as e:
        _native.quantize(w, bits=4, symmetric=symmetric, block_size=32,
                         scale_dtype=torch.bfloat16)
    assert e.value.reason == "grid_overflow" and e.value.row == 2
    assert "please report" not in str(e.value) and "NaN or Inf" not in str(e.value)
