"""The options the ``orchestrate`` commands share (the pipeline's, the
speculation's), their types, and the one-line error handling every command
wears; orchestrator.cli builds the commands from them. Importing it loads
neither Ray nor llama.cpp."""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import click

from orchestrator import config
from orchestrator.decoding.schedule import Schedule
from speculators.model import DRAFT_DEVICES
from stages.errors import SpecpipeError

if TYPE_CHECKING:  # for the types only: importing this module loads neither Ray nor llama.cpp
    from orchestrator.cluster.model_files import WholeModelSettings
    from stages.cost_curve import CostCurve


def one_line_errors(command):
    """Turn the errors a user can cause into one line and exit status 1."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except SpecpipeError as error:
            click.echo(f"error: {error}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)

    return wrapper


class ModelSource(click.ParamType):
    """--model: an hf: source as given (orchestrator.sources.hub reads it), else an existing file."""

    name = "PATH|hf:ORG/REPO[/FILE.gguf|:QUANT][@REVISION]"

    def convert(self, value, param, ctx):
        from orchestrator.sources.hub_reference import is_hub_source

        if isinstance(value, str) and is_hub_source(value):
            return value
        return click.Path(exists=True, dir_okay=False, path_type=Path).convert(value, param, ctx)


def progress_bar(label: str):
    """A progress callback (done, total) drawing a click progress bar on stderr."""
    state: dict = {}

    def update(done: int, total: int) -> None:
        if "bar" not in state:
            state["bar"] = click.progressbar(length=total, label=label, file=sys.stderr, show_pos=False)
            state["bar"].__enter__()
            state["done"] = 0
        state["bar"].update(done - state["done"])
        state["done"] = done
        if done >= total:
            state["bar"].__exit__(None, None, None)

    return update


def parse_boundaries(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of block indices") from None


def _options(command, options):
    """Apply click options given in the order they are listed in --help."""
    for option in reversed(options):
        command = option(command)
    return command


class GpuLayers(click.ParamType):
    """--n-gpu-layers: a count of layers, or "all" (stages.settings.ALL_LAYERS)."""

    name = "N|all"

    def convert(self, value, param, ctx):
        from stages.settings import ALL_LAYERS

        if isinstance(value, int):
            return value
        if str(value).strip().lower() == "all":
            return ALL_LAYERS
        try:
            count = int(value)
        except ValueError:
            count = -1
        if count < 0:
            self.fail(f"{value!r} is neither a number of layers (0 or more) nor 'all'", param, ctx)
        return count


@dataclass(frozen=True)
class PipelineOptions:
    """What ``run`` and ``serve`` share about the model and the pipeline (pipeline_options)."""

    files: list[str]  # the stage files given ([]: the default model's, or --model)
    whole_model: WholeModelSettings | None  # None: the stage files
    address: str | None
    place: dict[int, str] | None
    threads: int
    n_gpu_layers: int
    wire_dtype: str
    max_restarts: int
    tls: bool
    cost_curve: CostCurve | None = None  # --cost-curve (measurements only)

    def stage_settings(self, n_ctx: int, **more):
        """Every stage's llama.cpp settings, from these options and the command's own."""
        from stages.settings import StageSettings

        return StageSettings(n_ctx=n_ctx, threads=self.threads, n_gpu_layers=self.n_gpu_layers,
                             cost_curve=self.cost_curve, **more)

    def settings(self, stage, speculation, dashboard: bool):
        """The pipeline's settings (cluster.pipeline_settings.PipelineSettings) from these
        options and the command's own (splitting the default model on first use: after
        every check of the options)."""
        from orchestrator.cluster.pipeline_settings import PipelineSettings
        from orchestrator.config import default_stage_paths

        stage_paths = self.files
        if not stage_paths and self.whole_model is None:
            stage_paths = default_stage_paths(progress=progress_bar("splitting default model"))
        return PipelineSettings(stage_paths=stage_paths, stage=stage, speculation=speculation,
                                whole_model=self.whole_model, address=self.address, place=self.place,
                                wire_dtype=self.wire_dtype, dashboard=dashboard, max_restarts=self.max_restarts,
                                tls=self.tls)


COST_CURVE_OPTION = click.option(
    "--cost-curve", metavar="CURVE",
    help="For measurements: every stage pass lasts at least this curve's time for its width, emulating other "
         "machines (SETUP.toml@MS, device-check.json or a curve file; docs/measurements.md). Tokens are unchanged.")


def cost_curve_of(spec: str | None):
    """--cost-curve's CostCurve, or None."""
    if spec is None:
        return None
    from orchestrator.planning.curves import load_cost_curve

    return load_cost_curve(spec)


