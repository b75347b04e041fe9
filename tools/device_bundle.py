"""``python tools/device_bundle.py [FOLDER]``: what the device check carries to a GPU machine (``make device-bundle``).

The device machine (docs/backends.md "The device check") has CUDA's compiler,
CMake, ninja, scikit-build-core and numpy, but no network, no llama-cpp-python
and no gguf, and a call carries at most 64 MiB. FOLDER (default ``.device``,
git-ignored) gets:

* ``llama-cpp-python-VERSION-cuda-src.tar.gz``: llama-cpp-python's source from
  PyPI (217 MB unpacked, 77 MB packed), trimmed to what a CUDA build of the
  library reads: no git history, llama.cpp's vocabulary files, docs, tests,
  tools or examples, and no ggml backend but the CPU's and CUDA's;
* ``wheels/``: gguf and diskcache (llama-cpp-python's one dependency not there),
  pure Python.

Written to ``FOLDER.partial`` and renamed when complete.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path, PurePosixPath

LLAMA_VERSION = "0.3.36"
WHEELS = ("gguf==0.19.0", "diskcache==5.6.3")
DROPPED_TOP = {".git", ".github", "docker", "docs", "examples", "tests"}
DROPPED_LLAMA_CPP = {".github", "benches", "conversion", "docs", "examples", "gguf-py", "media", "models", "scripts",
                     "tests", "tools", "pocs", "grammars", "prompts", "requirements"}
KEPT_BACKENDS = {"ggml-cpu", "ggml-cuda"}


def dropped(relative: str) -> bool:
    """Whether a path of the unpacked source (below its top folder) is left out."""
    parts = PurePosixPath(relative).parts
    if not parts:
        return False
    if parts[0] in DROPPED_TOP:
        return True
    if parts[:2] != ("vendor", "llama.cpp") or len(parts) < 3:
        return False
    if parts[2] in DROPPED_LLAMA_CPP:
        return True
    in_backends = parts[2:4] == ("ggml", "src") and len(parts) > 4 and parts[4].startswith("ggml-")
    return in_backends and (Path(relative).suffix == "" or len(parts) > 5) and parts[4] not in KEPT_BACKENDS


def trimmed_source(python: str, into: Path) -> Path:
    with tempfile.TemporaryDirectory() as scratch:
        subprocess.run([python, "-m", "pip", "download", "--quiet", "--no-binary", ":all:", "--no-deps", "-d", scratch,
                        f"llama-cpp-python=={LLAMA_VERSION}"], check=True)
        top = f"llama_cpp_python-{LLAMA_VERSION}"
        output = into / f"llama-cpp-python-{LLAMA_VERSION}-cuda-src.tar.gz"
        with tarfile.open(Path(scratch) / f"{top}.tar.gz") as source, tarfile.open(output, "w:gz") as trimmed:
            for member in source.getmembers():
                relative = member.name[len(top) + 1:] if member.name.startswith(top + "/") else ""
                if dropped(relative):
                    continue
                trimmed.addfile(member, source.extractfile(member) if member.isfile() else None)
    return output


def main(folder: str = ".device") -> int:
    final = Path(folder)
    partial = final.with_name(final.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    (partial / "wheels").mkdir(parents=True)
    source = trimmed_source(sys.executable, partial)
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "-d", str(partial / "wheels"), *WHEELS], check=True)
    shutil.rmtree(final, ignore_errors=True)
    partial.rename(final)
    size = sum(path.stat().st_size for path in final.rglob("*") if path.is_file())
    print(f"{final}: {size / 2**20:.1f} MiB ({source.name} and {len(WHEELS)} wheels)")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
