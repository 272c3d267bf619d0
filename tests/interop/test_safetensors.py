"""Interop of moefit's safetensors code with the Python `safetensors` package.

moefit reads checkpoints that `safetensors` (through transformers, peft, ...)
wrote, and writes files that users will open with it. Both directions are
checked against the real client, through tests/checkpoint/safetensors_tool:

  (a) files written by safetensors.torch / safetensors.numpy (and hand-made
      files for dtypes those writers lack) are dumped by the tool, which must
      report the same dtypes, shapes, raw bytes (FNV-1a 64) and values;
      files safetensors rejects must be rejected by the tool too;
  (b) the file `safetensors_tool write` produces is opened with
      safetensors.safe_open and must hold exactly the tensors the tool was
      meant to write (rebuilt here with the same torch ops) and its metadata.

The tool is found through MOEFIT_BUILD_DIR (the CMake build directory, see the
build_dir fixture in conftest.py); the tests are skipped when it is not set.
launch/scripts/test.sh sets it.
"""

import json
import math
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import safetensors
import safetensors.numpy
import safetensors.torch
import torch
from safetensors import safe_open


def run_tool(tool, *args, check=True):
    result = subprocess.run([str(tool), *map(str, args)], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise AssertionError(f"safetensors_tool {' '.join(map(str, args))} failed:\n{result.stderr}")
    return result


def dump(tool, path):
    return json.loads(run_tool(tool, "dump", path).stdout)


def fnv1a64(data: bytes) -> str:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def as_json_float(x: float):
    """The tool's spelling of a float value."""
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


_HEADER_DTYPE = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.uint16: "U16",
    torch.int16: "I16",
    torch.uint32: "U32",
    torch.int32: "I32",
    torch.uint64: "U64",
    torch.int64: "I64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.complex64: "C64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.float8_e8m0fnu: "F8_E8M0",
    torch.float4_e2m1fn_x2: "F4",
}


def expected_values(t: torch.Tensor):
    """What the tool prints as "values" for tensor `t`."""
    flat = t.contiguous().reshape(-1)
    if t.dtype in (torch.int64, torch.uint64):
        return flat.tolist()
    if t.dtype == torch.complex64:
        return [[as_json_float(re), as_json_float(im)] for re, im in torch.view_as_real(flat).tolist()]
    if t.dtype == torch.float4_e2m1fn_x2:
        return None
    return [as_json_float(x) for x in flat.double().tolist()]


def check_dump_matches(entry, name, t: torch.Tensor):
    assert entry["name"] == name
    assert entry["dtype"] == _HEADER_DTYPE[t.dtype], name
    shape = list(t.shape)
    if t.dtype == torch.float4_e2m1fn_x2:
        shape[-1] *= 2  # the header counts F4 values, two per byte
    assert entry["shape"] == shape, name
    assert entry["fnv1a64"] == fnv1a64(raw_bytes(t)), name
    assert entry["values"] == expected_values(t), name


def all_torch_tensors():
    g = torch.Generator().manual_seed(0)
    ramp = torch.randn(4, 8, generator=g, dtype=torch.float64) * 300
    ramp.view(-1)[:3] = torch.tensor([0.0, -1.0, 65504.0], dtype=torch.float64)
    def every_byte():  # a fresh buffer each time: safetensors refuses tensors sharing memory
        return torch.arange(256, dtype=torch.int32).to(torch.uint8)

    tensors = {
        "f64": ramp.clone(),
        "f32": ramp.float(),
        "f16": ramp.half(),
        "bf16": ramp.bfloat16(),
        "i64": torch.tensor([-(2**63), -1, 0, 1, 2**63 - 1], dtype=torch.int64),
        "i32": ramp.int(),
        "i16": ramp.short(),
        "i8": every_byte().view(torch.int8),
        "u8": every_byte(),
        "u16": torch.tensor([0, 1, 65535, 4242], dtype=torch.uint16),
        "u32": torch.tensor([0, 1, 2**32 - 1, 123456789], dtype=torch.uint32),
        "u64": torch.tensor([0, 1, 2**64 - 1, 2**63 + 5], dtype=torch.uint64),
        "bool": ramp > 0,
        "c64": torch.complex(ramp.float(), -ramp.float()),
        # Every bit pattern of each 8-bit float, NaNs included.
        "f8_e4m3": every_byte().view(torch.float8_e4m3fn),
        "f8_e5m2": every_byte().view(torch.float8_e5m2),
        "f8_e4m3fnuz": every_byte().view(torch.float8_e4m3fnuz),
        "f8_e5m2fnuz": every_byte().view(torch.float8_e5m2fnuz),
        "f8_e8m0": every_byte().view(torch.float8_e8m0fnu),
        "f4": every_byte()[:6].clone().reshape(2, 3).view(torch.float4_e2m1fn_x2),
        "scalar": torch.tensor(2.5, dtype=torch.float32),
        "empty": torch.zeros(0, 3, dtype=torch.bfloat16),
        "model.layers.0.mlp.experts.10.w": torch.ones(2, 2),
        "model.layers.0.mlp.experts.9.w": torch.zeros(2, 2),
    }
    return tensors


