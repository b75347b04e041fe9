"""Setup files, profiles and GGUF headers read in-process (orchestrator.planning.loaders).

What `orchestrate plan` builds from a setup TOML, a profile JSON or a GGUF
header: every parsed value, the figures computed from them (checked against
the formulas of the module's docstring, worked out here), and the exact
one-line error for each kind of bad input. The committed profile
(benchmarks/results/profile.json) and the shipped 405B setup are read as
users read them; other inputs are small files written to tmp_path.
"""

from __future__ import annotations

import copy
import json
import tomllib
from pathlib import Path

import gguf
import numpy as np
import pytest

from orchestrator.planning.costs import BatchCurve, Link, Machine, MeasuredMachine, ModelShape, Software
from orchestrator.planning.inputs import PlanError
from orchestrator.planning.loaders import (
    DEFAULT_SOFTWARE,
    PROFILE_KEYS,
    load_setup,
    measured_machine,
    measured_software,
    model_shape_of_gguf,
    read_profile,
    setup_from_profile,
)
from orchestrator.planning.simulation import DraftBehaviour

ROOT = Path(__file__).parents[2]
PROFILE = ROOT / "benchmarks" / "results" / "profile.json"
SETUP_405B = ROOT / "benchmarks" / "setups" / "llama-405b-two-machines.toml"

MODEL = """
[model]
name = "tiny"
blocks = 4
width = 16
vocab = 128
parameters = 1e6
bits_per_weight = 8
kv_width = 8
"""
MACHINE = """
[[machines]]
memory_gb = 10
bandwidth_gb_per_s = 100
compute_tflops = 2
"""
LINK = """
[[links]]
latency_ms = 1
bandwidth_gbit_per_s = 1
"""


