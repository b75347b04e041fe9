"""``--cost-curve CURVE``: the emulated cost curve of the machines a huge model
runs on (stages.cost_curve says what emulation does), read from one of:

* ``SETUP.toml@MS`` (e.g. ``benchmarks/setups/llama-405b-two-machines.toml@40``):
  an ``orchestrate plan`` setup's roofline, each stage's pass of n = 1..64
  tokens at the setup's boundaries (or equal block counts), scaled so that
  the slowest stage's one-token pass takes MS milliseconds; its KV reads
  per position of context, and its draft model's step, scaled alike;
* ``device-check.json``: a device check's t(n) (benchmarks.device_check),
  measured on the whole model, each of n stages taking 1/n of it;
* ``CURVE.json``, written by hand::

    {"name": "flat 40 ms",
     "stages": [{"tokens": [1, 64], "ms": [40, 44], "context_ms": 0.0}],
     "draft_ms": 2.0}

  one entry in ``stages`` for every stage, or one for all; ``"whole"`` in
  its place for the whole model's curve, shared out as a device check's.

Every problem is one line naming the file and the field. Pure Python.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

from orchestrator.planning.costs import CurveMachine, Machine
from orchestrator.planning.inputs import PlanError, Setup
from orchestrator.planning.loaders import load_setup
from stages.cost_curve import BatchCurve, CostCurve, StageCurve

# a roofline's kink lies anywhere: every width of a pass up to 64, then wider passes (an offloading machine's
# kink lies near a thousand tokens: SpecExec's regime) up to what one llama.cpp batch holds
ROOFLINE_SIZES = tuple(range(1, 65)) + (96, 128, 192, 256, 384, 512)


def load_cost_curve(spec: str) -> CostCurve:
    """The curve ``spec`` names (module docstring); PlanError when it cannot be read."""
    setup_path, at, milliseconds = spec.rpartition("@")
    if at:
        return roofline_curve(setup_path, _milliseconds(spec, milliseconds))
    path = Path(spec)
    try:
        document = json.loads(path.read_text())
    except OSError as error:
        raise PlanError(f"{spec}: {error.strerror or error}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise PlanError(f"{spec}: not JSON ({error}); a curve is a JSON file or SETUP.toml@MS") from None
    if not isinstance(document, dict):
        raise PlanError(f"{spec}: a cost curve is a JSON object")
    if "cost_curve" in document:  # a device check's result
        return _device_check_curve(document, spec)
    return _curve_file(document, spec)


def _milliseconds(spec: str, text: str) -> float:
    try:
        value = float(text.removesuffix("ms"))
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise PlanError(f"{spec}: after @ comes the one-token time in milliseconds, e.g. @40")
    return value


def roofline_curve(setup_path: str, milliseconds: float) -> CostCurve:
    """A setup's roofline, scaled so its slowest stage's one-token pass takes ``milliseconds``."""
    setup = load_setup(setup_path)
    count, blocks = len(setup.machines), setup.model.blocks
    starts = setup.starts or tuple(round(index * blocks / count) for index in range(count))
    costs = setup.costs(starts)
    slowest = max(costs.stage_seconds(stage, 1) for stage in range(count))
    scale = milliseconds / 1e3 / slowest
    curves = []
    for stage, machine in enumerate(setup.machines):
        first, end = costs.stage_range(stage)
        batch = BatchCurve(ROOFLINE_SIZES, tuple(costs.stage_seconds(stage, n) * scale for n in ROOFLINE_SIZES))
        # the KV cache of one position, read once per pass by a memory-bound machine
        kv_bytes = (end - first) * setup.model.kv_bytes_per_token
        context = kv_bytes / machine.bytes_per_second * scale if isinstance(machine, Machine) else 0.0
        curves.append(StageCurve(batch, context))
    draft = setup.draft_seconds[0] * scale if setup.draft_seconds else 0.0
    return CostCurve(f"{Path(setup_path).stem} at {milliseconds:g} ms", stages=tuple(curves), draft_seconds=draft)


def _device_check_curve(document: dict, spec: str) -> CostCurve:
    curve = document["cost_curve"]
    try:
        batch = BatchCurve(tuple(int(size) for size in curve["sizes"]), tuple(float(value) for value in curve["seconds"]))
    except (KeyError, TypeError, ValueError) as error:
        raise PlanError(f"{spec}: cost_curve needs sizes and seconds, one each, sizes increasing ({error})") from None
    devices = document.get("backend", {}).get("devices") if isinstance(document.get("backend"), dict) else None
    where = f" on {', '.join(devices)}" if isinstance(devices, list) and devices else ""
    return CostCurve(f"device check {Path(spec).name}{where}", whole=StageCurve(batch))


def _curve_file(document: dict, spec: str) -> CostCurve:
    unknown = sorted(set(document) - {"name", "stages", "whole", "draft_ms"})
    if unknown:
        raise PlanError(f"{spec}: unknown key {unknown[0]!r} (known: draft_ms, name, stages, whole)")
    if ("stages" in document) == ("whole" in document):
        raise PlanError(f"{spec}: give \"stages\" (a curve per stage, or one for all) or \"whole\", one of the two")
    name = document.get("name", Path(spec).stem)
    draft = _number(document, "draft_ms", spec, 0.0) / 1e3
    if "whole" in document:
        return CostCurve(str(name), whole=_stage_curve(document["whole"], f"{spec}: whole"), draft_seconds=draft)
    stages = document["stages"]
    if not isinstance(stages, list) or not stages:
        raise PlanError(f"{spec}: stages must be a non-empty list of curves")
    curves = tuple(_stage_curve(entry, f"{spec}: stages[{index}]") for index, entry in enumerate(stages))
    return CostCurve(str(name), stages=curves, draft_seconds=draft)


def _stage_curve(entry, where: str) -> StageCurve:
    if not isinstance(entry, dict):
        raise PlanError(f"{where} must be an object with tokens and ms")
    unknown = sorted(set(entry) - {"tokens", "ms", "context_ms"})
    if unknown:
        raise PlanError(f"{where}: unknown key {unknown[0]!r} (known: context_ms, ms, tokens)")
    tokens, milliseconds = entry.get("tokens"), entry.get("ms")
    if not isinstance(tokens, list) or not isinstance(milliseconds, list):
        raise PlanError(f"{where}: tokens and ms must be lists of numbers")
    if not all(isinstance(value, int) and not isinstance(value, bool) and value >= 1 for value in tokens):
        raise PlanError(f"{where}: tokens must be whole numbers of at least 1")
    if not all(_is_number(value) and value >= 0 for value in milliseconds):
        raise PlanError(f"{where}: ms must be numbers of at least 0")
    try:
        batch = BatchCurve(tuple(tokens), tuple(value / 1e3 for value in milliseconds))
    except ValueError:
        raise PlanError(f"{where}: tokens must increase, with one ms value each") from None
    return StageCurve(batch, _number(entry, "context_ms", where, 0.0) / 1e3)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _number(table: dict, key: str, where: str, default: float) -> float:
    value = table.get(key, default)
    if not _is_number(value) or value < 0:
        raise PlanError(f"{where}: {key} must be a number of at least 0")
    return float(value)


def under_curve(setup: Setup, curve: CostCurve, *, draft: bool = False) -> Setup:
    """``setup`` with every stage held to ``curve`` (its machines' memory
    kept), as ``--cost-curve`` holds the real stages; draft: a draft model's
    step from the curve too (prompt lookup keeps its own, microseconds)."""
    count = len(setup.machines)
    machines = [CurveMachine(machine.name, machine.memory_bytes, curve.stage(index, count), 0)
                for index, machine in enumerate(setup.machines)]
    draft_seconds = [curve.draft_seconds] * count if draft and setup.draft_seconds is not None else setup.draft_seconds
    return replace(setup, machines=machines, draft_seconds=draft_seconds)
