"""The ``orchestrate`` command: split, verify-split, run, serve, bench, profile, plan.

Each command builds its settings and calls library code; expected failures
(bad files, bad boundaries, a cluster that cannot place the stages: every
``SpecpipeError``) end with one ``error:`` line on stderr and exit status 1.
Anything else is a bug and shows its traceback. Importing this module loads
neither Ray nor llama.cpp (``orchestrate plan`` and ``--help`` need neither):
each command imports what it uses.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import click

from orchestrator import config
from orchestrator.cli_options import (COST_CURVE_OPTION, PipelineOptions, cost_curve_of, one_line_errors, parse_boundaries,
                                      pipeline_options, progress_bar, speculation_options)
from speculators.sampling import SamplingSettings
from stages.settings import DEFAULT_CONTEXT


@click.group()
def main() -> None:
    """Run GGUF models split into layer stages across Ray nodes, exactly."""


@main.command()
@click.argument("model", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("outputs", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--boundaries", help="Blocks where stages 2..n start, e.g. '15' or '10,20' (default: balanced by bytes).")
@click.option("--only", type=int, metavar="K",
              help="Write only stage K (the K-th OUTPUT, from 0), cut where the full split would cut.")
@one_line_errors
def split(model: Path, outputs: tuple[Path, ...], boundaries: str | None, only: int | None) -> None:
    """Cut MODEL (one file or the first shard) into one stage file per OUTPUT."""
    from stages.split import split_model

    plan = split_model(
        model, list(outputs), parse_boundaries(boundaries), progress=progress_bar("splitting"), only=only
    )
    for stage_index, (output, (first, end)) in enumerate(zip(outputs, plan.ranges)):
        if only is None or stage_index == only:
            click.echo(f"{output}: blocks [{first}, {end})")


@main.command("verify-split")
@click.argument("model", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("stage_files", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--threads", default=1, show_default=True, type=click.IntRange(1, config.MAX_THREADS),
              help="Threads per stage.")
@one_line_errors
def verify_split(model: Path, stage_files: tuple[Path, ...], threads: int) -> None:
    """Run a probe prompt through MODEL and through STAGE_FILES; exit 1 unless the logits are identical."""
    from orchestrator.verify_split import compare_split

    report = compare_split(str(model), [str(path) for path in stage_files], threads=threads)
    click.echo(
        f"probe of {report.prompt_tokens} tokens + {report.greedy_tokens} greedy steps: "
        f"largest logit difference {report.max_difference:g}; "
        f"greedy tokens {'identical' if report.tokens_identical else 'DIFFER'}"
    )
    if not report.identical:
        click.echo("error: the stages do not reproduce the whole model", err=True)
        sys.exit(1)


@main.command()
@pipeline_options("runs")
@click.option("--prompt", help="Prompt text.")
@click.option("--prompt-file", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="Read the prompt from a file.")
@click.option("--chat/--raw", default=None,
              help="The prompt in the model's chat template (the default where the model has one), or as it is.")
@click.option("--max-tokens", default=config.MAX_TOKENS, show_default=True, type=click.IntRange(1))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(0.0), help="0 is greedy.")
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0.0, 1.0, min_open=True))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--n-ctx", default=DEFAULT_CONTEXT, show_default=True, type=click.IntRange(16, config.MAX_CONTEXT),
              help="Context per stage.")
@speculation_options(overlap=True)
@click.option("--dashboard", is_flag=True,
              help="Start the Ray dashboard with the local Ray instance (prints its URL and how to log in).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
@one_line_errors
def run(pipeline: PipelineOptions, speculation, prompt, prompt_file, chat, max_tokens, temperature, top_p, seed,
        n_ctx, dashboard, as_json) -> None:
    """Generate text through a pipeline of stages (default: SmolLM2-135M split in two)."""
    from orchestrator.run import RunSettings, run_generation

    prompt, chat = _prompt_of(prompt, prompt_file, chat)
    settings = RunSettings(
        pipeline.settings(pipeline.stage_settings(n_ctx), speculation, dashboard),
        prompt=prompt,
        chat=chat,
        max_tokens=max_tokens,
        sampling=SamplingSettings(temperature=temperature, top_p=top_p, seed=seed),
    )
    # Ray prints its own notices (such as a worker that died, before its stage
    # is restarted) to the driver's sys.stdout; stdout is kept for the text.
    text_out = sys.stdout
    if as_json:
        with contextlib.redirect_stdout(sys.stderr):
            outcome = run_generation(settings, on_status=lambda line: click.echo(line, err=True))
        click.echo(json.dumps(outcome.as_json()), file=text_out)
        if not outcome.generation.tokens:
            click.echo(_why_nothing(outcome.generation.stopped_by, chat), err=True)
        return

    def show(text: str) -> None:
        click.echo(text, nl=False, file=text_out)
        text_out.flush()

    with contextlib.redirect_stdout(sys.stderr):
        outcome = run_generation(settings, on_text=show, on_status=lambda line: click.echo(line, err=True))
    click.echo(file=text_out)
    click.echo(outcome.summary_line(), err=True)
    if not outcome.generation.tokens:
        click.echo(_why_nothing(outcome.generation.stopped_by, chat), err=True)


def _why_nothing(stopped_by: str, chat: bool | None) -> str:
    """Why a run generated no token, in one line."""
    if stopped_by != "end":
        return f"no token was generated (stopped by {stopped_by})"
    fix = "drop --raw to use its chat template" if chat is False else "rephrase the prompt, or use --raw"
    return f"no token was generated: the model's first token ended its text ({fix})"


def _prompt_of(prompt: str | None, prompt_file: Path | None, chat: bool | None) -> tuple[str, bool | None]:
    """(the prompt, chat): --prompt, --prompt-file, or the default prompt;
    chat None: in the model's chat template where it has one."""
    from orchestrator.config import DEFAULT_PROMPT

    if prompt is not None and prompt_file is not None:
        raise click.UsageError("give --prompt or --prompt-file, not both")
    if prompt_file is not None:
        try:
            prompt = prompt_file.read_text(encoding="utf-8")
        except UnicodeDecodeError as error:
            raise click.UsageError(f"{prompt_file} is not UTF-8 text (byte {error.start})") from None
    if prompt is not None and not prompt.strip():
        raise click.UsageError("the prompt is empty")
    return (DEFAULT_PROMPT if prompt is None else prompt), chat


