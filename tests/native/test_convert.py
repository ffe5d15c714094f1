"""AutoXLA._native.convert against torch's own tensor.to(dtype), and the C test suite.

The oracle is PyTorch: every non-NaN result must equal src.to(dtype) bit for bit. PyTorch's
NaN bit patterns depend on the CPU capability and on the element's position in the tensor
(vector body vs scalar tail), so NaNs are checked against the one rule per pair that
csrc/include/autoxla.h documents, and for being NaN exactly where torch has NaN.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from AutoXLA import _native

ROOT = Path(__file__).resolve().parents[2]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
NTHREADS = [1, 0]

# f32 bit patterns that stress each conversion (the same classes as csrc/tests): signed
# zeros, infinities, NaNs with payloads, f32/f16 subnormals, bf16/f16 rounding ties, the
# f16 overflow boundary 65504 .. 65520.
F32_SPECIALS = [
    0x00000000, 0x80000000, 0x7F800000, 0xFF800000,
    0x7FC00000, 0xFFC00000, 0x7FC00001, 0xFFA12345, 0x7F800001, 0x7FBFFFFF, 0xFFFFFFFF,
    0x00000001, 0x80000001, 0x00008000, 0x00018000, 0x007FFFFF, 0x00800000,
    0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F7FFF, 0x7F7F8000,
    0x3F800000, 0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF,
    0x3F801000, 0x3F803000, 0x3F801001, 0xBF801000,
    0x477FE000, 0x477FEFFF, 0x477FF000, 0x477FF001, 0x47800000, 0xC77FF000, 0xC77FEFFF,
    0x33800000, 0x33000000, 0x33000001, 0xB3000000, 0x32FFFFFF,
    0x33C00000, 0x34200000, 0x387FC000, 0x387FFFFF, 0x38800000, 0x387FF000,
]


def _from_bits(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return bits.to(BITS[dtype]).view(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Unsigned bit patterns as int64, for comparisons and readable failure messages."""
    mask = 0xFFFFFFFF if t.dtype == torch.float32 else 0xFFFF
    return t.view(BITS[t.dtype]).to(torch.int64) & mask


def _inputs(dtype: torch.dtype) -> torch.Tensor:
    """Every 16-bit pattern for bf16/f16; for f32 the specials, a sweep over all exponents,
    random bit patterns and random ordinary values."""
    if dtype != torch.float32:
        return _from_bits(torch.arange(65536, dtype=torch.int64), dtype)
    g = torch.Generator().manual_seed(0)
    sweep = torch.arange(1 << 20, dtype=torch.int64) * 4093 % (1 << 32)
    rand_bits = torch.randint(0, 1 << 32, (1 << 18,), generator=g, dtype=torch.int64)
    values = torch.randn(1 << 16, generator=g) * torch.logspace(-30, 30, 1 << 16)
    bits = torch.cat([torch.tensor(F32_SPECIALS, dtype=torch.int64), sweep, rand_bits])
    # int64 -> int32 keeps the low 32 bits, so patterns >= 2^31 survive.
    return torch.cat([_from_bits(bits, dtype), values])


