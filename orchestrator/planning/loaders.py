"""Build a planning ``Setup`` from a TOML file, a GGUF header or a profile.

A setup file (examples in benchmarks/setups/) has these tables; every number
is in the unit its key names:

    max_tokens = 256           # tokens per simulated generation
    context = 4096             # KV cache positions each stage holds
    boundaries = [63]          # optional: a fixed split instead of a search

    [model]                    # gguf = "path/to/model.gguf", or by size:
    name = "Llama 3.1 405B"
    blocks = 126
    width = 16384
    vocab = 128256
    parameters = 405.8e9
    bits_per_weight = 4.5
    kv_width = 1024            # key (= value) width per position

    [[machines]]               # in pipeline order; profile = "profile.json", or:
    name = "a"
    memory_gb = 192
    bandwidth_gb_per_s = 800
    compute_tflops = 27
    efficiency = 0.7           # share of peak bandwidth and compute achieved
    pass_overhead_ms = 1.0

    [[links]]                  # links[i] joins machines i and i + 1; one entry serves all
    latency_ms = 0.1
    bandwidth_gbit_per_s = 10

    [draft]                    # omit for no speculation
    acceptance = 0.7           # per token, given the tokens before it were right
    first_acceptance = 0.6     # optional: the first token drafted from the committed text
    availability = 1.0         # chance that drafting proposes anything (1 for a draft model)
    continuation = 1.0         # chance of one more token after one (default 1)
    seconds_per_token = 0.002  # or a model by size, priced on each machine:
    parameters = 1.24e9
    bits_per_weight = 4.5

    [software]                 # profile = "profile.json", or:
    hop_us = 500
    coordinator_pass_us = 20
    coordinator_row_us = 10
    draft_call_us = 300

A profile alone (``setup_from_profile``) describes the machine it was measured
on running the profiled split, every stage on that one machine.
"""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path

from orchestrator.config import (PLAN_DEFAULT_COORDINATOR_PASS_SECONDS, PLAN_DEFAULT_COORDINATOR_ROW_SECONDS,
                                 PLAN_DEFAULT_DRAFT_CALL_SECONDS, PLAN_DEFAULT_HOP_SECONDS)
from orchestrator.planning.costs import BatchCurve, Link, Machine, MeasuredMachine, ModelShape, Software
from orchestrator.planning.inputs import PlanError, Setup
from orchestrator.planning.simulation import DraftBehaviour
from stages.gguf_file import ModelFile, read_model

PROFILE_KIND = "specpipe-profile"
PROFILE_VERSION = 1
# This project's own costs where no profile is given (config.py says where they come from).
DEFAULT_SOFTWARE = Software(hop_seconds=PLAN_DEFAULT_HOP_SECONDS,
                            coordinator_pass_seconds=PLAN_DEFAULT_COORDINATOR_PASS_SECONDS,
                            coordinator_row_seconds=PLAN_DEFAULT_COORDINATOR_ROW_SECONDS,
                            draft_call_seconds=PLAN_DEFAULT_DRAFT_CALL_SECONDS)
PROFILE_KEYS = ("machine", "batch_sizes", "stages", "model", "model_shape", "block_seconds", "head_seconds",
                "fixed_seconds", "hop_seconds", "coordinator_pass_seconds", "coordinator_row_seconds",
                "socket_bytes_per_second", "drafter_seconds_per_token", "drafter_call_seconds")


def read_profile(path: str | Path) -> dict:
    try:
        profile = json.loads(Path(path).read_text())
    except OSError as error:
        raise PlanError(f"{path}: {error.strerror or error}") from None
    except json.JSONDecodeError as error:
        raise PlanError(f"{path}: not JSON ({error.msg} at line {error.lineno})") from None
    if not isinstance(profile, dict) or profile.get("kind") != PROFILE_KIND:
        raise PlanError(f"{path}: not a profile written by `orchestrate profile`")
    if profile.get("version") != PROFILE_VERSION:
        raise PlanError(f"{path}: profile version {profile.get('version')}, this planner reads {PROFILE_VERSION}; "
                        "run `orchestrate profile` again")
    missing = [key for key in PROFILE_KEYS if key not in profile]
    if missing:
        raise PlanError(f"{path}: an incomplete or older profile (no {missing[0]}); run `orchestrate profile` again")
    return profile