@main.command()
@pipeline_options("serves")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0: every interface; then set an API key).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(1, 65535))
@click.option("--api-key", envvar="SPECPIPE_API_KEY", show_envvar=True,
              help="Require 'Authorization: Bearer KEY' on every /v1 request.")
@click.option("--model-name", help="The model's name in the API (default: the GGUF file's name without .gguf).")
@click.option("--max-sequences", type=click.IntRange(1, 256),
              help=f"Requests decoded at once, each holding a KV sequence in every stage (default: what fits in "
                   f"{config.SERVE_KV_MEMORY_SHARE:.0%} of free memory, at most {config.SERVE_MAX_SEQUENCES}).")
@click.option("--queue", "queue_limit", default=config.SERVE_QUEUE, show_default=True, type=click.IntRange(0),
              help="Requests that may wait for a free sequence; more get 429.")
@click.option("--prefix-cache-tokens", type=click.IntRange(0),
              help="Tokens of finished requests' prompts and replies kept in the stages for later requests that "
                   "begin alike (a chat's next turn, a shared system prompt) to copy; least recently used go "
                   "first (default: what --max-sequences sequences hold; 0: off).")
@click.option("--n-ctx", default=config.SERVE_CONTEXT, show_default=True,
              type=click.IntRange(16, config.MAX_CONTEXT), help="Context of each sequence (prompt + reply).")
@speculation_options(overlap=False)
@click.option("--dashboard/--no-dashboard", default=True, show_default=True,
              help="Start the Ray dashboard with a local Ray (its Serve page shows the service; "
                   "prints its URL and how to log in).")