def write(tmp_path: Path, text: str, name: str = "setup.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def committed_profile() -> dict:
    return json.loads(PROFILE.read_text())


def load_error(path: Path) -> str:
    with pytest.raises(PlanError) as caught:
        load_setup(path)
    return str(caught.value)


# --- read_profile -------------------------------------------------------------------------------------------

def test_read_profile_returns_the_committed_profile_as_written():
    assert read_profile(PROFILE) == committed_profile()
    assert read_profile(str(PROFILE)) == committed_profile()  # a str path too


def test_read_profile_of_a_missing_file_names_the_file_and_the_os_reason(tmp_path):
    path = tmp_path / "absent.json"
    with pytest.raises(PlanError) as caught:
        read_profile(path)
    assert str(caught.value) == f"{path}: No such file or directory"


@pytest.mark.parametrize("text, reason", [
    ("[1, 2", "Expecting ',' delimiter at line 1"),
    ("{\n\n[", "Expecting property name enclosed in double quotes at line 3"),
])
def test_read_profile_of_broken_json_gives_the_parser_reason_and_line(tmp_path, text, reason):
    path = write(tmp_path, text, "profile.json")
    with pytest.raises(PlanError) as caught:
        read_profile(path)
    assert str(caught.value) == f"{path}: not JSON ({reason})"


@pytest.mark.parametrize("text", ['["specpipe-profile"]', '{"kind": "something else", "version": 1}', '{"version": 1}'])
def test_read_profile_refuses_json_that_is_not_a_specpipe_profile(tmp_path, text):
    path = write(tmp_path, text, "profile.json")
    with pytest.raises(PlanError) as caught:
        read_profile(path)
    assert str(caught.value) == f"{path}: not a profile written by `orchestrate profile`"


@pytest.mark.parametrize("version", [2, 0, None, "1"])
def test_read_profile_refuses_another_version_and_says_which(tmp_path, version):
    profile = committed_profile()
    profile["version"] = version
    path = write(tmp_path, json.dumps(profile), "profile.json")
    with pytest.raises(PlanError) as caught:
        read_profile(path)
    assert str(caught.value) == (f"{path}: profile version {version}, this planner reads 1; "
                                 "run `orchestrate profile` again")


def test_read_profile_without_a_version_says_version_none(tmp_path):
    path = write(tmp_path, '{"kind": "specpipe-profile"}', "profile.json")
    with pytest.raises(PlanError) as caught:
        read_profile(path)
    assert str(caught.value) == f"{path}: profile version None, this planner reads 1; run `orchestrate profile` again"


@pytest.mark.parametrize("key", PROFILE_KEYS)
def test_read_profile_names_the_missing_key_of_an_incomplete_profile(tmp_path, key):
    profile = committed_profile()
    del profile[key]
    path = write(tmp_path, json.dumps(profile), "profile.json")
    with pytest.raises(PlanError) as caught:
        read_profile(path)
    assert str(caught.value) == f"{path}: an incomplete or older profile (no {key}); run `orchestrate profile` again"


def test_read_profile_names_the_first_missing_key_in_profile_order(tmp_path):
    profile = committed_profile()
    del profile["drafter_call_seconds"], profile["stages"]
    path = write(tmp_path, json.dumps(profile), "profile.json")
    with pytest.raises(PlanError, match=r"\(no stages\)"):
        read_profile(path)


def test_profile_keys_are_the_fourteen_a_profile_writes():
    assert PROFILE_KEYS == ("machine", "batch_sizes", "stages", "model", "model_shape", "block_seconds",
                            "head_seconds", "fixed_seconds", "hop_seconds", "coordinator_pass_seconds",
                            "coordinator_row_seconds", "socket_bytes_per_second", "drafter_seconds_per_token",
                            "drafter_call_seconds")


# --- measured_machine, measured_software -------------------------------------------------------------------

def test_measured_machine_takes_host_memory_and_the_three_curves_from_the_profile():
    profile = committed_profile()
    machine = measured_machine(profile)
    sizes = tuple(profile["batch_sizes"])
    assert machine == MeasuredMachine(
        name="vm", memory_bytes=25276063744.0,
        block=BatchCurve(sizes, tuple(profile["block_seconds"])),
        head=BatchCurve(sizes, tuple(profile["head_seconds"])),
        fixed=BatchCurve(sizes, tuple(profile["fixed_seconds"])),
    )
    assert isinstance(machine.memory_bytes, float)
    assert machine.block.sizes == (1, 2, 4, 8, 16, 32, 64)
    # the last stage of 15 blocks at one token: fixed + 15 blocks + head, from the JSON numbers directly
    expected = profile["fixed_seconds"][0] + 15 * profile["block_seconds"][0] + profile["head_seconds"][0]
    shape = ModelShape(**{**profile["model_shape"], "block_bytes": tuple(profile["model_shape"]["block_bytes"])})
    assert machine.stage_seconds(shape, 15, 30, 1) == pytest.approx(expected)


def test_measured_software_maps_each_profile_time_to_its_field():
    profile = {"hop_seconds": 1.0, "coordinator_pass_seconds": 2.0, "coordinator_row_seconds": 3.0,
               "socket_bytes_per_second": 4.0, "drafter_call_seconds": 5.0}
    assert measured_software(profile) == Software(hop_seconds=1.0, coordinator_pass_seconds=2.0,
                                                  coordinator_row_seconds=3.0, local_bytes_per_second=4.0,
                                                  draft_call_seconds=5.0)


# --- setup_from_profile -------------------------------------------------------------------------------------

def test_setup_from_the_committed_profile_runs_its_split_on_its_machine():
    profile = committed_profile()
    setup = setup_from_profile(profile, behaviour=None)
    machine = measured_machine(profile)
    assert setup.model == ModelShape(**{**profile["model_shape"],
                                        "block_bytes": tuple(profile["model_shape"]["block_bytes"])})
    assert isinstance(setup.model.block_bytes, tuple) and setup.model.blocks == 30
    assert list(setup.machines) == [machine, machine]
    assert list(setup.links) == [None, None]
    assert setup.software == measured_software(profile)
    assert setup.behaviour is None
    ngram = profile["drafter_seconds_per_token"]["ngram"]
    assert list(setup.draft_seconds) == [ngram, ngram]
    assert setup.draft_bytes == 0
    assert (setup.context, setup.max_tokens) == (2048, 256)
    assert setup.starts == (0, 15)
    assert setup.one_host_parallel_stages == 2  # 2 cpus, 1 thread a stage


def test_setup_from_profile_passes_behaviour_context_and_max_tokens_through():
    behaviour = DraftBehaviour(0.8, 0.5, 0.3, 0.9)
    setup = setup_from_profile(committed_profile(), behaviour=behaviour, max_tokens=64, context=512)
    assert setup.behaviour == behaviour
    assert (setup.context, setup.max_tokens) == (512, 64)


@pytest.mark.parametrize("cpus, threads, parallel", [(2, 1, 2), (8, 3, 2), (1, 4, 1), (4, 4, 1), (16, 2, 8)])
def test_a_profiled_host_computes_cores_over_threads_stages_at_once_at_least_one(cpus, threads, parallel):
    profile = committed_profile()
    profile["machine"].update(cpus=cpus, threads_per_stage=threads)
    assert setup_from_profile(profile, behaviour=None).one_host_parallel_stages == parallel


def test_setup_from_profile_uses_the_named_drafters_timing():
    profile = committed_profile()
    profile["drafter_seconds_per_token"]["draft"] = 0.004
    setup = setup_from_profile(profile, behaviour=DraftBehaviour(0.7), drafter="draft")
    assert list(setup.draft_seconds) == [0.004, 0.004]


def test_setup_from_profile_without_the_drafters_timing_refuses_speculation():
    with pytest.raises(PlanError) as caught:
        setup_from_profile(committed_profile(), behaviour=DraftBehaviour(0.7), drafter="draft")
    assert str(caught.value) == "the profile has no draft drafter timing (profile with --draft for a draft model)"


def test_setup_from_profile_without_the_drafters_timing_plans_plain_with_zero_draft_cost():
    setup = setup_from_profile(committed_profile(), behaviour=None, drafter="draft")
    assert list(setup.draft_seconds) == [0.0, 0.0]


@pytest.mark.parametrize("damage, message", [
    (lambda profile: profile.pop("stages"), "a malformed profile (KeyError: 'stages'); run `orchestrate profile` again"),
    (lambda profile: profile.update(stages=None),
     "a malformed profile (TypeError: object of type 'NoneType' has no len()); run `orchestrate profile` again"),
    (lambda profile: profile.update(batch_sizes=[2, 1, 4, 8, 16, 32, 64]),
     "a malformed profile (ValueError: a batch curve needs increasing sizes, one time each); "
     "run `orchestrate profile` again"),
])
def test_a_malformed_profile_gets_one_line_naming_the_error(damage, message):
    profile = committed_profile()
    damage(profile)
    with pytest.raises(PlanError) as caught:
        setup_from_profile(profile, behaviour=None)
    assert str(caught.value) == message


# --- model_shape_of_gguf ------------------------------------------------------------------------------------

def write_gguf(path: Path, *, name: str | None = "Tiny", kv_heads=1, key_length: int | None = None,
               head: bool = True) -> Path:
    """A llama-architecture GGUF of 2 blocks, width 8, vocab 16, 2 heads; f32 tensors (4 bytes a weight)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_embedding_length(8)
    writer.add_head_count(2)
    if kv_heads is not None:
        writer.add_head_count_kv(kv_heads)
    if key_length is not None:
        writer.add_key_length(key_length)
    if name is not None:
        writer.add_name(name)
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), np.float32))  # 128 weights
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((8, 8), np.float32))  # block 0: 64 weights
    writer.add_tensor("blk.1.attn_q.weight", np.zeros((6, 8), np.float32))  # block 1: 48 + 40 weights
    writer.add_tensor("blk.1.ffn_up.weight", np.zeros((5, 8), np.float32))
    writer.add_tensor("output_norm.weight", np.zeros(8, np.float32))  # neither a block nor the head
    if head:
        writer.add_tensor("output.weight", np.zeros((16, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_model_shape_of_gguf_sums_each_blocks_tensors_and_reads_width_vocab_and_kv(tmp_path):
    shape = model_shape_of_gguf(write_gguf(tmp_path / "tiny.gguf"))
    assert shape == ModelShape(
        name="Tiny", blocks=2, width=8, vocab=16,
        block_bytes=(64 * 4, 88 * 4), head_bytes=128 * 4, embedding_bytes=128 * 4,
        block_parameters=88,  # the largest block, summed over its tensors
        head_parameters=8 * 16,
        kv_bytes_per_token=2 * 1 * (8 // 2) * 2,  # key and value, 1 KV head of width 8 / 2 heads, 2 bytes
    )


def test_model_shape_of_a_tied_gguf_has_no_separate_head_bytes(tmp_path):
    shape = model_shape_of_gguf(write_gguf(tmp_path / "tied.gguf", head=False))
    assert shape.head_bytes == 0 and shape.embedding_bytes == 512
    assert shape.head_parameters == 128  # the head still computes vocab x width


def test_model_shape_of_gguf_takes_the_largest_of_per_layer_kv_heads_and_an_explicit_key_length(tmp_path):
    shape = model_shape_of_gguf(write_gguf(tmp_path / "kv.gguf", kv_heads=[1, 3, 2], key_length=6))
    assert shape.kv_bytes_per_token == 2 * 3 * 6 * 2


def test_model_shape_of_gguf_without_kv_heads_uses_the_attention_heads(tmp_path):
    shape = model_shape_of_gguf(write_gguf(tmp_path / "mha.gguf", kv_heads=None))
    assert shape.kv_bytes_per_token == 2 * 2 * 4 * 2


def test_model_shape_of_an_unnamed_gguf_is_named_after_its_file(tmp_path):
    assert model_shape_of_gguf(write_gguf(tmp_path / "anonymous.gguf", name=None)).name == "anonymous.gguf"


def test_a_setup_file_can_name_a_gguf_beside_it(tmp_path):
    write_gguf(tmp_path / "tiny.gguf")
    path = write(tmp_path, 'context = 16\n[model]\ngguf = "tiny.gguf"\n' + MACHINE)
    assert load_setup(path).model == model_shape_of_gguf(tmp_path / "tiny.gguf")


# --- load_setup: the shipped setup --------------------------------------------------------------------------

def test_the_shipped_405b_setup_parses_to_its_stated_numbers():
    setup = load_setup(SETUP_405B)
    assert setup.model == ModelShape.from_parameters(
        name="Llama 3.1 405B, 4.5 bits per weight", blocks=126, width=16384, vocab=128256, parameters=405.9e9,
        bits_per_weight=4.5, kv_heads_width=1024)
    machine = Machine(name="machine-a", memory_bytes=192e9, bytes_per_second=800e9 * 0.7,
                      flops_per_second=27e12 * 0.7, pass_overhead_seconds=0.002)
    assert list(setup.machines) == [machine, Machine(**{**machine.__dict__, "name": "machine-b"})]
    assert list(setup.links) == [Link(0.0001, 10e9 / 8)] * 2  # one entry serves both
    assert setup.software == DEFAULT_SOFTWARE
    assert setup.behaviour == DraftBehaviour(0.7, 1.0, None, 1.0)
    draft_bytes = int(1.24e9 * 4.5 / 8)
    assert setup.draft_bytes == draft_bytes
    # the roofline of one draft token: the weights' reads dominate 2 flops a weight
    one_token = 0.002 + max(draft_bytes / (800e9 * 0.7), 2 * 1.24e9 / (27e12 * 0.7))
    assert setup.draft_seconds == pytest.approx([one_token, one_token])
    assert (setup.max_tokens, setup.context, setup.starts) == (256, 8192, None)


def test_default_software_is_this_projects_rounded_up_costs():
    assert DEFAULT_SOFTWARE == Software(hop_seconds=500e-6, coordinator_pass_seconds=20e-6,
                                        coordinator_row_seconds=10e-6, draft_call_seconds=300e-6)


# --- load_setup: parsed values and defaults -----------------------------------------------------------------

def test_a_minimal_setup_takes_every_default(tmp_path):
    setup = load_setup(write(tmp_path, MODEL + MACHINE))
    assert setup.model == ModelShape.from_parameters(name="tiny", blocks=4, width=16, vocab=128, parameters=1e6,
                                                     bits_per_weight=8, kv_heads_width=8)
    assert list(setup.machines) == [Machine("machine-0", 10e9, 100e9, 2e12, 0.0)]
    assert list(setup.links) == []
    assert setup.software == DEFAULT_SOFTWARE
    assert (setup.behaviour, setup.draft_seconds, setup.draft_bytes) == (None, None, 0)
    assert (setup.max_tokens, setup.context, setup.starts) == (256, 4096, None)
    assert setup.one_host_parallel_stages is None


def test_an_unnamed_model_is_called_model(tmp_path):
    setup = load_setup(write(tmp_path, MODEL.replace('name = "tiny"\n', "") + MACHINE))
    assert setup.model.name == "model"


def test_machines_scale_units_and_efficiency_and_default_names_by_index(tmp_path):
    text = MODEL + """
[[machines]]
name = "first"
memory_gb = 1.5
bandwidth_gb_per_s = 200
compute_tflops = 3
efficiency = 0.5
pass_overhead_ms = 4

[[machines]]
memory_gb = 2
bandwidth_gb_per_s = 10
compute_tflops = 0.25
pass_overhead_ms = 0

[[links]]
latency_ms = 2
bandwidth_gbit_per_s = 8

[[links]]
latency_ms = 0
bandwidth_gbit_per_s = 16
"""
    setup = load_setup(write(tmp_path, text))
    assert list(setup.machines) == [
        Machine("first", 1.5e9, 200e9 * 0.5, 3e12 * 0.5, 0.004),
        Machine("machine-1", 2e9, 10e9, 0.25e12, 0.0),
    ]
    assert all(isinstance(machine.memory_bytes, float) for machine in setup.machines)
    assert list(setup.links) == [Link(0.002, 1e9), Link(0.0, 2e9)]


def test_one_link_serves_every_machine(tmp_path):
    text = MODEL + MACHINE * 3 + "[[links]]\nlatency_ms = 1\nbandwidth_gbit_per_s = 80\n"
    assert list(load_setup(write(tmp_path, text)).links) == [Link(0.001, 10e9)] * 3


def test_one_machine_with_one_link_keeps_it(tmp_path):
    text = MODEL + MACHINE + "[[links]]\nlatency_ms = 1\nbandwidth_gbit_per_s = 80\n"
    assert list(load_setup(write(tmp_path, text)).links) == [Link(0.001, 10e9)]


def test_a_software_table_is_read_in_microseconds(tmp_path):
    text = MODEL + MACHINE + "[software]\nhop_us = 250\ncoordinator_pass_us = 30\ncoordinator_row_us = 4\n" \
                             "draft_call_us = 100\n"
    assert load_setup(write(tmp_path, text)).software == Software(250e-6, 30e-6, 4e-6, draft_call_seconds=100e-6)


def test_software_and_a_machine_can_come_from_a_profile_beside_the_setup(tmp_path):
    (tmp_path / "measured.json").write_text(PROFILE.read_text())
    text = MODEL + '[[machines]]\nprofile = "measured.json"\n[software]\nprofile = "measured.json"\n'
    setup = load_setup(write(tmp_path, text))
    assert setup.software == measured_software(committed_profile())
    assert list(setup.machines) == [measured_machine(committed_profile())]


def test_a_draft_with_its_time_per_token_and_bytes(tmp_path):
    text = MODEL + MACHINE * 2 + """
[[links]]
latency_ms = 1
bandwidth_gbit_per_s = 1

[draft]
acceptance = 0.7
first_acceptance = 0.4
availability = 0.5
continuation = 0.9
seconds_per_token = 0.003
bytes = 12345
"""
    setup = load_setup(write(tmp_path, text))
    assert setup.behaviour == DraftBehaviour(0.7, 0.5, 0.4, 0.9)
    assert list(setup.draft_seconds) == [0.003, 0.003]
    assert setup.draft_bytes == 12345


def test_a_draft_with_its_time_per_token_and_no_bytes_takes_no_memory(tmp_path):
    text = MODEL + MACHINE + "[draft]\nacceptance = 0.6\nseconds_per_token = 0.001\n"
    setup = load_setup(write(tmp_path, text))
    assert setup.behaviour == DraftBehaviour(0.6, 1.0, None, 1.0)
    assert setup.behaviour.first_acceptance is None
    assert (list(setup.draft_seconds), setup.draft_bytes) == ([0.001], 0)


def test_a_draft_model_by_size_is_priced_on_each_machines_roofline(tmp_path):
    text = MODEL + """
[[machines]]
memory_gb = 10
bandwidth_gb_per_s = 100
compute_tflops = 2
pass_overhead_ms = 1

[[machines]]
memory_gb = 10
bandwidth_gb_per_s = 1000
compute_tflops = 0.001

[[links]]
latency_ms = 1
bandwidth_gbit_per_s = 1

[draft]
acceptance = 0.5
parameters = 2e8
bits_per_weight = 4
"""
    setup = load_setup(write(tmp_path, text))
    draft_bytes = int(2e8 * 4 / 8)
    assert setup.draft_bytes == draft_bytes == 100_000_000
    # machine 0: bandwidth-bound (1 ms of reads), plus 1 ms overhead; machine 1: compute-bound (0.4 s)
    assert setup.draft_seconds == pytest.approx([0.001 + draft_bytes / 100e9, 2 * 2e8 / 1e9])


def test_a_draft_by_size_on_a_profiled_machine_needs_seconds_per_token(tmp_path):
    (tmp_path / "measured.json").write_text(PROFILE.read_text())
    text = MODEL + '[[machines]]\nprofile = "measured.json"\n[draft]\nacceptance = 0.5\nparameters = 2e8\n' \
                   'bits_per_weight = 4\n'
    assert load_error(write(tmp_path, text)) == "[draft]: give seconds_per_token for a profiled machine (vm)"


def test_fixed_boundaries_become_the_split(tmp_path):
    text = "boundaries = [1, 3]\n" + MODEL + MACHINE * 3 + LINK
    assert load_setup(write(tmp_path, text)).starts == (0, 1, 3)


def test_no_boundaries_for_one_machine_is_a_search(tmp_path):
    assert load_setup(write(tmp_path, "boundaries = []\n" + MODEL + MACHINE)).starts is None


def test_max_tokens_and_context_are_read_as_integers(tmp_path):
    setup = load_setup(write(tmp_path, "max_tokens = 2\ncontext = 100.0\n" + MODEL + MACHINE))
    assert (setup.max_tokens, setup.context) == (2, 100)
    assert isinstance(setup.context, int) and isinstance(setup.max_tokens, int)


# --- load_setup: one line for each bad input ----------------------------------------------------------------

def test_a_missing_setup_file_names_the_os_reason(tmp_path):
    path = tmp_path / "absent.toml"
    assert load_error(path) == f"{path}: No such file or directory"


def test_broken_toml_gives_the_parsers_reason(tmp_path):
    path = write(tmp_path, "not = [toml")
    with pytest.raises(tomllib.TOMLDecodeError) as parsed:
        tomllib.loads("not = [toml")
    assert load_error(path) == f"{path}: not TOML ({parsed.value})"


@pytest.mark.parametrize("text, message", [
    ("model = 3\n" + MACHINE, "model must be a table"),
    ("machines = 3\n" + MODEL, "machines must be an array of tables"),
    (MODEL + MACHINE + "[links]\nlatency_ms = 1\n", "links must be an array of tables"),
    ("draft = 0.5\n" + MODEL + MACHINE, "draft must be a table"),
    ("software = [1]\n" + MODEL + MACHINE, "software must be a table"),
    ("machines = [1]\n" + MODEL, "every [[machines]] and [[links]] entry must be a table"),
    ("links = [1]\n" + MODEL + MACHINE, "every [[machines]] and [[links]] entry must be a table"),
    (MACHINE, "missing 'model'"),
    (MODEL, "missing 'machines'"),
    ("machines = []\n" + MODEL, "no machines"),
    (MODEL + MACHINE * 3 + "[[links]]\nlatency_ms = 1\nbandwidth_gbit_per_s = 1\n" * 2,
     "3 machines need 3 links (machine i to i + 1, the last carrying the chosen tokens back to machine 0), or one for all"),
    (MODEL + MACHINE * 2, "2 machines need 2 links (machine i to i + 1, the last carrying the chosen tokens back to machine 0), "
                          "or one for all"),
    ("max_tokens = 1\n" + MODEL + MACHINE, "max_tokens must be at least 2"),
])
def test_a_bad_setup_file_gets_one_line_naming_the_file(tmp_path, text, message):
    path = write(tmp_path, text)
    assert load_error(path) == f"{path}: {message}"


@pytest.mark.parametrize("boundaries", ["[2]", "[0, 2]", "[2, 4]", "[3, 1]", "[2, 2]", "[1.0, 2]", "[true, 2]",
                                        "2", "[1, 2, 3]"])
def test_bad_boundaries_say_how_many_increasing_blocks_are_wanted(tmp_path, boundaries):
    path = write(tmp_path, f"boundaries = {boundaries}\n" + MODEL + MACHINE * 3 + LINK)
    assert load_error(path) == f"{path}: boundaries must be 2 increasing block numbers between 1 and 3"


@pytest.mark.parametrize("text, message", [
    (MODEL.replace("width = 16\n", ""), "[model]: width is missing"),
    (MODEL.replace("vocab = 128", "vocab = -1"), "[model]: vocab must be a finite number > 0, not -1"),
    (MODEL.replace("blocks = 4", 'blocks = "4"'), "[model]: blocks must be a finite number > 0, not '4'"),
    (MODEL.replace("kv_width = 8", "kv_width = true"), "[model]: kv_width must be a number >= 0, not True"),
    (MODEL.replace("parameters = 1e6\n", ""), "[model]: parameters is missing"),
    (MODEL.replace("bits_per_weight = 8", "bits_per_weight = -8"), "[model]: bits_per_weight must be a finite number > 0, not -8"),
    (MODEL.replace("blocks = 4", "blocks = 0"), "[model]: blocks must be a finite number > 0, not 0"),  # was a ZeroDivisionError
    (MODEL.replace("vocab = 128", "vocab = inf"), "[model]: vocab must be a finite number > 0, not inf"),
    (MODEL.replace("parameters = 1e6", "parameters = 4e3"),
     "[model]: 4000 parameters cannot hold two 128 x 16 tables and 4 blocks"),
])
def test_a_bad_model_table_gets_one_line_naming_the_key(tmp_path, text, message):
    assert load_error(write(tmp_path, text + MACHINE)) == message


@pytest.mark.parametrize("machines, message", [
    (MACHINE + MACHINE.replace("memory_gb = 10\n", ""), "machine 1: memory_gb is missing"),
    (MACHINE.replace("compute_tflops = 2", "compute_tflops = -0.5"),
     "machine 0: compute_tflops must be a finite number > 0, not -0.5"),
    (MACHINE + "efficiency = false\n", "machine 0: efficiency must be a finite number > 0, not False"),
    (MACHINE + "efficiency = 0\n", "machine 0: efficiency must be a finite number > 0, not 0"),  # was a ZeroDivisionError
    (MACHINE + 'pass_overhead_ms = "1"\n', "machine 0: pass_overhead_ms must be a number >= 0, not '1'"),
    (MACHINE.replace("bandwidth_gb_per_s = 100\n", ""), "machine 0: bandwidth_gb_per_s is missing"),
])
def test_a_bad_machine_gets_one_line_naming_its_index_and_key(tmp_path, machines, message):
    assert load_error(write(tmp_path, MODEL + machines)) == message


def test_zero_is_an_allowed_number(tmp_path):
    setup = load_setup(write(tmp_path, MODEL + MACHINE + "pass_overhead_ms = 0\n" + MACHINE
                             + "[[links]]\nlatency_ms = 0\nbandwidth_gbit_per_s = 1\n"))
    assert setup.machines[0].pass_overhead_seconds == 0.0
    assert list(setup.links) == [Link(0.0, 1e9 / 8)] * 2


@pytest.mark.parametrize("links, message", [
    ("[[links]]\nbandwidth_gbit_per_s = 1\n", "link 0: latency_ms is missing"),
    ("[[links]]\nlatency_ms = 1\nbandwidth_gbit_per_s = 1\n[[links]]\nlatency_ms = 1\n",
     "link 1: bandwidth_gbit_per_s is missing"),
])
def test_a_bad_link_gets_one_line_naming_its_index_and_key(tmp_path, links, message):
    assert load_error(write(tmp_path, MODEL + MACHINE * 2 + links)) == message


@pytest.mark.parametrize("draft, message", [
    ("[draft]\nseconds_per_token = 0.001\n", "[draft]: acceptance is missing"),
    ("[draft]\nacceptance = 1.5\nseconds_per_token = 0.001\n",
     "[draft]: acceptances, availability and continuation are probabilities in [0, 1]"),
    ("[draft]\nacceptance = 0.5\nfirst_acceptance = 2\nseconds_per_token = 0.001\n",
     "[draft]: acceptances, availability and continuation are probabilities in [0, 1]"),
    ("[draft]\nacceptance = 0.5\nfirst_acceptance = true\nseconds_per_token = 0.001\n",
     "[draft]: first_acceptance must be a number >= 0, not True"),
    ("[draft]\nacceptance = 0.5\navailability = -1\nseconds_per_token = 0.001\n",
     "[draft]: availability must be a number >= 0, not -1"),
    ("[draft]\nacceptance = 0.5\ncontinuation = -2\nseconds_per_token = 0.001\n",
     "[draft]: continuation must be a number >= 0, not -2"),
    ("[draft]\nacceptance = 0.5\ncontinuation = 1.01\nseconds_per_token = 0.001\n",
     "[draft]: acceptances, availability and continuation are probabilities in [0, 1]"),
    ("[draft]\nacceptance = 0.5\nseconds_per_token = -1\n", "[draft]: seconds_per_token must be a number >= 0, not -1"),
    ("[draft]\nacceptance = 0.5\nseconds_per_token = 0.1\nbytes = 'x'\n", "[draft]: bytes must be a number >= 0, not 'x'"),
    ("[draft]\nacceptance = 0.5\n", "[draft]: parameters is missing"),
    ("[draft]\nacceptance = 0.5\nparameters = 1e8\n", "[draft]: bits_per_weight is missing"),
])
def test_a_bad_draft_table_gets_one_line_naming_the_key(tmp_path, draft, message):
    assert load_error(write(tmp_path, MODEL + MACHINE + draft)) == message


@pytest.mark.parametrize("software, message", [
    ("[software]\ncoordinator_pass_us = 1\ncoordinator_row_us = 1\ndraft_call_us = 1\n", "[software]: hop_us is missing"),
    ("[software]\nhop_us = 1\ncoordinator_row_us = 1\ndraft_call_us = 1\n",
     "[software]: coordinator_pass_us is missing"),
    ("[software]\nhop_us = 1\ncoordinator_pass_us = 1\ndraft_call_us = 1\n",
     "[software]: coordinator_row_us is missing"),
    ("[software]\nhop_us = 1\ncoordinator_pass_us = 1\ncoordinator_row_us = 1\n", "[software]: draft_call_us is missing"),
])
def test_a_bad_software_table_gets_one_line_naming_the_key(tmp_path, software, message):
    assert load_error(write(tmp_path, MODEL + MACHINE + software)) == message


@pytest.mark.parametrize("top, message", [
    ("max_tokens = -3\n", "max_tokens must be a number >= 0, not -3"),
    ("context = 'long'\n", "context must be a number >= 0, not 'long'"),
])
def test_bad_top_level_numbers_name_the_file_and_key(tmp_path, top, message):
    path = write(tmp_path, top + MODEL + MACHINE)
    assert load_error(path) == f"{path}: {message}"


def test_a_missing_profile_named_by_a_setup_names_the_profile(tmp_path):
    path = write(tmp_path, MODEL + '[[machines]]\nprofile = "gone.json"\n')
    assert load_error(path) == f"{tmp_path / 'gone.json'}: No such file or directory"


def test_setup_from_profile_does_not_change_the_profile():
    profile = committed_profile()
    before = copy.deepcopy(profile)
    setup_from_profile(profile, behaviour=None)
    assert profile == before


@pytest.mark.parametrize("text, message", [
    (MODEL.replace("width = 16", "width = 0") + MACHINE, "[model]: width must be a finite number > 0, not 0"),
    (MODEL.replace("parameters = 1e6", "parameters = 0") + MACHINE,
     "[model]: parameters must be a finite number > 0, not 0"),
    (MODEL + MACHINE.replace("bandwidth_gb_per_s = 100", "bandwidth_gb_per_s = 0"),
     "machine 0: bandwidth_gb_per_s must be a finite number > 0, not 0"),
    (MODEL + MACHINE * 2 + "[[links]]\nlatency_ms = 1\nbandwidth_gbit_per_s = 0\n",
     "link 0: bandwidth_gbit_per_s must be a finite number > 0, not 0"),
])
def test_a_zero_size_or_rate_is_refused_naming_its_key(tmp_path, text, message):
    """Sizes and rates divide or scale the costs: zero is no setup (mutation testing found these unchecked)."""
    assert load_error(write(tmp_path, text)) == message