def measured_machine(profile: dict) -> MeasuredMachine:
    sizes = tuple(profile["batch_sizes"])
    return MeasuredMachine(
        name=profile["machine"]["host"],
        memory_bytes=float(profile["machine"]["memory_bytes"]),
        block=BatchCurve(sizes, tuple(profile["block_seconds"])),
        head=BatchCurve(sizes, tuple(profile["head_seconds"])),
        fixed=BatchCurve(sizes, tuple(profile["fixed_seconds"])),
    )


def measured_software(profile: dict) -> Software:
    return Software(
        hop_seconds=profile["hop_seconds"],
        coordinator_pass_seconds=profile["coordinator_pass_seconds"],
        coordinator_row_seconds=profile["coordinator_row_seconds"],
        local_bytes_per_second=profile["socket_bytes_per_second"],
        draft_call_seconds=profile["drafter_call_seconds"],
    )


def model_shape_of_gguf(path) -> ModelShape:
    """A model's shape from its GGUF header (a path, or the header read:
    a ModelFile); tensor data is not read."""
    model = path if isinstance(path, ModelFile) else read_model(path)
    fields = model.metadata
    architecture = model.architecture
    blocks = model.block_count
    block_bytes = [0] * blocks
    block_parameters = [0] * blocks
    by_name = {tensor.name: tensor for tensor in model.tensors}
    for tensor in model.tensors:
        if tensor.name.startswith("blk."):
            index = int(tensor.name.split(".")[1])
            block_bytes[index] += tensor.n_bytes
            parameters = 1
            for dimension in tensor.shape:
                parameters *= dimension
            block_parameters[index] += parameters
    embedding = by_name["token_embd.weight"]
    head = by_name.get("output.weight", embedding)  # tied: the head reads the embedding table
    width = int(fields[f"{architecture}.embedding_length"])
    return ModelShape(
        name=str(fields.get("general.name", model.name)),
        blocks=blocks, width=width, vocab=int(embedding.shape[1]),
        block_bytes=tuple(block_bytes),
        head_bytes=head.n_bytes if head is not embedding else 0,
        embedding_bytes=embedding.n_bytes,
        block_parameters=max(block_parameters),
        head_parameters=width * int(embedding.shape[1]),
        kv_bytes_per_token=kv_bytes_per_token(fields, architecture),
    )