@one_line_errors
def serve(pipeline: PipelineOptions, speculation, host, port, api_key, model_name, max_sequences, queue_limit,
          prefix_cache_tokens, n_ctx, dashboard) -> None:
    """Serve the model (default: SmolLM2-135M split in two) with the OpenAI API until Ctrl-C or SIGTERM.
    Requests draft as ``run`` does (in this process: prompt lookup, or a draft model with a KV sequence per request)."""
    from orchestrator.serving.deployment import ServeSettings, serve_until_stopped

    if speculation.tree_leaves > 1 and max_sequences not in (None, 1):  # stages.engine: trees beside one sequence
        raise click.UsageError("token trees (--tree-leaves) need --max-sequences 1")
    if max_sequences and n_ctx * max_sequences > config.MAX_CONTEXT:
        raise click.UsageError(f"--n-ctx {n_ctx} x --max-sequences {max_sequences} exceeds {config.MAX_CONTEXT} "
                               "KV cells per stage")
    settings = ServeSettings(
        pipeline.settings(pipeline.stage_settings(n_ctx, sequences=max_sequences or 0), speculation, dashboard),
        queue_limit=queue_limit,
        prefix_cache_tokens=prefix_cache_tokens,
        model_name=model_name,
        host=host, port=port, api_key=api_key or None,
    )
    serve_until_stopped(settings, on_status=lambda line: click.echo(line, err=True))


@main.command()
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Folder for results.json, results.md and chart.png.")
@click.option("--quick", is_flag=True, help="A small subset (scenarios marked quick, 1 prompt, 1 repetition).")
@click.option("--scenario", "names", multiple=True, help="Run only this scenario (repeatable).")
@click.option("--scenarios", "folder", type=click.Path(file_okay=False, exists=True, path_type=Path),
              help="Folder of scenario files (default: benchmarks/scenarios).")
@click.option("--address", help="Ray cluster to use (with --serve: this project's servers join it); default: start a "
                                "local Ray.")
@click.option("--serve", "serving", is_flag=True,
              help="Instead: servers under concurrent load (this server with 2 stages and whole, and "
                   "llama-cpp-python's server; under --cost-curve the 2-stage server with and without a draft "
                   "model), into serve.json, serve.md and serve.png.")
@click.option("--concurrency", "concurrencies", multiple=True, type=click.IntRange(1, 64),
              help="With --serve: this many requests at once (repeatable; default 1, 2, 4 and 8).")
@COST_CURVE_OPTION
@one_line_errors
def bench(out_dir: Path, quick: bool, names: tuple[str, ...], folder: Path | None, address: str | None,
          serving: bool, concurrencies: tuple[int, ...], cost_curve: str | None) -> None:
    """Run the benchmark scenarios, every mode side by side; exit 1 if any mode's output differs."""
    import platform
    import tempfile

    from benchmarks.report import write_results
    from benchmarks.scenarios import SCENARIO_DIR, load_scenarios
    from benchmarks.suite import run_scenario
    from orchestrator.cluster.connect import ray_session

    curve = cost_curve_of(cost_curve)
    if concurrencies and not serving:
        raise click.UsageError("--concurrency goes with --serve")
    if serving:
        _bench_serve(out_dir, quick, cost_curve, curve, tuple(sorted(set(concurrencies))), address)
        return

    scenarios = load_scenarios(folder or SCENARIO_DIR, quick=quick, only=list(names) or None)
    results: dict = {
        "command": "orchestrate bench " + " ".join(sys.argv[2:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        # emulated figures name their curve; the spec lets `orchestrate plan --bench` predict under it
        "cost_curve": {"spec": cost_curve, "name": curve.name} if curve else None,
        "scenarios": [],
    }
    with ray_session(address, num_cpus=os.cpu_count()) as where, tempfile.TemporaryDirectory() as workdir:
        if where:
            click.echo(f"[{where}]", err=True)
        for scenario in scenarios:
            results["scenarios"].append(
                run_scenario(scenario, Path(workdir), progress=progress_bar(f"{scenario.name:14s}"), cost_curve=curve)
            )
    for path in write_results(results, out_dir):
        click.echo(str(path))
    different = [f"{scenario['scenario']}/{row['mode']}" for scenario in results["scenarios"]
                 for row in scenario["modes"] if not row["identical"]]
    if different:
        click.echo(f"error: output differs from the whole model in {', '.join(different)}", err=True)
        sys.exit(1)


def _bench_serve(out_dir: Path, quick: bool, cost_curve: str | None, curve, concurrencies: tuple[int, ...],
                 address: str | None) -> None:
    """orchestrate bench --serve (benchmarks.serve_bench) on the default model."""
    import tempfile

    from benchmarks.serve_bench import run_serve_bench, write_serve_results
    from orchestrator.config import default_model_path, default_stage_paths

    stage_paths = default_stage_paths(progress=progress_bar("splitting default model"))
    shape = dict(concurrencies=(1, 2), repetitions=1, max_tokens=8) if quick else {}
    if concurrencies:
        shape["concurrencies"] = concurrencies
    with tempfile.TemporaryDirectory() as workdir:
        results = run_serve_bench(stage_paths, str(default_model_path()), workdir=Path(workdir),
                                  progress=progress_bar("serve bench"), cost_curve=cost_curve, address=address,
                                  **shape)
    results["command"] = "orchestrate bench " + " ".join(sys.argv[2:])
    results["cost_curve"] = {"spec": cost_curve, "name": curve.name} if curve else None
    for path in write_serve_results(results, out_dir):
        click.echo(str(path))
    # llama.cpp's own llama-server (a peer, benchmarks.serve_bench) is reported, not held to exactness
    different = sorted({row["server"] for row in results["rows"] if not row["matches_solo"]
                        and not row["server"].startswith("cpp-")})
    if different:
        click.echo(f"error: under load, output differs from the solo run in {', '.join(different)}", err=True)
        sys.exit(1)


@main.command()
@click.argument("stage_files", nargs=-1, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--whole", "whole_path", type=click.Path(dir_okay=False, path_type=Path),
              help="The unsplit model STAGE_FILES were cut from (default: the default model).")
@click.option("--draft", "draft_path", type=click.Path(exists=True, dir_okay=False), help="Also time this draft model.")
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False, path_type=Path), help="Profile JSON to write.")
@click.option("--repetitions", default=config.PROFILE_REPETITIONS, show_default=True, type=click.IntRange(1),
              help="Timings per batch size (median).")