def _nan_rule(src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bits the C core gives a NaN input, per autoxla.h (only read where src is NaN)."""
    b = _bits(src)
    if dtype == src.dtype:
        return b
    if dtype == torch.bfloat16:
        return torch.full_like(b, 0x7FC0)
    if src.dtype == torch.float16:  # -> f32: quiet, sign and payload kept
        return ((b & 0x8000) << 16) | 0x7FC00000 | ((b & 0x3FF) << 13)
    f32 = b << 16 if src.dtype == torch.bfloat16 else b
    if dtype == torch.float32:  # bf16 -> f32: a plain shift
        return f32
    return ((f32 >> 16) & 0x8000) | 0x7E00 | ((f32 >> 13) & 0x3FF)  # -> f16


def _assert_matches_torch(src: torch.Tensor, got: torch.Tensor, dtype: torch.dtype) -> None:
    want = src.to(dtype)
    assert got.dtype == dtype and got.shape == src.shape
    nan = torch.isnan(src.float())
    assert torch.equal(torch.isnan(got.float()), torch.isnan(want.float()))
    assert torch.equal(torch.isnan(got.float()), nan)
    expected = torch.where(nan, _nan_rule(src, dtype), _bits(want))
    bad = (_bits(got) != expected).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        pytest.fail(
            f"{src.dtype} -> {dtype}: {bad.numel()} mismatches; first at {i}: input "
            f"{int(_bits(src)[i]):#x}, got {int(_bits(got)[i]):#x}, want {int(expected[i]):#x}"
        )


# ---- conversions ----------------------------------------------------------------------


@pytest.mark.parametrize("nthreads", NTHREADS)
@pytest.mark.parametrize("isa", _native.available_isas())
@pytest.mark.parametrize("dst", DTYPES, ids=str)
@pytest.mark.parametrize("src_dtype", DTYPES, ids=str)
def test_convert_equals_torch(src_dtype, dst, isa, nthreads):
    src = _inputs(src_dtype)
    got = _native.convert(src, dst, nthreads=nthreads, isa=isa)
    _assert_matches_torch(src, got, dst)


@pytest.mark.parametrize("n", [0, 1, 7, 17, 1000003])
def test_odd_sizes_and_shapes(n):
    g = torch.Generator().manual_seed(n)
    src = torch.randn(n, generator=g) * 1e4
    for dtype in DTYPES:
        _assert_matches_torch(src, _native.convert(src, dtype), dtype)
    if n:
        two_d = src[: n // 7 * 7].reshape(-1, 7).to(torch.bfloat16)
        got = _native.convert(two_d, torch.float16, nthreads=2)
        assert got.shape == two_d.shape
        _assert_matches_torch(two_d.flatten(), got.flatten(), torch.float16)


def test_scalar_tensor_and_out():
    src = torch.tensor(65520.0)
    assert torch.isinf(_native.convert(src, torch.float16))
    out = torch.empty(3, 5, dtype=torch.bfloat16)
    src = torch.randn(3, 5)
    assert _native.convert(src, torch.bfloat16, out=out) is out
    assert torch.equal(out, src.to(torch.bfloat16))


def test_thread_counts_agree():
    g = torch.Generator().manual_seed(1)
    src = torch.randint(-(2**31), 2**31, (1000003,), generator=g, dtype=torch.int64)
    src = src.to(torch.int32).view(torch.float32)
    for dtype in (torch.bfloat16, torch.float16):
        one = _native.convert(src, dtype, nthreads=1)
        for nthreads in (2, 3, 0):
            assert torch.equal(_bits(_native.convert(src, dtype, nthreads=nthreads)), _bits(one))


def test_queries():
    features = _native.cpu_features()
    assert set(features) >= {"avx2", "f16c", "fma", "avx512f", "avx512bw", "avx512vl"}
    assert all(isinstance(v, bool) for v in features.values())
    assert _native.best_isa() in ("scalar", "avx2", "avx512")
    assert _native.available_isas()[0] == "scalar"
    assert _native.available_isas()[-1] == _native.best_isa()
    assert _native.num_cpus() >= 1


# ---- bad arguments: always a Python exception, never a crash -------------------------


def test_rejects_non_contiguous():
    with pytest.raises(ValueError, match=r"\.contiguous\(\)"):
        _native.convert(torch.randn(4, 3).t(), torch.bfloat16)
    out = torch.empty(3, 4, dtype=torch.bfloat16).t()
    with pytest.raises(ValueError, match=r"\.contiguous\(\)"):
        _native.convert(torch.randn(4, 3), torch.bfloat16, out=out)


@pytest.mark.parametrize("bad", [torch.float64, torch.int32, torch.int8, torch.uint8])
def test_rejects_wrong_dtypes(bad):
    with pytest.raises(ValueError, match="expected one of"):
        _native.convert(torch.zeros(4, dtype=bad), torch.float32)
    with pytest.raises(ValueError, match="expected one of"):
        _native.convert(torch.zeros(4), bad)


def test_rejects_non_tensors_and_non_dtypes():
    with pytest.raises(TypeError, match="torch.Tensor"):
        _native.convert([1.0, 2.0], torch.float16)
    with pytest.raises(TypeError, match="torch.dtype"):
        _native.convert(torch.zeros(4), "float16")


def test_rejects_other_devices_and_layouts():
    with pytest.raises(ValueError, match="meta"):
        _native.convert(torch.empty(4, device="meta"), torch.float16)
    out = torch.empty(4, dtype=torch.float16, device="meta")
    with pytest.raises(ValueError, match="meta"):
        _native.convert(torch.zeros(4), torch.float16, out=out)
    with pytest.raises(ValueError, match="to_dense"):
        _native.convert(torch.eye(3).to_sparse(), torch.float16)


def test_rejects_bad_out():
    src = torch.randn(8)
    with pytest.raises(ValueError, match="shape"):
        _native.convert(src, torch.float16, out=torch.empty(7, dtype=torch.float16))
    with pytest.raises(ValueError, match="shape"):
        _native.convert(src, torch.float16, out=torch.empty(2, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="dtype"):
        _native.convert(src, torch.float16, out=torch.empty(8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="requires grad"):
        _native.convert(src, torch.float32, out=torch.empty(8, requires_grad=True))
    with pytest.raises(ValueError, match="shares memory"):
        _native.convert(src, torch.float32, out=src)
    overlapping = src.view(torch.float16)[4:12]  # shares bytes 8..16 with the input below
    with pytest.raises(ValueError, match="shares memory"):
        _native.convert(src.view(torch.bfloat16)[:8], torch.float16, out=overlapping)


def test_rejects_odd_views():
    misaligned = torch.frombuffer(bytearray(40), dtype=torch.float32, offset=1, count=9)
    with pytest.raises(ValueError, match="aligned"):
        _native.convert(misaligned, torch.bfloat16)
    with pytest.raises(ValueError, match="resolve_neg"):
        _native.convert(torch._neg_view(torch.randn(4)), torch.bfloat16)


@pytest.mark.parametrize(
    "nthreads, error", [(-1, ValueError), (2**31, ValueError), (1.5, TypeError), (True, TypeError)]
)
def test_rejects_bad_nthreads(nthreads, error):
    with pytest.raises(error, match="nthreads"):
        _native.convert(torch.zeros(4), torch.float16, nthreads=nthreads)


@pytest.mark.parametrize("isa, error", [("sse2", ValueError), ("AVX2", ValueError), (2, TypeError)])
def test_rejects_unknown_isa(isa, error):
    with pytest.raises(error, match="isa"):
        _native.convert(torch.zeros(4), torch.float16, isa=isa)


def test_unsupported_isa_is_a_native_error():
    missing = [i for i in ("avx2", "avx512") if i not in _native.available_isas()]
    if not missing:
        pytest.skip("this CPU supports every ISA, so none can be refused")
    with pytest.raises(_native.NativeError, match="not support") as info:
        _native.convert(torch.zeros(4), torch.float16, isa=missing[-1])
    assert info.value.code == 4


def test_native_error_carries_code_and_message():
    with pytest.raises(_native.NativeError, match=r"overlap \(status 9\)") as info:
        _native._check_status(9, "test")
    assert info.value.code == 9
    _native._check_status(0, "test")  # success raises nothing


def test_missing_library_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.setattr(_native.library, "__file__", str(tmp_path / "_native" / "library.py"))
    monkeypatch.setattr(_native.library, "_lib", None)
    with pytest.raises(_native.NativeLibraryError, match=r"pip install -e \."):
        _native.convert(torch.zeros(4), torch.float16)


# ---- the C test suite ------------------------------------------------------------------


def _need_c_toolchain() -> None:
    if os.environ.get("AUTOXLA_C_SUITE_PASSED"):
        pytest.skip("./run test ran `make -C csrc test` and `make -C csrc sanitize` before pytest "
                    "(AUTOXLA_C_SUITE_PASSED is set); unset it to run them here again")
    missing = [tool for tool in ("make", "cc") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"needs {' and '.join(missing)} on PATH to build csrc/tests")


def _run_make(target: str) -> None:
    result = subprocess.run(
        ["make", "-C", str(ROOT / "csrc"), target], capture_output=True, text=True, timeout=900
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    lines = result.stdout.splitlines()
    summary = [line for line in lines if re.fullmatch(r"\d+ passed, \d+ failed", line)]
    assert summary and summary[-1].endswith(" 0 failed"), output[-4000:]


def test_c_suite():
    _need_c_toolchain()
    _run_make("test")


def test_c_suite_under_sanitizers(tmp_path):
    _need_c_toolchain()
    probe = tmp_path / "probe.c"
    probe.write_text("int main(void) { return 0; }\n")
    flags = ["-fsanitize=address,undefined", "-o", str(tmp_path / "probe")]
    if subprocess.run(["cc", *flags, str(probe)], capture_output=True).returncode != 0:
        pytest.skip("cc cannot link -fsanitize=address,undefined here (no libasan/libubsan)")
    _run_make("sanitize")
