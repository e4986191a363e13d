"""radixrt's GGUF header reader against `gguf.GGUFReader` (the library llama.cpp ships): the same
tensor table and data views, the same scalar metadata, for both byte orders and a non-default
alignment; and clear errors for files that are not GGUF v2/v3 or are cut short."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from radixrt.model.gguf_reader import GGUFArrayInfo, GGUFHeaderReader

gguf = pytest.importorskip("gguf")


def write_sample(path: Path, big_endian: bool = False, alignment: int | None = None) -> Path:
    """Metadata of every kind (large string arrays like a tokenizer's, numeric and nested arrays)
    and tensors of the plain and block types radixrt loads."""
    endian = gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE
    w = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_block_count(2)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_bool("test.flag", True)
    w.add_uint64("test.big", 2**40 + 3)
    w.add_int32("test.neg", -7)
    w.add_string("test.text", "héllo")
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" * (1 + i % 3) for i in range(3000)])
    w.add_array("tokenizer.ggml.scores", [float(i) / 7 for i in range(3000)])
    w.add_array("test.nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    w.add_tensor("a.f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("a.f16", rng.standard_normal((4, 6)).astype(np.float16))
    w.add_tensor("a.i32", np.arange(7, dtype=np.int32))
    for name in ("Q4_0", "Q4_1", "Q8_0"):
        t = gguf.GGMLQuantizationType[name]
        arr = rng.standard_normal((6, 64)).astype(np.float32)
        w.add_tensor(f"w.{name}", gguf.quants.quantize(arr, t), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("big_endian", [False, True])
@pytest.mark.parametrize("alignment", [None, 64])
def test_same_tensors_and_scalars_as_gguf_reader(tmp_path: Path, big_endian: bool,
                                                 alignment: int | None) -> None:
    path = write_sample(tmp_path / "s.gguf", big_endian, alignment)
    ours, ref = GGUFHeaderReader(path), gguf.GGUFReader(str(path))
    assert ours.byte_order == (">" if big_endian else "<")
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        assert a.tensor_type == b.tensor_type, a.name
        assert list(a.shape) == b.shape.tolist(), a.name
        assert (a.n_elements, a.n_bytes, a.data_offset) == (b.n_elements, b.n_bytes,
                                                            b.data_offset), a.name
        assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype, a.name
        assert np.array_equal(a.data, b.data), a.name
        assert not a.data.flags.writeable
    # what the weight loader does with the block types: dequantize the views
    q = next(t for t in ours.tensors if t.name == "w.Q4_1")
    assert np.array_equal(gguf.quants.dequantize(q.data, q.tensor_type),
                          gguf.quants.dequantize(ref.tensors[-2].data, q.tensor_type))
    assert set(ours.fields) == {k for k in ref.fields if not k.startswith("GGUF.")}
    for key, value in ours.fields.items():
        if isinstance(value, GGUFArrayInfo):
            if key == "test.nested":  # gguf flattens nested arrays; stepping over it is the point
                assert (value.item_type, value.count) == (9, 2)
            else:
                assert value.count == len(ref.fields[key].contents()), key
            continue
        expected = ref.fields[key].contents()
        assert value == pytest.approx(expected) if isinstance(value, float) else value == expected
    assert ours.string_field("general.architecture") == "llama"
    assert ours.fields["test.big"] == 2**40 + 3 and ours.fields["test.neg"] == -7
    with pytest.raises(ValueError, match="not a string"):
        ours.string_field("test.big")


def test_refuses_what_is_not_gguf_v2_or_v3_and_truncated_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFHeaderReader(bad)
    v1 = tmp_path / "v1.gguf"
    v1.write_bytes(b"GGUF" + struct.pack("<IQQ", 1, 0, 0))
    with pytest.raises(ValueError, match="version 1 is not supported"):
        GGUFHeaderReader(v1)
    good = write_sample(tmp_path / "s.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:-100])
    with pytest.raises(ValueError, match="runs past the end of the file"):
        GGUFHeaderReader(cut)


def test_default_model_header_matches_gguf_reader() -> None:
    """The shipped SmolLM2 file: every tensor the same (this is what `load_model` reads)."""
    from radixrt.model.loader import default_model_path

    try:
        path = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    ours, ref = GGUFHeaderReader(path), gguf.GGUFReader(str(path))
    assert len(ours.tensors) == len(ref.tensors) > 0
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        assert (a.name, a.tensor_type, a.data_offset, a.data.shape) == (
            b.name, b.tensor_type, b.data_offset, b.data.shape)
    assert ours.fields["tokenizer.ggml.tokens"].count == len(ref.fields["tokenizer.ggml.tokens"].data)