@click.option("--threads", default=1, show_default=True, type=click.IntRange(1, config.MAX_THREADS),
              help="Threads per stage.")
@one_line_errors
def profile(stage_files, whole_path, draft_path, out_path, repetitions, threads) -> None:
    """Measure this machine for `orchestrate plan`: stage time per batch of 1..64 tokens, drafter, hop."""
    from orchestrator.config import default_model_path, default_stage_paths
    from orchestrator.output import write_whole
    from orchestrator.profile import ProfileSettings, profile_machine
    from stages.gguf_file import ModelFileError, read_model
    from stages.stage_files import check_stage_files

    if stage_files and whole_path is None:
        raise click.UsageError("give --whole MODEL.gguf, the model the stage files were cut from")
    paths = [str(path) for path in stage_files] or default_stage_paths(progress=progress_bar("splitting default model"))
    if len(paths) < 2:
        raise click.UsageError("profile needs at least two stage files (to tell a block's time from the head's)")
    whole = str(whole_path or default_model_path())
    first = check_stage_files(paths)[0]
    if first is None or first.source_fingerprint != read_model(whole).fingerprint:
        raise ModelFileError(f"{paths[0]} was not cut from {whole}; give the model the stage files came from with --whole")
    settings = ProfileSettings(paths, whole, draft_path, repetitions=repetitions, threads=threads)
    result = profile_machine(settings, progress=progress_bar("batch sizes"), status=lambda line: click.echo(line, err=True))
    write_whole(out_path, lambda path: path.write_text(json.dumps(result, indent=1) + "\n"))
    click.echo(
        f"{out_path}: one token {sum(stage['seconds'][0] for stage in result['stages']) * 1e3:.1f} ms over "
        f"{len(paths)} stages, hop {result['hop_seconds'] * 1e6:.0f} us, "
        f"prompt lookup {result['drafter_seconds_per_token']['ngram'] * 1e6:.0f} us/token"
    )


