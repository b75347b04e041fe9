"""The emulated cost curve (stages.cost_curve) and --cost-curve's three sources
(orchestrator.planning.curves): a setup's roofline scaled to a one-token time,
a device check's t(n) shared out among the stages, a curve file; each bad
input one line naming the file and the field."""

import json

import pytest

from orchestrator.planning.costs import Machine
from orchestrator.planning.curves import load_cost_curve
from orchestrator.planning.inputs import PlanError
from orchestrator.planning.loaders import load_setup
from stages.cost_curve import BatchCurve, CostCurve, CostCurveError, StageCurve

SETUP = "benchmarks/setups/llama-405b-two-machines.toml"


def test_a_stage_curve_adds_its_context_term_and_a_release_costs_nothing():
    curve = StageCurve(BatchCurve((1, 9), (0.040, 0.080)), context_seconds=1e-5)
    assert curve.seconds(1, 0) == 0.040
    assert curve.seconds(5, 1000) == pytest.approx(0.060 + 0.010)
    assert curve.seconds(0, 1000) == 0.0


def test_per_stage_curves_must_match_the_pipeline_and_a_whole_models_curve_is_shared_out():
    one, two = StageCurve(BatchCurve((1,), (0.01,))), StageCurve(BatchCurve((1,), (0.02,)))
    per_stage = CostCurve("two", stages=(one, two))
    assert per_stage.stage(1, 2) is two
    with pytest.raises(CostCurveError, match=r"^the cost curve 'two' has 2 stages, the pipeline 3$"):
        per_stage.stage(0, 3)
    assert CostCurve("all", stages=(one,)).stage(2, 3) is one
    whole = CostCurve("gpu", whole=StageCurve(BatchCurve((1, 2), (0.030, 0.036)), 3e-6))
    third = whole.stage(0, 3)
    assert third.seconds(2, 100) == pytest.approx((0.036 + 3e-4) / 3)
    with pytest.raises(ValueError):
        CostCurve("neither")


def test_a_setups_roofline_is_scaled_so_its_slowest_one_token_pass_takes_the_given_time():
    curve = load_cost_curve(f"{SETUP}@40")
    assert curve.name == "llama-405b-two-machines at 40 ms"
    assert len(curve.stages) == 2
    assert max(stage.seconds(1, 0) for stage in curve.stages) == pytest.approx(0.040)
    setup = load_setup(SETUP)
    costs = setup.costs((0, 63))
    # the roofline's shape is kept: every width in the ratio the setup gives it
    for stage in range(2):
        for tokens in (1, 8, 16, 64):
            ratio = costs.stage_seconds(stage, tokens) / costs.stage_seconds(stage, 1)
            assert curve.stages[stage].seconds(tokens, 0) / curve.stages[stage].seconds(1, 0) == pytest.approx(ratio)
    # memory-bound below the kink: 8 tokens cost what one does on these machines
    assert curve.stages[0].seconds(8, 0) == pytest.approx(curve.stages[0].seconds(1, 0))
    scale = 0.040 / max(costs.stage_seconds(stage, 1) for stage in range(2))
    machine = setup.machines[0]
    assert isinstance(machine, Machine)
    assert curve.stages[0].context_seconds == pytest.approx(63 * setup.model.kv_bytes_per_token
                                                            / machine.bytes_per_second * scale)
    assert curve.draft_seconds == pytest.approx(setup.draft_seconds[0] * scale)
    assert load_cost_curve(f"{SETUP}@40ms").stages == curve.stages


def test_the_four_machine_setup_gives_four_stages_each_a_flat_one_token_pass_at_its_time():
    """benchmarks/setups/llama-405b-four-machines.toml@20 (the 4-stage regime,
    docs/measurements.md): a curve per stage, the slowest 20 ms a token and
    memory-bound below the kink, as the two-machine setup at @40."""
    curve = load_cost_curve("benchmarks/setups/llama-405b-four-machines.toml@20")
    assert len(curve.stages) == 4
    assert max(stage.seconds(1, 0) for stage in curve.stages) == pytest.approx(0.020)
    assert all(stage.seconds(8, 0) == pytest.approx(stage.seconds(1, 0)) for stage in curve.stages)


def test_a_device_checks_t_of_n_is_the_whole_models_curve(tmp_path):
    path = tmp_path / "device-check.json"
    path.write_text(json.dumps({"backend": {"devices": ["CUDA0: NVIDIA H200"]},
                                "cost_curve": {"sizes": [1, 8, 64], "seconds": [0.010, 0.011, 0.020]}}))
    curve = load_cost_curve(str(path))
    assert curve.name == "device check device-check.json on CUDA0: NVIDIA H200"
    assert curve.stage(1, 2).seconds(8, 0) == pytest.approx(0.0055)