def pipeline_options(what: str):
    """FILES, --model-split, --model (and --stages, --boundaries, --profile),
    --address, --place, --threads, --n-gpu-layers, --wire-dtype,
    --max-restarts, --tls: written once for run and serve, passed to the
    command as ``pipeline``, a PipelineOptions. ``what``: "runs" or "serves"."""

    def decorate(command):
        @functools.wraps(command)
        @one_line_errors
        def wrapper(*args, files, model_split, whole_model, stage_count, boundaries, profiles, address, place,
                    threads, n_gpu_layers, wire_dtype, max_restarts, tls, cost_curve, **kwargs):
            from orchestrator.cluster.placement import parse_place

            if model_split and not files:
                raise click.UsageError("--model-split needs the stage files, e.g. --model-split a.gguf b.gguf")
            whole = _whole_model_settings(files, address, whole_model, stage_count, boundaries, profiles)
            if whole is not None:
                from orchestrator.cluster.model_files import with_source

                whole = with_source(whole)  # an hf: source's header is read here, before anything is placed
            pipeline = PipelineOptions([] if whole is not None else [str(path) for path in files], whole, address,
                                       parse_place(place) if place else None, threads, n_gpu_layers, wire_dtype,
                                       max_restarts, tls, cost_curve_of(cost_curve))
            return command(*args, pipeline=pipeline, **kwargs)

        return _options(wrapper, [
            click.argument("files", nargs=-1, type=click.Path(dir_okay=False, path_type=Path)),
            click.option("--model-split", "model_split", is_flag=True,
                         help=f"FILES are the stage files in order (one unsplit file {what} the whole model as one "
                              "stage)."),
            click.option("--model", "whole_model", type=ModelSource(),
                         help="The whole model: a file on this machine, cut into stages and shipped to the nodes "
                              "that run them, or hf:ORG/REPO/FILE.gguf, hf:ORG/REPO:QUANT (@REVISION), of which "
                              "each node fetches only its stage (cached there; docs/cluster.md)."),
            click.option("--stages", "stage_count", type=click.IntRange(1),
                         help="With --model: how many stages (default: one per node of the cluster)."),
            click.option("--boundaries", help="With --model: blocks where stages 2..n start (default: chosen for the "
                                              "nodes' free memory and, with --profile, speed)."),
            click.option("--profile", "profiles", multiple=True, metavar="ADDRESS=PROFILE.json",
                         help="With --model: a node's `orchestrate profile`, for its speed (give one for every node)."),
            click.option("--address", help="Ray cluster to use ('auto' honours RAY_ADDRESS); default: start a local "
                                           "Ray."),
            click.option("--place", help="Stage placement, e.g. '0=10.0.0.1,1=10.0.0.2' (node address or id)."),
            click.option("--threads", default=1, show_default=True, type=click.IntRange(1, config.MAX_THREADS),
                         help="Threads per stage."),
            click.option("--n-gpu-layers", default="all", show_default=True, type=GpuLayers(),
                         help="Layers of each stage on a GPU, where the node's llama.cpp build has one (make "
                              "install BACKEND=cuda|metal|vulkan): a number, or all. A CPU build ignores it."),
            click.option("--wire-dtype", type=click.Choice(["f32", "f16"]), default="f32", show_default=True,
                         help="Activations between stages; f16 halves traffic but is LOSSY (output may differ from "
                              "the whole model)."),
            click.option("--max-restarts", default=config.MAX_RESTARTS, show_default=True,
                         type=click.IntRange(0, 100),
                         help="Restarts of each stage (and drafter) that dies; a restarted stage is rebuilt by replay."),
            click.option("--tls", is_flag=True, help="Encrypt the chain between stages (TLS 1.3, a certificate made "
                                                     "for this run); docs/security.md."),
            COST_CURVE_OPTION,
        ])

    return decorate


