"""The gguf package's reading of a file, the reference read_model's own scanner is held to;
and its writer, making a multi-file copy of a model."""

from __future__ import annotations

from stages.gguf_file import read_model


def assert_read_as_the_gguf_package_reads(path) -> None:
    """Every field (value, item types, GGUF types), every tensor's place and the alignment, as GGUFReader has them."""
    from gguf import GGUFReader, GGUFValueType

    ours, theirs = read_model(path), GGUFReader(path)
    expected = {key: field for key, field in theirs.fields.items() if not key.startswith(("GGUF.", "split."))}
    assert sorted(ours.fields) == sorted(expected)
    for key, field in expected.items():
        value, read = field.contents(), ours.fields[key]
        assert read.value == value and type(read.value) is type(value), key
        if isinstance(value, list):
            assert [type(item) for item in read.value] == [type(item) for item in value], key
        assert read.value_type == field.types[0], key
        if field.types[0] != GGUFValueType.ARRAY:
            assert read.sub_type is None, key
        elif len(field.types) > 1:  # of an empty array the gguf package keeps no item type; the scanner does
            assert read.sub_type == field.types[1], key
    assert [(tensor.name, tensor.shape, tensor.ggml_type, tensor.n_bytes, tensor.offset) for tensor in ours.tensors] \
        == [(tensor.name, tuple(int(dim) for dim in tensor.shape), int(tensor.tensor_type), int(tensor.n_bytes),
             int(tensor.data_offset)) for tensor in theirs.tensors]
    assert ours.alignment == theirs.alignment


def write_shards(source: str, output: str, tensors_per_shard: int) -> None:
    """Re-write a model as a multi-file GGUF (…-0000k-of-0000n.gguf) with gguf's own writer."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    model = read_model(source)
    writer = GGUFWriter(output, model.architecture, split_max_tensors=tensors_per_shard)
    for key, field in model.fields.items():
        if key != "general.architecture":
            sub_type = GGUFValueType(field.sub_type) if field.sub_type is not None else None
            writer.add_key_value(key, field.value, GGUFValueType(field.value_type), sub_type)
    for tensor in GGUFReader(source).tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