# ---------------------------------------------------------------------------
# (a) written by safetensors, read by moefit


def test_reads_every_dtype_written_by_safetensors_torch(tool, tmp_path):
    tensors = all_torch_tensors()
    path = tmp_path / "torch.safetensors"
    safetensors.torch.save_file(tensors, str(path), metadata={"source": "pytest", "step": "3"})
    out = dump(tool, path)
    assert out["metadata"] == {"source": "pytest", "step": "3"}
    by_name = {entry["name"]: entry for entry in out["tensors"]}
    assert set(by_name) == set(tensors)
    for name, t in tensors.items():
        check_dump_matches(by_name[name], name, t)


def test_reads_files_written_by_safetensors_numpy(tool, tmp_path):
    rng = np.random.default_rng(1)
    arrays = {
        "f16": (rng.standard_normal((3, 5)) * 100).astype(np.float16),
        "f32": rng.standard_normal(7).astype(np.float32),
        "f64": np.array([0.1, -0.0, np.inf, -np.inf, np.nan]),
        "i32": rng.integers(-(2**31), 2**31 - 1, size=(2, 2), dtype=np.int32),
        "u16": np.array([0, 65535], dtype=np.uint16),
        "b": np.array([True, False, True]),
        "c64": np.array([1 + 2j, -3.5 - 0.25j], dtype=np.complex64),
    }
    path = tmp_path / "numpy.safetensors"
    safetensors.numpy.save_file(arrays, str(path))
    by_name = {entry["name"]: entry for entry in dump(tool, path)["tensors"]}
    assert set(by_name) == set(arrays)
    for name, array in arrays.items():
        check_dump_matches(by_name[name], name, torch.from_numpy(array))


def write_raw(path, entries, metadata=None):
    """Writes a safetensors file by hand: entries are (name, dtype, shape, bytes)."""
    header = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    data = b""
    for name, dtype, shape, payload in entries:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(payload)]}
        data += payload
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(text)) + text + data)


def test_reads_sub_byte_dtypes_by_checksum(tool, tmp_path):
    # No Python writer produces F6; the reference parser must accept the file.
    payloads = [("f6a", "F6_E2M3", [4], bytes([1, 2, 3])), ("f6b", "F6_E3M2", [2, 4], bytes(range(6))),
                ("f4", "F4", [6], bytes([0x21, 0x43, 0x65]))]
    path = tmp_path / "subbyte.safetensors"
    write_raw(path, payloads)
    safetensors.deserialize(path.read_bytes())  # valid for the reference too
    by_name = {entry["name"]: entry for entry in dump(tool, path)["tensors"]}
    for name, dtype, shape, payload in payloads:
        assert by_name[name]["dtype"] == dtype
        assert by_name[name]["shape"] == shape
        assert by_name[name]["fnv1a64"] == fnv1a64(payload)
        assert by_name[name]["values"] is None


