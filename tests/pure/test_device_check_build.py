"""The device check's build (tools/device_check.sh) keeps off the kernels every
build keeps off (the Makefile: AMX on x86, llamafile's tinyBLAS), and its run
keeps a native crash's Python stacks (the first run printed only
"Segmentation fault")."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_device_check_builds_with_the_makefiles_kernels_off_and_runs_with_faulthandler():
    makefile = (ROOT / "Makefile").read_text()
    script = (ROOT / "tools" / "device_check.sh").read_text()
    no_amx = re.search(r"^LLAMA_CFLAGS\s*:=\s*(-mno-amx.*)$", makefile, re.MULTILINE).group(1).split()
    assert len(no_amx) == 3 and "-DGGML_LLAMAFILE=OFF" in makefile and "-DGGML_LLAMAFILE=OFF" in script
    building = re.search(r"^  x86_64\|amd64\) NO_AMX=\"([^\"]*)\"", script, re.MULTILINE)
    assert building is not None and building.group(1).split() == no_amx
    assert "-DCMAKE_C_FLAGS='$NO_AMX' -DCMAKE_CXX_FLAGS='$NO_AMX'" in script
    assert re.search(r'"\$PYTHON" -X faulthandler -m benchmarks\.device_check', script)
