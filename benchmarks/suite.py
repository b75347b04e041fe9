"""`orchestrate bench`: every mode side by side on declared scenarios.

A scenario (a TOML file in benchmarks/scenarios/) names a model, how to split
it, the speculators to try, prompts, max tokens and repetitions. For each
scenario the modes run on the same prompts in the same run, in a rotating
order within each repetition after one warm-up run each:

* whole: llama-cpp-python's ``Llama`` on the unsplit model (the reference);
* whole-lookup: the same with its own ``LlamaPromptLookupDecoding``;
* pipeline: the plain split pipeline;
* spec-sync-KIND, spec-async-KIND: the pipeline with speculation, per kind;
* spec-sync-ngram-tree, spec-async-ngram-tree: prompt lookup drafting token
  trees (speculators.tree; up to the scenario's tree_leaves leaves), the rows that pay
  verified; spec-sync-ngram-tree-all: every candidate side row verified,
  whatever it costs (the same chains; what a tree adds per pass where rows
  are nearly free, and what the rule saves where they are not);
* spec-sync-model-tree, spec-async-model-tree: the draft model growing
  trees best-first (speculators.model_tree), sized on the pass curve
  measured at every width a tree may take (Pipeline.pass_curve);
* in a scenario that samples (``temperature`` above 0, ``seed``): the
  draft model drafts coupled (speculators.model_tree), and
  spec-sync-model-top, spec-sync-model-tree-top draft its top choices
  instead, for comparison; the whole model and llama.cpp's tools (greedy
  only) do not run, and every mode's tokens are compared with the
  pipeline's (the seeded run without speculation).

When a scenario has tree modes, every stage holds the tree's extra KV ids
(stages.engine: one unified stream) in every mode, so the modes share one
pipeline.

When `make peers` has built llama.cpp's own tools (benchmarks.peers), each
scenario also runs them on the same prompt tokens, one thread per part:

* cpp-whole: ``llama-server`` on the whole model;
* cpp-rpc-split (two-stage scenarios): ``llama-server`` with the last stage's
  blocks in a ``ggml-rpc-server`` on loopback, llama.cpp's layer split;
* cpp-lookup (scenarios with prompt lookup): ``llama-lookup``, asked for the
  reference's length (it does not stop at an end token); it prints text, so
  its output is compared as text (it may print a little more than asked).

Every run's tokens are compared with the reference's (greedy); a mode that
differs is flagged and makes the command fail. Methodology:
benchmarks/METHODOLOGY.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import timeline
from benchmarks.drafts import PREFIX, agreement, realistic_draft
from benchmarks.peers import built, lookup_completion, server_completion, servers
from benchmarks.reference import WholeModel
from benchmarks.scenarios import Scenario, prompts_of
from benchmarks.side_by_side import draft_steps
from orchestrator.cluster.drafter_set import start_drafter_set
from orchestrator.cluster.drafters import DrafterSettings, speculator_factory
from orchestrator.config import BENCH_CONTEXT, DRAFT_MAX, default_model_path
from orchestrator.decoding.drafting import SpeculationSettings, tree_stage_settings
from orchestrator.decoding.loop import generate
from orchestrator.decoding.schedule import Schedule
from orchestrator.decoding.stats import SpeculationStats
from orchestrator.planning.against_bench import parse_mode
from orchestrator.planning.simulation import DraftTrace
from speculators.prompt_lookup import PromptLookupSpeculator
from speculators.sampling import SamplingSettings
from stages.gguf_file import stage_info_of
from stages.settings import StageSettings
from stages.split import split_model


def peer_modes(scenario: Scenario) -> list[str]:
    """llama.cpp's own tools' modes for a scenario (benchmarks.peers), when they are built."""
    if not built():
        return []
    return ["cpp-whole"] + ["cpp-rpc-split"] * (scenario.stages == 2) + ["cpp-lookup"] * ("ngram" in scenario.speculators)


def speculative_modes(kinds: tuple[str, ...], sampled: bool = False) -> list[str]:
    modes = [f"spec-{schedule.value}-{kind}" for kind in kinds for schedule in (Schedule.SYNC, Schedule.ASYNC)]
    if "ngram" in kinds:
        modes += ["spec-sync-ngram-tree", "spec-async-ngram-tree", "spec-sync-ngram-tree-all"]
    if "model" in kinds:
        modes += ["spec-sync-model-tree", "spec-async-model-tree"]
        if sampled:
            modes += ["spec-sync-model-top", "spec-sync-model-tree-top"]
    return modes


@dataclass
class Run:
    """One mode on one prompt: what it produced and its figures."""

    mode: str
    prompt_index: int
    repetition: int
    tokens: list[int]
    tokens_per_second: float
    first_token_seconds: float
    seconds: float
    passes: int = 0
    speculation: SpeculationStats = field(default_factory=SpeculationStats)
    stage_seconds: list[float] = field(default_factory=list)
    drafter_seconds: float = 0.0
    discarded_seconds: list[float] = field(default_factory=list)  # of stage_seconds, on discarded passes
    timeline: dict | None = None  # benchmarks.timeline.record's
    text: str | None = None  # the output as text, where a tool prints text only (cpp-lookup)
    identical: bool | None = None  # set where the output is compared as text


def _stage_paths(scenario: Scenario, workdir: Path) -> tuple[str, list[str]]:

    model = str(default_model_path()) if scenario.model == "default" else scenario.model
    folder = workdir / f"{scenario.name}-stages"
    folder.mkdir(parents=True, exist_ok=True)
    count = len(scenario.boundaries) + 1 if scenario.boundaries else scenario.stages
    paths = [str(folder / f"stage-{index + 1}-of-{count}.gguf") for index in range(count)]
    split_model(model, paths, list(scenario.boundaries) if scenario.boundaries else None)
    return model, paths


def draft_of(scenario: Scenario, model: str, workdir: Path) -> str:
    """The draft model of a scenario: "default" the model itself (a check of
    the machinery: it agrees on every token), "requantized:TYPE" the model
    requantized (benchmarks.drafts: a draft of realistic agreement, made in
    ``workdir``), else a path."""
    if scenario.draft == "default":
        return model
    if scenario.draft.startswith(PREFIX):
        return realistic_draft(model, workdir, scenario.draft[len(PREFIX):])
    return scenario.draft


def run_scenario(
    scenario: Scenario, workdir: Path, progress: Callable[[int, int], None] | None = None, cost_curve=None
) -> dict:
    """Run every mode of a scenario; return its figures (see summarise).
    cost_curve: a stages.cost_curve.CostCurve every stage pass and draft-model
    step is held to (emulated figures), or None."""
    from orchestrator.cluster.pipeline_settings import PipelineSettings
    from stages.tokenizer import Tokenizer

    model, stage_paths = _stage_paths(scenario, workdir)
    modes = (["pipeline"] if scenario.sampled else ["whole", "whole-lookup", "pipeline"]) \
        + speculative_modes(scenario.speculators, scenario.sampled) + ([] if scenario.sampled else peer_modes(scenario))
    trees = any("-tree" in mode for mode in modes)
    settings = tree_stage_settings(StageSettings(n_ctx=BENCH_CONTEXT, threads=1, cost_curve=cost_curve),
                                   scenario.tree_leaves if trees else 1)
    sampling = SamplingSettings(temperature=scenario.temperature, seed=scenario.seed)
    tokenizer = Tokenizer(stage_paths[0])
    prompts = prompts_of(tokenizer, scenario)
    whole = WholeModel(model)
    whole_lookup = WholeModel(model, prompt_lookup_tokens=DRAFT_MAX)
    draft = draft_of(scenario, model, workdir)
    runs: list[Run] = []
    total = scenario.repetitions * len(prompts) * len(modes)
    texts = {tuple(prompt): tokenizer.chat_text([{"role": "user", "content": text}]) if scenario.chat else text
             for prompt, text in zip(prompts, scenario.prompts)}
    with contextlib.ExitStack() as peers_running, PipelineSettings(stage_paths, settings).start() as pipeline:
        peer_ports = {}
        if any(mode.startswith("cpp-") for mode in modes):
            folder = Path(peers_running.enter_context(tempfile.TemporaryDirectory()))
            remote = stage_info_of(stage_paths[-1]).block_count if "cpp-rpc-split" in modes else None
            peer_ports = peers_running.enter_context(servers(model, remote, folder, BENCH_CONTEXT))
            lengths = {tuple(prompt): max(1, len(whole.greedy(prompt, scenario.max_tokens).tokens)) for prompt in prompts}
        speculators = {kind: speculator_factory(SpeculationSettings(kind, draft if kind == "model" else None,
                                                                    tree_leaves=scenario.tree_leaves if trees else 1),
                                                tokenizer, settings)
                       for kind in scenario.speculators}
        sets = start_kinds(pipeline, speculators, scenario.draft_max)
        try:
            def run_mode(mode: str, prompt: list[int], max_tokens: int) -> Run:
                if mode in ("whole", "whole-lookup"):
                    run = (whole if mode == "whole" else whole_lookup).greedy(prompt, max_tokens)
                    return Run(mode, 0, 0, run.tokens, run.tokens_per_second, run.first_token_seconds, run.seconds)
                if mode.startswith("cpp-"):
                    return _peer_run(mode, prompt, max_tokens)
                drafting = None
                clients = []
                if mode.startswith("spec-"):
                    schedule, kind, tree = parse_mode(mode)
                    drafting = sets[kind].drafting(Schedule(schedule), scenario.draft_max,
                                                   step=steps[schedule == "async"],
                                                   tree_leaves=scenario.tree_leaves if tree else 1,
                                                   pass_curve=tree_curve if tree else None,
                                                   coupled=not mode.endswith("-top"))
                    if tree == "tree-all":  # side rows priced at nothing: every candidate is verified
                        drafting = dataclasses.replace(drafting, side_row_step=0.0)
                    clients = sets[kind].drafters
                # stages sharing this machine: one core while one pass runs at a time, else a core each
                pipeline.pin_stages(overlapping=mode.startswith("spec-async"))
                busy_before = sum(client.busy_seconds for client in clients)
                drafting, draft_times = timeline.timed(drafting)
                started = time.time()
                result = generate(pipeline, prompt, max_tokens, sampling, tokenizer.is_end, drafting=drafting)
                return Run(
                    mode, 0, 0, result.tokens, result.tokens_per_second, result.prefill_seconds, result.seconds,
                    result.passes, result.speculation, list(result.stage_seconds),
                    sum(client.busy_seconds for client in clients) - busy_before, list(result.discarded_seconds),
                    timeline.record(result, started, draft_times),
                )

            def _peer_run(mode: str, prompt: list[int], max_tokens: int) -> Run:
                if mode == "cpp-lookup":  # asked for the reference's length: it does not stop at an end token
                    text, rate, prompt_seconds = lookup_completion(
                        model, texts[tuple(prompt)], min(max_tokens, lengths[tuple(prompt)]), folder)
                    return Run(mode, 0, 0, [], rate, prompt_seconds, prompt_seconds, text=text)
                tokens, rate, prompt_seconds = server_completion(peer_ports[mode], prompt, max_tokens)
                if tokens and tokenizer.is_end(tokens[-1]):  # the server keeps the end token
                    tokens = tokens[:-1]
                seconds = prompt_seconds + (len(tokens) - 1) / rate if rate > 0 and tokens else prompt_seconds
                return Run(mode, 0, 0, tokens, rate, prompt_seconds, seconds)

            # what a wider pass costs here, measured once per scenario as a run measures it, per pinning
            steps = draft_steps(pipeline)
            pipeline.pin_stages(overlapping=False)
            # the one-token pass drafting is priced in, and the tree rule's curve, as a run measures them
            pass_seconds, _, tree_curve = pipeline.speculation_costs(trees)
            prices = {kind: drafter_set.measure_prices(pipeline, prompts[0], pass_seconds)
                      for kind, drafter_set in sets.items()}
            for mode in modes:  # warm-up
                run_mode(mode, prompts[0], 8)
            done = 0
            for repetition in range(scenario.repetitions):
                for index, prompt in enumerate(prompts):
                    shift = (repetition + index) % len(modes)
                    for mode in modes[shift:] + modes[:shift]:
                        run = run_mode(mode, prompt, scenario.max_tokens)
                        run.prompt_index, run.repetition = index, repetition
                        runs.append(run)
                        done += 1
                        if progress is not None:
                            progress(done, total)
            memory = {f"stage-{index}": rss for index, rss in enumerate(pipeline.peak_rss_mb())}
            for kind, drafter_set in sets.items():
                for client, rss in zip(drafter_set.drafters, peak_rss_of(drafter_set.drafters)):
                    memory[f"drafter-{client.index} ({kind})"] = rss
            hop_seconds = pipeline.hop_seconds
            # a drafter lost (and restarted) mid-run drafts nothing meanwhile: its figures say so
            lost = {kind: [{"index": client.index, "restarts": client.restarts_started, "lost": client.lost_reason}
                           for client in drafter_set.drafters if client.restarts_started or client.lost_reason]
                    for kind, drafter_set in sets.items()}
        finally:
            for drafter_set in sets.values():
                drafter_set.stop()
    references = {(run.repetition, run.prompt_index): run.tokens for run in runs if run.mode == reference_mode(scenario)}
    for run in runs:
        if run.mode == "cpp-lookup":  # its text must begin with the reference's
            reference_text = b"".join(tokenizer.piece(token) for token in references[(run.repetition, run.prompt_index)])
            run.identical = run.text is not None and run.text.startswith(reference_text.decode(errors="replace"))
    summary = summarise(scenario, modes, runs, len(stage_paths), hop_seconds, memory)
    summary.update(temperature=scenario.temperature, seed=scenario.seed, tree_leaves=scenario.tree_leaves)
    if tree_curve is not None:  # the widths the tree rule read, in one-token passes
        summary["tree_curve"] = {str(size): tree_curve.at(size) / tree_curve.at(1) for size in tree_curve.sizes}
    summary["stage_starts"] = [stage_info_of(path).first_block for path in stage_paths]
    summary["draft_max"] = scenario.draft_max
    summary["drafters_lost"] = {kind: entries for kind, entries in lost.items() if entries}
    summary["draft_step"] = {"sync": steps[False], "async": steps[True]}  # the draft policy's measured batch cost
    # per kind: what drafting a token costs, awaited and relayed, in one-token passes
    summary["draft_prices"] = {kind: {"awaited": price.awaited, "relayed": price.relayed} for kind, price in prices.items()}
    summary["draft_traces"] = draft_traces(scenario, prompts, runs)
    if "model" in scenario.speculators:  # the draft's per-token acceptance along the reference's text
        outputs = {run.prompt_index: run.tokens for run in runs
                   if run.mode == reference_mode(scenario) and run.repetition == 0}
        summary["draft"] = {"path": draft, "agreement": agreement(draft, [(prompt, outputs[index])
                                                                           for index, prompt in enumerate(prompts)])}
    return summary


def start_kinds(pipeline, speculators: dict, draft_max: int = DRAFT_MAX) -> dict:
    """A DrafterSet beside the stages for each speculator kind, named apart by kind."""

    return {kind: start_drafter_set(pipeline, kind, make, DrafterSettings(draft_max=draft_max), named=True)
            for kind, make in speculators.items()}


def reference_mode(scenario: Scenario) -> str:
    """The mode every other's tokens must equal: the whole model (greedy), or
    in a sampled scenario the pipeline without speculation (the seeded run)."""
    return "pipeline" if scenario.sampled else "whole"


def draft_traces(scenario: Scenario, prompts: list[list[int]], runs: list[Run]) -> dict[str, list[str]]:
    """For prompt lookup, per prompt: what it proposes for each token of the
    whole model's output given the true text before it (simulation.DraftTrace,
    as text, with its other candidates for the trees). The planner replays
    these to predict the speculative modes."""

    if "ngram" not in scenario.speculators:
        return {}
    outputs = {run.prompt_index: run.tokens for run in runs
               if run.mode == reference_mode(scenario) and run.repetition == 0}
    lookup = PromptLookupSpeculator()
    return {"ngram": [DraftTrace.replay(lookup.extend, prompt, outputs[index], lookup.candidates).as_text()
                      for index, prompt in enumerate(prompts)]}


def peak_rss_of(clients) -> list[float | None]:
    import ray

    values: list[float | None] = []
    for client in clients:
        try:
            values.append(ray.get(client.actor.peak_rss_mb.remote(), timeout=30) if client.actor else None)
        except ray.exceptions.RayError:
            values.append(None)
    return values


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def draft_behaviour(stats: SpeculationStats) -> dict[str, float | None]:
    """The planner's draft statistics (None where nothing was drafted)."""
    if not stats.waited_calls:
        return {"acceptance_first": None, "acceptance_later": None, "draft_availability": None, "draft_continuation": None}
    return {"acceptance_first": stats.acceptance_first, "acceptance_later": stats.acceptance_later,
            "draft_availability": stats.draft_availability, "draft_continuation": stats.draft_continuation}