def test_a_curve_file_gives_a_curve_per_stage_or_one_for_all(tmp_path):
    path = tmp_path / "flat.json"
    path.write_text(json.dumps({"name": "flat 40 ms", "draft_ms": 2,
                                "stages": [{"tokens": [1, 64], "ms": [40, 44], "context_ms": 0.001}]}))
    curve = load_cost_curve(str(path))
    assert (curve.name, curve.draft_seconds) == ("flat 40 ms", 0.002)
    assert curve.stage(1, 2).seconds(64, 1000) == pytest.approx(0.044 + 0.001)


@pytest.mark.parametrize("text, message", [
    ('{"stages": [{"tokens": [1], "ms": [1]}], "whole": {"tokens": [1], "ms": [1]}}',
     'give "stages" (a curve per stage, or one for all) or "whole", one of the two'),
    ('{"stages": []}', "stages must be a non-empty list of curves"),
    ('{"stages": [{"tokens": [1, 2], "ms": [1]}]}', "stages[0]: tokens must increase, with one ms value each"),
    ('{"stages": [{"tokens": [2, 1], "ms": [1, 2]}]}', "stages[0]: tokens must increase, with one ms value each"),
    ('{"stages": [{"tokens": [0], "ms": [1]}]}', "stages[0]: tokens must be whole numbers of at least 1"),
    ('{"stages": [{"tokens": [1], "ms": [-1]}]}', "stages[0]: ms must be numbers of at least 0"),
    ('{"stages": [{"tokens": [1], "ms": "fast"}]}', "stages[0]: tokens and ms must be lists of numbers"),
    ('{"stages": [{"tokens": [1], "ms": [1], "speed": 2}]}', "stages[0]: unknown key 'speed'"),
    ('{"stages": [{"tokens": [1], "ms": [1], "context_ms": -2}]}', "stages[0]: context_ms must be a number"),
    ('{"stages": [{"tokens": [1], "ms": [1]}], "draft_ms": "x"}', "draft_ms must be a number of at least 0"),
    ('{"curve": 1}', "unknown key 'curve'"),
    ('[1, 2]', "a cost curve is a JSON object"),
    ('not json', "not JSON"),
    ('{"cost_curve": {"sizes": [1, 2]}}', "cost_curve needs sizes and seconds"),
])
def test_each_bad_curve_file_is_one_line_naming_the_field(tmp_path, text, message):
    path = tmp_path / "curve.json"
    path.write_text(text)
    with pytest.raises(PlanError) as raised:
        load_cost_curve(str(path))
    assert message in str(raised.value) and str(path) in str(raised.value)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("spec, message", [
    (f"{SETUP}@0", "after @ comes the one-token time in milliseconds"),
    (f"{SETUP}@fast", "after @ comes the one-token time in milliseconds"),
    (f"{SETUP}@nan", "after @ comes the one-token time in milliseconds"),
    ("missing.toml@40", "missing.toml"),
    ("missing.json", "missing.json: No such file or directory"),
])
def test_a_bad_curve_spec_is_one_line(spec, message):
    with pytest.raises(PlanError, match=None) as raised:
        load_cost_curve(spec)
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_the_planner_under_a_curve_prices_every_stage_by_it_and_keeps_the_machines_memory():
    from orchestrator.planning.curves import under_curve

    setup = load_setup(SETUP)
    flat = CostCurve("flat", stages=(StageCurve(BatchCurve((1,), (0.040,))),), draft_seconds=0.002)
    emulated = under_curve(setup, flat, draft=True)
    costs = emulated.costs((0, 63))
    assert [costs.stage_seconds(stage, tokens) for stage in (0, 1) for tokens in (1, 64)] == [0.040] * 4
    assert [machine.memory_bytes for machine in emulated.machines] == [machine.memory_bytes for machine in setup.machines]
    assert emulated.draft_seconds == [0.002, 0.002]
    assert under_curve(setup, flat).draft_seconds == setup.draft_seconds


def test_a_bad_cost_curve_on_the_command_line_is_one_line_and_exit_1(tmp_path):
    from click.testing import CliRunner

    from orchestrator import cli

    bad = tmp_path / "curve.json"
    bad.write_text('{"stages": []}')
    for command in (["plan", SETUP], ["run"], ["bench", "--out", str(tmp_path / "out")]):
        result = CliRunner().invoke(cli.main, [*command, "--cost-curve", str(bad)])
        assert result.exit_code == 1, result.output
        assert result.stderr.strip().splitlines() == [f"error: {bad}: stages must be a non-empty list of curves"]
    assert not (tmp_path / "out").exists()
