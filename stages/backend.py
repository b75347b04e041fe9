"""What llama.cpp computes on here: its build's backend and devices.

``detect()`` reads ggml's device registry, the list llama.cpp itself offloads
to: llama-cpp-python binds none of its calls, so they are made through ctypes
on the libggml the package ships. A build for the CPU only (``make install``,
the default ``BACKEND=cpu``) has one device, the CPU; a CUDA, Metal or Vulkan
build (``make install BACKEND=cuda|metal|vulkan``) adds one per GPU it finds.

``ComputeBackend``, ``StageCompute`` and ``offloaded_layers`` are pure
(importing this module loads no llama.cpp): the records a stage reports
(``orchestrate run --json``, the service's ``/health``) and llama.cpp's rule
for how many layers go to a GPU.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass

# enum ggml_backend_dev_type (ggml-backend.h), in its order
DEVICE_KINDS = ("cpu", "gpu", "igpu", "accel", "meta")
OFFLOAD_KINDS = ("gpu", "igpu")  # the devices llama.cpp puts layers on (n_gpu_layers)


@dataclass(frozen=True)
class Device:
    """One device in ggml's registry.

    name: ggml's ("CPU", "CUDA0", "Vulkan0", "Metal"); description: the hardware
    ("NVIDIA H200", "llvmpipe (LLVM 15.0.6, 256 bits)"); kind: one of
    DEVICE_KINDS; registry: the backend that registered it ("CPU", "CUDA",
    "Vulkan", "Metal"); memory_free, memory_total: bytes, as the device reports."""

    name: str
    description: str
    kind: str
    registry: str
    memory_free: int
    memory_total: int


@dataclass(frozen=True)
class ComputeBackend:
    """The build's backend: ``name`` is "cpu" for a CPU-only build, else the
    offloading registries' names lower-cased and joined by "+" ("cuda", "vulkan")."""

    name: str
    devices: tuple[Device, ...]

    @classmethod
    def of(cls, devices: tuple[Device, ...]) -> ComputeBackend:
        offloading = sorted({device.registry.lower() for device in devices if device.kind in OFFLOAD_KINDS})
        return cls("+".join(offloading) or "cpu", devices)

    @property
    def offloads(self) -> bool:
        return self.name != "cpu"

    def offload_memory(self) -> tuple[int, int]:
        """(free, total) bytes of the devices layers are offloaded to; (0, 0) on the CPU."""
        devices = [device for device in self.devices if device.kind in OFFLOAD_KINDS]
        return sum(device.memory_free for device in devices), sum(device.memory_total for device in devices)


@dataclass(frozen=True)
class StageCompute:
    """Where a loaded stage computes: its build's backend ("cpu", "cuda", ...),
    the devices it found ("CPU: AMD EPYC"), and how many of its
    ``offloadable_layers`` (its blocks and the output layer, as llama.cpp
    counts them) are on a GPU."""

    backend: str
    devices: tuple[str, ...]
    offloaded_layers: int
    offloadable_layers: int

    @classmethod
    def of(cls, backend: ComputeBackend, n_gpu_layers: int, block_count: int) -> StageCompute:
        devices = tuple(f"{device.name}: {device.description}" for device in backend.devices)
        return cls(backend.name, devices, offloaded_layers(backend, n_gpu_layers, block_count), block_count + 1)

    def record(self) -> dict:
        return {"backend": self.backend, "devices": list(self.devices), "offloaded_layers": self.offloaded_layers,
                "offloadable_layers": self.offloadable_layers}


def offloaded_layers(backend: ComputeBackend, n_gpu_layers: int, block_count: int) -> int:
    """Layers llama.cpp puts on a GPU for a model of ``block_count`` blocks.

    As llama.cpp counts them (its load log's "offloaded N/M layers"): the
    blocks and the output layer, M = block_count + 1, offloaded from the last
    one back; n_gpu_layers < 0 means all of them. None without a GPU device."""
    if not backend.offloads:
        return 0
    layers = block_count + 1
    return layers if n_gpu_layers < 0 else min(n_gpu_layers, layers)


def loaded_library(name: str) -> ctypes.CDLL:
    """llama-cpp-python's library ``name`` ("libggml", "libggml-base"): the
    very copy libllama loaded. Its wheel holds copies, not links, of
    libNAME.so, .so.0 and .so.0.x.y, and libllama loads the .so.0 (its
    soname); loading another of the names would put a second copy of ggml in
    the process, with a registry and state of its own (on the CUDA build the
    first model load then crashed: docs/backends.md)."""
    from stages.llama import llama_cpp

    folder = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    names = [f"{name}.so.0", f"{name}.so", f"{name}.dylib"]  # the last two: builds that keep links, macOS
    path = next((os.path.join(folder, file) for file in names if os.path.exists(os.path.join(folder, file))), None)
    if path is None:
        raise OSError(f"{folder} has none of {', '.join(names)}")
    return ctypes.CDLL(path)


@functools.cache
def detect() -> ComputeBackend:
    """This process's llama.cpp backend (read once: the registry is fixed when ggml loads)."""
    from stages.llama import llama_cpp

    library = loaded_library("libggml")
    calls = (("ggml_backend_dev_count", ctypes.c_size_t, []),
             ("ggml_backend_dev_get", ctypes.c_void_p, [ctypes.c_size_t]),
             ("ggml_backend_dev_name", ctypes.c_char_p, [ctypes.c_void_p]),
             ("ggml_backend_dev_description", ctypes.c_char_p, [ctypes.c_void_p]),
             ("ggml_backend_dev_type", ctypes.c_int, [ctypes.c_void_p]),
             ("ggml_backend_dev_backend_reg", ctypes.c_void_p, [ctypes.c_void_p]),
             ("ggml_backend_reg_name", ctypes.c_char_p, [ctypes.c_void_p]),
             ("ggml_backend_dev_memory", None,
              [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]))
    for name, result, arguments in calls:
        function = getattr(library, name)
        function.restype, function.argtypes = result, arguments
    llama_cpp.llama_backend_init()  # loads the backends a dynamic build keeps in libraries of their own
    devices = []
    for index in range(library.ggml_backend_dev_count()):
        device = library.ggml_backend_dev_get(index)
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        library.ggml_backend_dev_memory(device, ctypes.byref(free), ctypes.byref(total))
        kind = library.ggml_backend_dev_type(device)
        devices.append(Device(
            name=library.ggml_backend_dev_name(device).decode(errors="replace"),
            description=(library.ggml_backend_dev_description(device) or b"").decode(errors="replace"),
            kind=DEVICE_KINDS[kind] if 0 <= kind < len(DEVICE_KINDS) else f"type {kind}",
            registry=library.ggml_backend_reg_name(library.ggml_backend_dev_backend_reg(device)).decode(errors="replace"),
            memory_free=free.value, memory_total=total.value,
        ))
    return ComputeBackend.of(tuple(devices))