@pytest.mark.parametrize(
    "case, entries",
    [
        ("overlap", [("a", "U8", [4], b"abcd"), ("b", "U8", [2], None)]),
        ("hole", [("a", "U8", [2], b"ab"), ("b", "U8", [2], b"cd")]),
        ("size", [("a", "F32", [2], b"abcd")]),
        ("dtype", [("a", "Q4", [2], b"ab")]),
    ],
)
def test_rejects_what_safetensors_rejects(tool, tmp_path, case, entries):
    header = {}
    data = b""
    for name, dtype, shape, payload in entries:
        if payload is None:  # overlap: point back into the previous tensor
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [1, 3]}
            continue
        begin = len(data) + (1 if case == "hole" and data else 0)
        data += b"\0" * (begin - len(data)) + payload
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [begin, len(data)]}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path = tmp_path / f"{case}.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    with pytest.raises(Exception):
        safetensors.deserialize(path.read_bytes())
    result = run_tool(tool, "dump", path, check=False)
    assert result.returncode == 1
    assert str(path) in result.stderr


# ---------------------------------------------------------------------------
# (b) written by moefit, read by safetensors


def expected_written_tensors():
    """The tensors `safetensors_tool write` writes (FixedTensors in the tool)."""
    ramp = torch.arange(12, dtype=torch.float64) * 0.37 - 1.1
    ints = torch.arange(6, dtype=torch.int64)
    return {
        "f32": ramp.to(torch.float32).reshape(3, 4),
        "f64": ramp,
        "f16": ramp.to(torch.float16).reshape(2, 6),
        "bf16": ramp.to(torch.bfloat16),
        "f8_e4m3": ramp.to(torch.float8_e4m3fn),
        "f8_e5m2": ramp.to(torch.float8_e5m2),
        "i64": ints * 1000000000000 - 2500000000000,
        "i32": (ints * 100000 - 250000).to(torch.int32),
        "i16": (ints * 1000 - 2500).to(torch.int16),
        "i8": (ints * 40 - 100).to(torch.int8),
        "u8": (ints * 50).to(torch.uint8),
        "u16": (ints * 10000).to(torch.uint16),
        "u32": (ints * 800000000).to(torch.uint32),
        "bool": torch.arange(5, dtype=torch.int64).remainder(2).eq(0),
        "c64": torch.complex(torch.arange(4, dtype=torch.float32), -torch.arange(4, dtype=torch.float32)),
        "scalar": torch.tensor(3.25, dtype=torch.float32),
        "empty": torch.zeros(0, 4, dtype=torch.float32),
        "model.layers.0.mlp.experts.10.w": torch.arange(4, dtype=torch.float32).reshape(2, 2),
        "model.layers.0.mlp.experts.9.w": -torch.arange(4, dtype=torch.float32).reshape(2, 2),
    }


def test_safe_open_reads_what_moefit_writes(tool, tmp_path):
    path = tmp_path / "moefit.safetensors"
    run_tool(tool, "write", path)
    assert not (tmp_path / "moefit.safetensors.tmp").exists()
    raw = path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    assert header_len % 8 == 0
    # Tensors appear in the header in the order written, after the metadata.
    expected = expected_written_tensors()
    header = json.loads(raw[8 : 8 + header_len])
    assert list(header) == ["__metadata__", *expected]

    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "producer": "moefit safetensors_tool", "step": "7"}
        assert set(f.keys()) == set(expected)
        for name, want in expected.items():
            got = f.get_tensor(name)
            assert got.dtype == want.dtype, name
            assert got.shape == want.shape, name
            assert raw_bytes(got) == raw_bytes(want), name

    # The whole-file loader (used by transformers) agrees.
    loaded = safetensors.torch.load_file(str(path))
    for name, want in expected.items():
        assert raw_bytes(loaded[name]) == raw_bytes(want), name


def test_round_trip_through_both(tool, tmp_path):
    """moefit writes, safetensors re-saves, moefit dumps: nothing changes."""
    first = tmp_path / "first.safetensors"
    run_tool(tool, "write", first)
    tensors = safetensors.torch.load_file(str(first))
    second = tmp_path / "second.safetensors"
    safetensors.torch.save_file(tensors, str(second))
    a = {e["name"]: e for e in dump(tool, first)["tensors"]}
    b = {e["name"]: e for e in dump(tool, second)["tensors"]}
    assert a == b
