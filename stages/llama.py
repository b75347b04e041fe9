"""llama.cpp (llama-cpp-python), imported here for the whole of ``stages``:
where it cannot load, the command says so in one line (``LlamaCppMissing``,
a SpecpipeError) naming the library, the reason and what to install,
instead of a traceback from the first module that imports it."""

from __future__ import annotations

from stages.errors import SpecpipeError


class LlamaCppMissing(SpecpipeError):
    """llama-cpp-python, or a library of its build, cannot be loaded."""


def missing(error: BaseException) -> LlamaCppMissing:
    """The one-line error for a llama.cpp that failed to load with ``error``."""
    return LlamaCppMissing(
        f"llama.cpp (llama-cpp-python) could not be loaded: {type(error).__name__}: {error}; "
        "`make install` builds it into .venv (a C/C++ toolchain and CMake needed), "
        "or `pip install llama-cpp-python` into this Python")


try:
    import llama_cpp  # noqa: F401  (re-exported: `from stages.llama import llama_cpp`)
except (ImportError, OSError, RuntimeError) as failure:  # a missing package, library or symbol
    raise missing(failure) from None
