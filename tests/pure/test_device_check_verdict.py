"""What the device check counts as a failure (benchmarks.device_check.failures), and the
random-weight model it runs on (benchmarks.random_model), read as the gguf package reads it."""

from __future__ import annotations

import pytest

from benchmarks.device_check import failures
from benchmarks.random_model import SHAPES, ModelShape, ModelShapeError, check_shape, vocabulary, write_random_model
from support.gguf_reading import assert_read_as_the_gguf_package_reads


def result(backend="cpu", split=True, lossless=True, batch=True, fraction=1.0) -> dict:
    return {"backend": {"backend": backend}, "agreement": {"fraction": fraction},
            "exactness": {"split_exact": split, "split_difference": None if split else "pass 3 row 0 logit 9",
                          "lossless": lossless, "lossless_violation": None if lossless else "window at 40",
                          "batch_invariant": batch, "batch_difference": None if batch else "pass at 12 row 2"}}


def test_split_exact_and_lossless_fail_on_every_backend():
    for backend in ("cpu", "cuda", "vulkan"):
        assert failures(result(backend, split=False)) == ["split-exact: pass 3 row 0 logit 9"]
        assert failures(result(backend, lossless=False)) == ["lossless: window at 40"]


def test_batch_invariance_and_agreement_are_promised_on_the_cpu_build_only():
    assert failures(result("cpu", batch=False)) == ["batch-invariant: pass at 12 row 2"]
    assert failures(result("cpu", fraction=0.75)) == ["agreement 0.75 on the CPU build, where it is promised"]
    assert failures(result("cuda", batch=False, fraction=0.75)) == []
    assert failures(result()) == []


def test_the_vocabulary_has_control_byte_and_filler_tokens_of_the_size_asked():
    pieces, scores, types = vocabulary(600)
    assert len(pieces) == len(scores) == len(types) == 600 == len(set(pieces))
    assert pieces[:3] == ["<unk>", "<s>", "</s>"] and pieces[3] == "<0x00>" and pieces[258] == "<0xFF>"
    assert types[:4] == [2, 3, 3, 6] and set(types[259:]) == {1}


@pytest.mark.parametrize("shape, complaint", [
    (ModelShape(blocks=1, width=100, ffn=256, heads=4, kv_heads=2, vocab=300), "not a multiple of 32"),
    (ModelShape(blocks=1, width=256, ffn=256, heads=3, kv_heads=1, vocab=300), "do not divide"),
    (ModelShape(blocks=1, width=256, ffn=256, heads=4, kv_heads=2, vocab=100), "at least 259"),
])
def test_a_shape_llama_cpp_could_not_load_is_refused(shape, complaint):
    with pytest.raises(ModelShapeError, match=complaint):
        check_shape(shape)


def test_the_random_model_is_a_gguf_file_whose_size_is_its_matrices(tmp_path):
    path = write_random_model(tmp_path / "tiny.gguf", SHAPES["tiny"])
    assert not (tmp_path / "tiny.gguf.partial").exists()
    assert_read_as_the_gguf_package_reads(path)
    matrices = SHAPES["tiny"].file_bytes
    assert matrices < path.stat().st_size < matrices * 1.05


def test_the_bundle_keeps_what_a_cuda_build_reads_and_drops_the_rest():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("device_bundle", Path(__file__).parents[2] / "tools" / "device_bundle.py")
    bundle = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bundle)
    kept = ["CMakeLists.txt", "llama_cpp/llama.py", "vendor/llama.cpp/CMakeLists.txt", "vendor/llama.cpp/src/llama.cpp",
            "vendor/llama.cpp/common/common.cpp", "vendor/llama.cpp/vendor/nlohmann/json.hpp",
            "vendor/llama.cpp/ggml/src/ggml.c", "vendor/llama.cpp/ggml/src/ggml-alloc.c",
            "vendor/llama.cpp/ggml/src/ggml-backend-impl.h", "vendor/llama.cpp/ggml/src/ggml-cuda/mmq.cu",
            "vendor/llama.cpp/ggml/src/ggml-cuda", "vendor/llama.cpp/ggml/src/ggml-cpu/ggml-cpu.c"]
    dropped = [".git/HEAD", "docs/index.md", "tests/test_llama.py", "vendor/llama.cpp/models/ggml-vocab-llama-bpe.gguf",
               "vendor/llama.cpp/docs/build.md", "vendor/llama.cpp/tools/server/server.cpp",
               "vendor/llama.cpp/ggml/src/ggml-vulkan", "vendor/llama.cpp/ggml/src/ggml-vulkan/ggml-vulkan.cpp",
               "vendor/llama.cpp/ggml/src/ggml-sycl/ggml-sycl.cpp", "vendor/llama.cpp/examples/simple/simple.cpp"]
    assert [path for path in kept if bundle.dropped(path)] == []
    assert [path for path in dropped if not bundle.dropped(path)] == []
