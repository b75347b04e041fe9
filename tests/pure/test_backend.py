"""The build's backend named from ggml's devices, and llama.cpp's count of offloaded layers
(the devices of this machine's own build: tests/model/test_stage_server.py)."""

import pytest

from stages.backend import ComputeBackend, Device, StageCompute, offloaded_layers

GiB = 1024**3
CPU = Device("CPU", "AMD EPYC", "cpu", "CPU", 20 * GiB, 24 * GiB)
H200 = Device("CUDA0", "NVIDIA H200", "gpu", "CUDA", 130 * GiB, 139 * GiB)
LLVMPIPE = Device("Vulkan0", "llvmpipe (LLVM 15.0.6, 256 bits)", "gpu", "Vulkan", 4 * GiB, 8 * GiB)
APPLE = Device("Metal", "Apple M2 Ultra", "igpu", "Metal", 150 * GiB, 192 * GiB)
BLAS = Device("BLAS", "OpenBLAS", "accel", "BLAS", 0, 0)


@pytest.mark.parametrize("devices, name", [
    ((CPU,), "cpu"),
    ((CPU, BLAS), "cpu"),  # an accelerator beside the CPU takes no layers
    ((H200, CPU), "cuda"),
    ((H200, H200, CPU), "cuda"),
    ((LLVMPIPE, CPU), "vulkan"),
    ((APPLE, CPU, BLAS), "metal"),
    ((H200, LLVMPIPE, CPU), "cuda+vulkan"),
])
def test_the_backend_is_named_by_the_devices_that_take_layers(devices, name):
    backend = ComputeBackend.of(devices)
    assert backend.name == name and backend.offloads == (name != "cpu")


def test_offload_memory_counts_the_gpus_only():
    assert ComputeBackend.of((CPU,)).offload_memory() == (0, 0)
    assert ComputeBackend.of((H200, H200, CPU)).offload_memory() == (260 * GiB, 278 * GiB)
    assert ComputeBackend.of((APPLE, CPU)).offload_memory() == (150 * GiB, 192 * GiB)


@pytest.mark.parametrize("n_gpu_layers, offloaded", [(-1, 16), (0, 0), (5, 5), (15, 15), (16, 16), (999, 16)])
def test_layers_are_offloaded_as_llama_cpp_counts_them(n_gpu_layers, offloaded):
    """15 blocks and the output layer: 16 layers, all of them with -1."""
    assert offloaded_layers(ComputeBackend.of((H200, CPU)), n_gpu_layers, 15) == offloaded
    assert offloaded_layers(ComputeBackend.of((CPU,)), n_gpu_layers, 15) == 0  # a CPU build offloads nothing


def test_a_stage_reports_its_backend_devices_and_offload():
    compute = StageCompute.of(ComputeBackend.of((H200, CPU)), -1, 63)
    assert compute.record() == {"backend": "cuda", "devices": ["CUDA0: NVIDIA H200", "CPU: AMD EPYC"],
                                "offloaded_layers": 64, "offloadable_layers": 64}
    assert StageCompute.of(ComputeBackend.of((CPU,)), -1, 15).record()["offloaded_layers"] == 0