def kv_bytes_per_token(fields: dict, architecture: str) -> int:
    """KV cache bytes one position takes in one block (keys and values, f16), from a model's metadata."""
    width = int(fields[f"{architecture}.embedding_length"])
    heads = int(fields[f"{architecture}.attention.head_count"])
    kv_heads = fields.get(f"{architecture}.attention.head_count_kv", heads)
    kv_heads = int(max(kv_heads) if isinstance(kv_heads, list) else kv_heads)
    head_width = int(fields.get(f"{architecture}.attention.key_length", width // heads))
    return 2 * kv_heads * head_width * 2


def setup_from_profile(profile: dict, *, behaviour: DraftBehaviour | None, drafter: str = "ngram",
                       max_tokens: int = 256, context: int = 2048) -> Setup:
    """The profiled machine running the profiled split, all stages on it."""
    try:
        return _setup_from_profile(profile, behaviour, drafter, max_tokens, context)
    except (KeyError, TypeError, ValueError) as error:
        raise PlanError(f"a malformed profile ({type(error).__name__}: {error}); run `orchestrate profile` again") from None


def _setup_from_profile(profile: dict, behaviour: DraftBehaviour | None, drafter: str, max_tokens: int,
                        context: int) -> Setup:
    machine = measured_machine(profile)
    stages = profile["stages"]
    draft_seconds = profile["drafter_seconds_per_token"].get(drafter)
    if behaviour is not None and draft_seconds is None:
        raise PlanError(f"the profile has no {drafter} drafter timing (profile with --draft for a draft model)")
    return Setup(
        model=ModelShape(**{**profile["model_shape"], "block_bytes": tuple(profile["model_shape"]["block_bytes"])}),
        machines=[machine] * len(stages),
        links=[None] * len(stages),
        software=measured_software(profile),
        behaviour=behaviour,
        draft_seconds=[draft_seconds or 0.0] * len(stages),
        context=context,
        max_tokens=max_tokens,
        starts=tuple(stage["first_block"] for stage in stages),
        one_host_parallel_stages=max(1, profile["machine"]["cpus"] // profile["machine"]["threads_per_stage"]),
    )


def _number(table: dict, key: str, where: str, default: float | None = None, *, positive: bool = False) -> float:
    """A finite number >= 0 (> 0 where ``positive``: sizes, rates and divisors)."""
    value = table.get(key, default)
    if value is None:
        raise PlanError(f"{where}: {key} is missing")
    if (isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0
            or (positive and value == 0)):
        raise PlanError(f"{where}: {key} must be a {'finite number > 0' if positive else 'number >= 0'}, not {value!r}")
    return float(value)


def _model(table: dict, base: Path) -> ModelShape:
    if "gguf" in table:
        return model_shape_of_gguf(base / table["gguf"])
    where = "[model]"
    try:
        return _model_by_size(table, where)
    except ValueError as error:
        raise PlanError(f"{where}: {error}") from None


def _model_by_size(table: dict, where: str) -> ModelShape:
    return ModelShape.from_parameters(
        name=str(table.get("name", "model")),
        blocks=int(_number(table, "blocks", where, positive=True)), width=int(_number(table, "width", where, positive=True)),
        vocab=int(_number(table, "vocab", where, positive=True)), parameters=_number(table, "parameters", where, positive=True),
        bits_per_weight=_number(table, "bits_per_weight", where, positive=True), kv_heads_width=int(_number(table, "kv_width", where)),
    )


def _machine(table: dict, index: int, base: Path) -> Machine | MeasuredMachine:
    if "profile" in table:
        return measured_machine(read_profile(base / table["profile"]))
    where = f"machine {index}"
    efficiency = _number(table, "efficiency", where, 1.0, positive=True)
    return Machine(
        name=str(table.get("name", f"machine-{index}")),
        memory_bytes=_number(table, "memory_gb", where) * 1e9,
        bytes_per_second=_number(table, "bandwidth_gb_per_s", where, positive=True) * 1e9 * efficiency,
        flops_per_second=_number(table, "compute_tflops", where, positive=True) * 1e12 * efficiency,
        pass_overhead_seconds=_number(table, "pass_overhead_ms", where, 0.0) / 1e3,
    )


def _link(table: dict, index: int) -> Link:
    where = f"link {index}"
    return Link(_number(table, "latency_ms", where) / 1e3, _number(table, "bandwidth_gbit_per_s", where, positive=True) * 1e9 / 8)


def _draft(table: dict, machines: list) -> tuple[DraftBehaviour, list[float], int]:
    where = "[draft]"
    def optional(key: str) -> float | None:
        return None if key not in table else _number(table, key, where)

    try:
        behaviour = DraftBehaviour(_number(table, "acceptance", where), _number(table, "availability", where, 1.0),
                                   optional("first_acceptance"), _number(table, "continuation", where, 1.0))
    except ValueError as error:
        raise PlanError(f"{where}: {error}") from None
    if "seconds_per_token" in table:
        seconds = _number(table, "seconds_per_token", where)
        return behaviour, [seconds] * len(machines), int(_number(table, "bytes", where, 0))
    parameters = _number(table, "parameters", where)
    draft_bytes = int(parameters * _number(table, "bits_per_weight", where) / 8)
    seconds = []
    for machine in machines:
        if not isinstance(machine, Machine):
            raise PlanError(f"{where}: give seconds_per_token for a profiled machine ({machine.name})")
        seconds.append(machine.pass_seconds(draft_bytes, parameters, tokens=1))
    return behaviour, seconds, draft_bytes


def load_setup(path: str | Path) -> Setup:
    """A Setup from a TOML setup file (benchmarks/setups/*.toml): one flat
    pass over its tables, each field checked where it is read, so a bad file
    gets one line naming the table and field."""
    path = Path(path)
    try:
        document = tomllib.loads(path.read_text())
    except OSError as error:
        raise PlanError(f"{path}: {error.strerror or error}") from None
    except tomllib.TOMLDecodeError as error:
        raise PlanError(f"{path}: not TOML ({error})") from None
    base = path.parent
    for key, kind in (("model", dict), ("machines", list), ("links", list), ("draft", dict), ("software", dict)):
        if key in document and not isinstance(document[key], kind):
            raise PlanError(f"{path}: {key} must be {'a table' if kind is dict else 'an array of tables'}")
    if not all(isinstance(table, dict) for key in ("machines", "links") for table in document.get(key, [])):
        raise PlanError(f"{path}: every [[machines]] and [[links]] entry must be a table")
    try:
        model = _model(document["model"], base)
        machines = [_machine(table, index, base) for index, table in enumerate(document["machines"])]
    except KeyError as error:
        raise PlanError(f"{path}: missing {error.args[0]!r}") from None
    if not machines:
        raise PlanError(f"{path}: no machines")
    links_tables = document.get("links", [])
    links: list[Link | None] = [_link(table, index) for index, table in enumerate(links_tables)]
    if len(links) == 1:
        links = links * len(machines)
    if len(machines) > 1 and len(links) < len(machines):
        raise PlanError(f"{path}: {len(machines)} machines need {len(machines)} links (machine i to i + 1, the last "
                        "carrying the chosen tokens back to machine 0), or one for all")
    software_table = document.get("software", {})
    if "profile" in software_table:
        software = measured_software(read_profile(base / software_table["profile"]))
    elif software_table:
        software = Software(
            _number(software_table, "hop_us", "[software]") / 1e6,
            _number(software_table, "coordinator_pass_us", "[software]") / 1e6,
            _number(software_table, "coordinator_row_us", "[software]") / 1e6,
            draft_call_seconds=_number(software_table, "draft_call_us", "[software]") / 1e6,
        )
    else:
        software = DEFAULT_SOFTWARE
    behaviour, draft_seconds, draft_bytes = None, None, 0
    if "draft" in document:
        behaviour, draft_seconds, draft_bytes = _draft(document["draft"], machines)
    boundaries = document.get("boundaries")
    if boundaries is not None:
        valid = (isinstance(boundaries, list) and len(boundaries) == len(machines) - 1
                 and all(isinstance(value, int) and not isinstance(value, bool) for value in boundaries)
                 and [0, *boundaries, model.blocks] == sorted(set([0, *boundaries, model.blocks])))
        if not valid:
            raise PlanError(f"{path}: boundaries must be {len(machines) - 1} increasing block numbers "
                            f"between 1 and {model.blocks - 1}")
    max_tokens = int(_number(document, "max_tokens", str(path), 256))
    if max_tokens < 2:
        raise PlanError(f"{path}: max_tokens must be at least 2")
    return Setup(
        model=model, machines=machines, links=links, software=software, behaviour=behaviour,
        draft_seconds=draft_seconds, draft_bytes=draft_bytes,
        context=int(_number(document, "context", str(path), 4096)),
        max_tokens=max_tokens,
        starts=(0, *boundaries) if boundaries else None,
    )