def _share(part: float, whole: float) -> float:
    return part / whole if whole > 0 else 0.0


def summarise(scenario: Scenario, modes: list[str], runs: list[Run], stage_count: int, hop_seconds: float,
              memory: dict[str, float | None]) -> dict:
    """Per-mode figures; ratios are taken per (repetition, prompt) pair, then the median."""
    reference = {(run.repetition, run.prompt_index): run for run in runs if run.mode == reference_mode(scenario)}
    by_pair = {(run.mode, run.repetition, run.prompt_index): run for run in runs}
    rows = []
    for mode in modes:
        mode_runs = [run for run in runs if run.mode == mode]
        rates = [run.tokens_per_second for run in mode_runs]

        def ratio_to(other: str) -> float:
            ratios = [run.tokens_per_second / by_pair[(other, run.repetition, run.prompt_index)].tokens_per_second
                      for run in mode_runs if by_pair[(other, run.repetition, run.prompt_index)].tokens_per_second > 0]
            return _median(ratios)

        tokens = sum(len(run.tokens) for run in mode_runs)
        seconds = sum(run.seconds for run in mode_runs)
        stats = sum((run.speculation for run in mode_runs), SpeculationStats())
        pipelined = mode == "pipeline" or mode.startswith("spec-")
        rows.append({
            "mode": mode,
            "runs": len(mode_runs),
            "mean_tokens": tokens / len(mode_runs) if mode_runs else 0.0,
            "tokens_per_second": {"median": _median(rates), "min": min(rates), "max": max(rates)},
            "time_to_first_token_ms": _median([run.first_token_seconds * 1e3 for run in mode_runs]),
            "ratio_to_pipeline": ratio_to("pipeline"),
            "ratio_to_whole": None if scenario.sampled else ratio_to("whole"),
            "identical": all(run.identical if run.identical is not None
                             else run.tokens == reference[(run.repetition, run.prompt_index)].tokens for run in mode_runs),
            "target_passes_per_token": sum(run.passes for run in mode_runs) / tokens if pipelined and tokens else None,
            "acceptance_rate": stats.acceptance_rate if stats.drafted_tokens else None,
            # of the windows that rejected a draft, the share after which a correction drafted meanwhile
            # was the next window's speculation at once (a draft model's async drafting: Drafting.corrects)
            "rejections_corrected": (stats.corrected_windows / stats.rejected_passes
                                     if mode.startswith("spec-") and stats.rejected_passes else None),
            # tokens a verified pass committed (chain against tree), and the trees among those passes
            "committed_per_pass": stats.committed_per_window if mode.startswith("spec-") else None,
            "tree_passes": stats.tree_passes,
            "tree_side_rows": stats.side_rows,
            "tree_side_accepted": stats.side_accepted,
            # The planner's inputs (orchestrator.decoding.stats.SpeculationStats explains them).
            **draft_behaviour(stats),
            "accepted_length_histogram": {str(length): count for length, count in sorted(stats.accepted_lengths.items())},
            "stage_busy_fraction": [sum(run.stage_seconds[index] for run in mode_runs) / seconds
                                    for index in range(stage_count)] if pipelined and seconds else None,
            # of that busy time, the share on passes whose result was discarded (or cancelled)
            "stage_discarded_share": [_share(sum(run.discarded_seconds[index] for run in mode_runs if run.discarded_seconds),
                                             sum(run.stage_seconds[index] for run in mode_runs))
                                      for index in range(stage_count)] if pipelined and seconds else None,
            # where the time went in the first prompt's first repetition (benchmarks.timeline)
            "timeline": next((run.timeline for run in mode_runs if (run.repetition, run.prompt_index) == (0, 0)), None),
            "drafter_busy_fraction": (sum(run.drafter_seconds for run in mode_runs) / seconds / stage_count
                                      if mode.startswith("spec-") and seconds else None),
        })
    return {
        "scenario": scenario.name,
        "description": scenario.description,
        "stages": stage_count,
        "threads_per_process": 1,
        "repetitions": scenario.repetitions,
        "prompts": len(scenario.prompts),
        "max_tokens": scenario.max_tokens,
        "hop_microseconds": hop_seconds * 1e6,
        "peak_rss_mb": memory,
        "modes": rows,
    }