@main.command()
@click.argument("setup_file", required=False, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--profile", "profile_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Without SETUP_FILE: plan the profiled machine running the profiled split.")
@click.option("--acceptance", type=click.FloatRange(0.0, 1.0),
              help="Acceptance of a draft token after accepted ones (bench's acceptance_later); overrides the setup's.")
@click.option("--first-acceptance", type=click.FloatRange(0.0, 1.0),
              help="Acceptance of the first draft token (bench's acceptance_first); default: as --acceptance.")
@click.option("--availability", type=click.FloatRange(0.0, 1.0),
              help="Chance that drafting from the committed text proposes anything (bench's draft_availability; "
                   "1 for a draft model).")
@click.option("--continuation", type=click.FloatRange(0.0, 1.0),
              help="Chance the drafter proposes one more token after one (bench's draft_continuation); default 1.")
@click.option("--drafter", type=click.Choice(["ngram", "model"]), default="ngram", show_default=True,
              help="With --profile: whose measured time per draft token to use.")
@click.option("--max-tokens", type=click.IntRange(2), help="Tokens per simulated generation (default: the setup's, or 256).")
@click.option("--draft-max", type=click.IntRange(1, 64), help="Predict at this --draft-max only (default: find the best).")
@click.option("--bench", "bench_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="With --profile: predict every mode of this bench results.json and show it beside the measurement.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@COST_CURVE_OPTION
@one_line_errors
def plan(setup_file, profile_path, acceptance, first_acceptance, availability, continuation, drafter, max_tokens,
         draft_max, bench_path, as_json, cost_curve) -> None:
    """Predict tokens/s of the plain pipeline and both speculative schedules; recommend a split and draft length."""
    from dataclasses import replace

    from orchestrator.planning.search import recommend
    from orchestrator.planning.report import plan_json, plan_lines
    from orchestrator.planning.loaders import load_setup, read_profile, setup_from_profile
    from orchestrator.planning.simulation import DraftBehaviour

    if (setup_file is None) == (profile_path is None):
        raise click.UsageError("give a SETUP_FILE or --profile PROFILE.json")
    if bench_path is not None:
        if profile_path is None:
            raise click.UsageError("--bench needs --profile (the machine the bench ran on)")
        _plan_against_bench(profile_path, bench_path, as_json, cost_curve)
        return
    overrides = {name: value for name, value in (
        ("acceptance", acceptance), ("first_acceptance", first_acceptance),
        ("availability", availability), ("continuation", continuation)) if value is not None}
    if setup_file is not None:
        setup = load_setup(setup_file)
    else:
        setup = setup_from_profile(read_profile(profile_path), behaviour=None, drafter=drafter)
    if overrides and setup.behaviour is None and acceptance is None:
        raise click.UsageError("give --acceptance: the setup has no [draft] table to take it from")
    if overrides:
        setup = replace(setup, behaviour=replace(setup.behaviour or DraftBehaviour(acceptance), **overrides))
    if max_tokens is not None:
        setup = replace(setup, max_tokens=max_tokens)
    if draft_max is not None:
        setup = replace(setup, draft_lengths=(draft_max,))
    if setup.behaviour is not None and setup.draft_seconds is None:
        raise click.UsageError("speculation needs a draft cost: add a [draft] table to the setup")
    if cost_curve is not None:
        from orchestrator.planning.curves import under_curve

        setup = under_curve(setup, cost_curve_of(cost_curve), draft=setup_file is not None or drafter == "model")
    recommendation = recommend(setup)
    if as_json:
        click.echo(json.dumps(plan_json(setup, recommendation)))
        return
    for line in plan_lines(setup, recommendation):
        click.echo(line)


def _plan_against_bench(profile_path: Path, bench_path: Path, as_json: bool, cost_curve: str | None) -> None:
    """Every mode of a bench predicted beside its measurement; under the
    bench's own cost curve when it ran under one (--cost-curve overrides it)."""
    from dataclasses import asdict

    from orchestrator.planning.against_bench import predict_scenario
    from orchestrator.planning.loaders import read_profile

    profile = read_profile(profile_path)
    try:
        results = json.loads(bench_path.read_text())
        scenarios = results["scenarios"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise click.ClickException(f"{bench_path}: not a results.json written by orchestrate bench") from None
    spec = cost_curve or (results.get("cost_curve") or {}).get("spec")
    curve = cost_curve_of(spec)
    if curve is not None and not as_json:
        click.echo(f"emulated: {curve.name}")
    predictions = [prediction for scenario in scenarios
                   for prediction in predict_scenario(profile, scenario, curve=curve)]
    if as_json:
        click.echo(json.dumps([asdict(prediction) for prediction in predictions]))
        return

    def cell(prediction, value: float | None) -> str:
        return "-" if value is None else f"{value:.1f} ({prediction.error(value):+.0%})"

    click.echo(f"{'scenario':14s} {'mode':24s} {'measured':>9s} {'from rates':>16s} {'from trace':>16s}  (tokens/s)")
    for prediction in predictions:
        click.echo(f"{prediction.scenario:14s} {prediction.mode:24s} {prediction.measured:9.1f} "
                   f"{cell(prediction, prediction.from_rates):>16s} {cell(prediction, prediction.from_trace):>16s}")


if __name__ == "__main__":
    main()
