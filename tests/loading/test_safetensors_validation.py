"""read_safetensors_header refuses every damaged .safetensors file with a CheckpointError that
names the file, the tensor and the fix, before any tensor byte is read; and on what
safetensors' own writer produces it reports exactly what safetensors' own reader reports.

Damaged files are written here byte by byte (json.dumps or hand-written JSON text, plus
struct.pack for the length), so each test states its damage. Pure file tests: no XLA.
"""
import json
import os
import random
import struct
import threading

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from AutoXLA import _native
from AutoXLA.loading import checkpoint as ckpt


def entry(dtype, shape, begin, end, **extra):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end], **extra}


def write(path, header, data_bytes=None, *, data=None):
    """A .safetensors file: header (a dict for json.dumps, or JSON text / bytes written as
    is), then data (default: data_bytes zero bytes, or as many as the header's largest end)."""
    if isinstance(header, dict):
        text = json.dumps(header).encode()
    elif isinstance(header, str):
        text = header.encode()
    else:
        text = header
    if data is None:
        if data_bytes is None:
            ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
            data_bytes = max(ends, default=0)
        data = bytes(range(256)) * (data_bytes // 256) + bytes(range(data_bytes % 256))
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def refused(path, *fragments, fix="download or save it again"):
    """The CheckpointError for path; its message names the file, every fragment and the fix."""
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.read_safetensors_header(path)
    message = str(info.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message, message
    assert fix in message, message
    return message


F32_1 = entry("F32", [1], 0, 4)


# ---- offsets -----------------------------------------------------------------------------


def test_overlapping_offsets(tmp_path):
    p = write(tmp_path / "m.safetensors", {"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 4, 12)})
    refused(p, "tensor 'b'", "overlaps", "'a'")


def test_offsets_not_starting_at_zero(tmp_path):
    # the first tensor's bytes would start inside what is really the header's padding
    p = write(tmp_path / "m.safetensors", {"a": entry("F32", [1], 4, 8)})
    refused(p, "tensor 'a'", "unused bytes", "begin after byte 0")


def test_gap_between_tensors(tmp_path):
    p = write(tmp_path / "m.safetensors", {"a": entry("F32", [1], 0, 4), "b": entry("F32", [1], 8, 12)})
    refused(p, "tensor 'b'", "unused bytes", "'a'")


def test_same_bytes_twice(tmp_path):
    p = write(tmp_path / "m.safetensors", {"a": entry("F32", [1], 0, 4), "b": entry("I32", [1], 0, 4)})
    refused(p, "tensor 'b'", "same bytes", "'a'")


def test_reversed_offsets(tmp_path):
    p = write(tmp_path / "m.safetensors", {"a": entry("F32", [0], 4, 0)}, 4)
    refused(p, "tensor 'a'", "end before they begin")


def test_offsets_disagree_with_shape(tmp_path):
    p = write(tmp_path / "m.safetensors", {"a": entry("F32", [3], 0, 8)})
    refused(p, "tensor 'a'", "need 12 bytes")


# ---- JSON types --------------------------------------------------------------------------


def test_header_is_a_list(tmp_path):
    p = write(tmp_path / "m.safetensors", json.dumps([{"a": F32_1}]), 4)
    refused(p, "unreadable safetensors header", "not a JSON object")


@pytest.mark.parametrize("value", ['"F32"', "[0, 4]", "4", "null"])
def test_entry_is_not_an_object(tmp_path, value):
    p = write(tmp_path / "m.safetensors", '{"a": ' + value + "}", 0)
    refused(p, "tensor 'a'", "not a JSON object")


@pytest.mark.parametrize("shape, what", [
    ("[1.0]", "fraction or exponent"),
    ("[1e0]", "fraction or exponent"),
    ('["1"]', "expected an integer"),
    ("[null]", "expected an integer"),
    ("[-1]", "negative"),
    ("[-0]", "negative"),
    ('"1"', '"shape" is not an array'),
    ("[01]", "leading zero"),
    ("[9223372036854775808]", "larger than 2^63-1"),
])
def test_bad_shape(tmp_path, shape, what):
    p = write(tmp_path / "m.safetensors",
              '{"w": {"dtype": "U8", "shape": ' + shape + ', "data_offsets": [0, 1]}}', 1)
    refused(p, "tensor 'w'", what)


@pytest.mark.parametrize("offsets, what", [
    ("[0]", "exactly 2"),
    ("[]", "exactly 2"),
    ("[0, 4, 4]", "exactly 2"),
    ('["0", 4]', "expected an integer"),
    ("[0.0, 4]", "fraction or exponent"),
    ("[0, 4.5]", "fraction or exponent"),
    ("[-4, 0]", "negative"),
    ('{"begin": 0}', '"data_offsets" is not an array'),
])
def test_bad_data_offsets(tmp_path, offsets, what):
    p = write(tmp_path / "m.safetensors",
              '{"w": {"dtype": "F32", "shape": [1], "data_offsets": ' + offsets + "}}", 4)
    refused(p, "tensor 'w'", what)


@pytest.mark.parametrize("field", ["dtype", "shape", "data_offsets"])
def test_missing_field(tmp_path, field):
    e = entry("F32", [1], 0, 4)
    del e[field]
    p = write(tmp_path / "m.safetensors", {"w": e}, 4)
    refused(p, "tensor 'w'", f'no "{field}"')


@pytest.mark.parametrize("value", [1, None, ["pt"]])
def test_metadata_must_map_strings(tmp_path, value):
    # null too: safetensors' own reader refuses it as well
    p = write(tmp_path / "m.safetensors", {"__metadata__": {"format": value}, "w": F32_1})
    refused(p, "__metadata__ value is not a string")


def test_null_metadata_is_no_metadata(tmp_path):
    p = write(tmp_path / "m.safetensors", {"__metadata__": None, "w": F32_1})
    assert list(ckpt.read_safetensors_header(p)) == ["w"]
    with safe_open(p, framework="pt") as f:
        assert f.metadata() is None and list(f.keys()) == ["w"]


def test_unknown_dtype(tmp_path):
    p = write(tmp_path / "m.safetensors", {"w": entry("F128", [1], 0, 16)})
    refused(p, "tensor 'w'", "unknown dtype")
    p = write(tmp_path / "n.safetensors", {"w": entry(32, [1], 0, 4)})
    refused(p, "tensor 'w'", '"dtype" is not a string')


@pytest.mark.parametrize("dtype", ["U16", "F8_E4M3", "F8_E5M2", "C64"])
def test_known_but_unsupported_dtype(tmp_path, dtype):
    bits = {"U16": 16, "F8_E4M3": 8, "F8_E5M2": 8, "C64": 64}[dtype]
    p = write(tmp_path / "m.safetensors", {"w": entry(dtype, [4], 0, bits // 2)})
    refused(p, "tensor 'w'", f"dtype '{dtype}'", "AutoXLA does not load", "BF16",
            fix="convert the checkpoint")


def test_byte_size_overflows_int64(tmp_path):
    # 2^61 float32 elements are 2^63 bytes: one more than int64 holds
    p = write(tmp_path / "m.safetensors", {"w": entry("F32", [2**61], 0, 0)}, 0)
    refused(p, "tensor 'w'", "overflows 64 bits")
    p = write(tmp_path / "n.safetensors", {"w": entry("U8", [2**32, 2**32], 0, 0)}, 0)
    refused(p, "tensor 'w'", "overflows 64 bits")


def test_duplicate_names(tmp_path):
    # json.dumps cannot write a key twice: the text is written by hand
    text = ('{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
            '"v": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}, '
            '"w": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}')
    p = write(tmp_path / "m.safetensors", text, 12)
    refused(p, "tensor 'w'", "appears twice")
    # the same name through an escape
    text = ('{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
            '"\\u0077": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}')
    p = write(tmp_path / "n.safetensors", text, 8)
    refused(p, "tensor 'w'", "appears twice")


def test_invalid_json(tmp_path):
    p = write(tmp_path / "m.safetensors", '{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},}', 4)
    refused(p, "unreadable safetensors header", "invalid JSON")
    p = write(tmp_path / "n.safetensors", b'{"w\xff": {}}', 0)
    refused(p, "unreadable safetensors header", "UTF-8")


# ---- file size ---------------------------------------------------------------------------


def test_truncated_file(tmp_path):
    header = {"a": entry("F32", [2], 0, 8), "b": entry("F32", [4], 8, 24)}
    p = write(tmp_path / "m.safetensors", header, 20)
    refused(p, "truncated", "tensor 'b'", "ends inside")
    # the header itself cut short
    full = write(tmp_path / "full.safetensors", header).read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(full[:30])
    refused(tmp_path / "cut.safetensors", "claims", "truncated")


def test_trailing_bytes(tmp_path):
    header = {"a": entry("F32", [2], 0, 8), "b": entry("F32", [4], 8, 24)}
    p = write(tmp_path / "m.safetensors", header, 25)
    refused(p, "trailing bytes", "1 unexplained bytes", "tensor 'b'")


def test_header_longer_than_file(tmp_path):
    p = tmp_path / "m.safetensors"
    p.write_bytes(struct.pack("<Q", 1000) + b'{"a": 1}')
    refused(p, "claims 1000 bytes", "has only 8")


def test_shorter_than_8_bytes(tmp_path):
    p = tmp_path / "m.safetensors"
    p.write_bytes(b"\x02\x00\x00")
    refused(p, "shorter than 8 bytes")


def test_fifo_is_refused_without_blocking(tmp_path):
    p = tmp_path / "model.safetensors"
    os.mkfifo(p)
    outcome = []

    def read():
        try:
            ckpt.read_safetensors_header(p)
        except ckpt.CheckpointError as e:
            outcome.append(e)
        except BaseException as e:  # noqa: BLE001 - reported below
            outcome.append(e)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(timeout=20)
    assert not t.is_alive(), "read_safetensors_header blocked on a FIFO"
    assert len(outcome) == 1 and isinstance(outcome[0], ckpt.CheckpointError), outcome
    assert str(p) in str(outcome[0]) and "FIFO" in str(outcome[0])


def test_directory_is_refused(tmp_path):
    p = tmp_path / "model.safetensors"
    p.mkdir()
    refused(p, "is a directory", fix="replace it")


# ---- valid files: exactly what safetensors reports ----------------------------------------


@pytest.fixture
def saved(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "w.bf16": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        "w.f16": torch.randn(2, 3, 4, generator=g).to(torch.float16),
        "w.f32": torch.randn(7, generator=g),
        "x.f64": torch.randn(3, 3, generator=g, dtype=torch.float64),
        "ids.i64": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "ids.i32": torch.arange(5, dtype=torch.int32),
        "ids.i16": torch.arange(4, dtype=torch.int16),
        "q.i8": torch.arange(-4, 4, dtype=torch.int8),
        "q.u8": torch.arange(9, dtype=torch.uint8).reshape(3, 3),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "scalar.bf16": torch.tensor(-1.25, dtype=torch.bfloat16),
        "empty": torch.zeros(0),
        "empty.2d": torch.zeros(3, 0, dtype=torch.float16),
        "caf\u00e9 \U0001F600": torch.ones(2),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, path, metadata={"format": "pt", "note": "q\"uote\n"})
    return path, tensors


def test_matches_safetensors_reader(saved):
    path, tensors = saved
    records = ckpt.read_safetensors_header(path)
    raw = path.read_bytes()
    with safe_open(path, framework="pt") as f:
        keys = set(f.keys())
        assert set(records) == keys == set(tensors)
        for name in keys:
            r = records[name]
            t = f.get_tensor(name)
            sl = f.get_slice(name)
            assert r.name == name and r.path == os.fspath(path)
            assert r.dtype == t.dtype == tensors[name].dtype
            assert r.shape == tuple(sl.get_shape()) == tuple(t.shape)
            assert ckpt.SAFETENSORS_DTYPES[sl.get_dtype()] == r.dtype
            want = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            assert r.nbytes == len(want)
            assert raw[r.offset:r.offset + r.nbytes] == want, name
    # file order, tiling the data section exactly
    (n,) = struct.unpack("<Q", raw[:8])
    at = 8 + n
    for r in records.values():
        assert r.offset == at
        at += r.nbytes
    assert at == len(raw)


def test_binding_on_safetensors_output(saved):
    path, tensors = saved
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    got = _native.parse_safetensors_header(raw[8:8 + n], len(raw))
    assert {t.name: (t.dtype, list(t.shape), [t.begin, t.end]) for t in got} == {
        k: (v["dtype"], v["shape"], v["data_offsets"]) for k, v in header.items()
        if k != "__metadata__"}
    assert [t.begin for t in got] == sorted(t.begin for t in got)


def test_mutated_headers_never_accepted_when_safetensors_refuses(saved, tmp_path):
    """Random byte edits of a real header: whatever AutoXLA accepts, safetensors accepts too,
    with the same tensors (AutoXLA is at least as strict), and nothing but CheckpointError
    ever comes out."""
    path, _ = saved
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    rng = random.Random(12)
    alphabet = b'{}[]:,"\\0123456789-.eE uFIBU_\x00\xff'
    accepted = 0
    for k in range(300):
        buf = bytearray(raw)
        for _ in range(rng.randint(1, 3)):
            buf[8 + rng.randrange(n)] = rng.choice(alphabet)
        p = tmp_path / f"mut{k}.safetensors"
        p.write_bytes(bytes(buf))
        try:
            ours = ckpt.read_safetensors_header(p)
        except ckpt.CheckpointError as e:
            assert str(p) in str(e)
            continue
        accepted += 1
        with safe_open(p, framework="pt") as f:
            assert set(f.keys()) == set(ours)
            for name, r in ours.items():
                assert tuple(f.get_slice(name).get_shape()) == r.shape
                assert ckpt.SAFETENSORS_DTYPES[f.get_slice(name).get_dtype()] == r.dtype
        p.unlink()
    assert accepted < 300   # the edits do damage