def speculation_options(overlap: bool):
    """--speculator, --draft, --draft-max, --draft-p-min, --schedule,
    --tree-leaves, --draft-sampling (and, with drafter actors, --draft-overlap): written once for
    run and serve, passed to the command as ``speculation``, a SpeculationSettings."""

    def decorate(command):
        @functools.wraps(command)
        def wrapper(*args, speculator, draft_path, draft_max, draft_p_min, schedule, tree_leaves, draft_device,
                    draft_threads, drafter_nodes, draft_sampling, draft_overlap=False, **kwargs):
            from orchestrator.decoding.drafting import SpeculationError, SpeculationSettings

            try:
                speculation = SpeculationSettings(speculator, draft_path, Schedule(schedule), draft_max, draft_p_min,
                                                  draft_overlap, tree_leaves, draft_device, draft_threads,
                                                  tuple(drafter_nodes), draft_sampling)
            except SpeculationError as error:
                raise click.UsageError(str(error)) from None
            return command(*args, speculation=speculation, **kwargs)

        options = [
            click.option("--speculator", type=click.Choice(["none", "ngram", "model"]), default="none",
                         show_default=True,
                         help="Drafts for speculative decoding: prompt lookup (ngram) or a draft model (model, with "
                              "--draft)."),
            click.option("--draft", "draft_path", type=click.Path(dir_okay=False),
                         help="Draft model (whole GGUF, same vocabulary): a file, or hf:ORG/REPO[:QUANT or /FILE] "
                              "(fetched here once, then shipped to the drafters' nodes)."),
            click.option("--draft-max", default=config.DRAFT_MAX, show_default=True, type=click.IntRange(1, 64),
                         help="Most draft tokens per target pass."),
            click.option("--draft-p-min", default=0.0, show_default=True, type=click.FloatRange(0.0, 1.0),
                         help="A draft model stops drafting below this probability."),
            click.option("--draft-device", type=click.Choice(DRAFT_DEVICES), default="auto",
                         show_default=True,
                         help="Where a draft model computes on its machine: cpu (its cores, beside a stage on the "
                              "GPU), gpu, or auto (the GPU where the llama.cpp build has one)."),
            click.option("--draft-threads", type=click.IntRange(1, 1024),
                         help="A draft model's CPU threads (default: the stages' --threads)."),
            click.option("--drafter-node", "drafter_nodes", multiple=True, metavar="NODE",
                         help="A Ray node (address or id) that drafts in place of the machine of stage 0 (given "
                              "again: of stage 1, ...), e.g. one that holds no stage. Repeatable."),
            click.option("--schedule", type=click.Choice([Schedule.ASYNC.value, Schedule.SYNC.value]),
                         default=Schedule.ASYNC.value, show_default=True,
                         help="async: draft on machines while their stage is idle, and start windows ahead; sync: "
                              "draft, then verify."),
            click.option("--tree-leaves", default=1, show_default=True, type=click.IntRange(1, 64),
                         help="Above 1: token trees of up to this many leaves, from prompt lookup (other matches' "
                              "continuations) or the draft model (its most probable continuations, grown best-first); "
                              "the rows that pay on the measured pass cost are verified in one pass. 1: chains."),
            click.option("--draft-sampling", type=click.Choice(["coupled", "top"]), default="coupled",
                         show_default=True,
                         help="When sampling (--temperature > 0): coupled drafts draw with the target's seeded "
                              "uniforms, top drafts are the draft's top choices. The text is the same either way."),
        ]
        if overlap:
            options.append(click.option("--draft-overlap", is_flag=True,
                                        help="Let drafters run while their own stage computes too."))
        return _options(wrapper, options)

    return decorate


def _whole_model_settings(files, address, whole_model, stage_count, boundaries, profiles):
    """--model's settings (None: stage files given). One unsplit file on a
    cluster is a whole model too, split over the nodes when there are several."""
    from orchestrator.planning.loaders import read_profile
    from orchestrator.cluster.model_files import WholeModelSettings
    from stages.gguf_file import stage_info_of

    if whole_model is None:
        if stage_count is not None or boundaries is not None or profiles:
            raise click.UsageError("--stages, --boundaries and --profile go with --model WHOLE.gguf")
        if len(files) == 1 and address is not None and files[0].exists() and stage_info_of(str(files[0])) is None:
            return WholeModelSettings(str(files[0]), stages=None, single_file=True)
        return None
    if files:
        raise click.UsageError("give --model WHOLE.gguf or the stage files, not both")
    if boundaries is not None and profiles:
        raise click.UsageError("--boundaries fixes the split; --profile only helps choose one")
    parsed = parse_boundaries(boundaries)
    if parsed is not None and stage_count is not None and len(parsed) != stage_count - 1:
        raise click.UsageError(f"--stages {stage_count} needs {stage_count - 1} boundaries, got {len(parsed)}")
    by_address = {}
    for item in profiles:
        address_part, separator, path = item.partition("=")
        if not separator or not address_part or not path:
            raise click.UsageError(f"--profile {item!r} is not ADDRESS=PROFILE.json")
        by_address[address_part] = read_profile(path)
    return WholeModelSettings(str(whole_model), stages=stage_count or (len(parsed) + 1 if parsed is not None else None),
                              boundaries=parsed, profiles=by_address or None)
