"""The capacity planner: schedule simulation, cost models, split search. Pure Python."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from orchestrator.planning.costs import BatchCurve, Link, Machine, ModelShape, Software, StageCosts
from orchestrator.planning.search import candidate_splits, recommend
from orchestrator.planning.inputs import PlanError, Setup
from orchestrator.planning.simulation import (
    DraftBehaviour,
    DraftTrace,
    Mode,
    pass_step,
    predict,
    simulate,
    simulate_many,
)
from speculators.draft_length import PRIOR_STEP
from speculators.sampling import SamplingSettings
from orchestrator.planning.costs import split_costs


@dataclass(frozen=True)
class FlatCosts:
    """Every stage costs base + per_token * tokens; hops and the coordinator are constant."""

    stage_count: int
    base: float = 0.010
    per_token: float = 0.001
    hop: float = 0.0002
    coordinator: float = 0.0003
    draft: float = 0.0
    shared_host: bool = False  # all stages on one single-core host

    def stage_seconds(self, stage: int, tokens: int) -> float:
        return self.base + self.per_token * tokens

    def hop_seconds(self, hop: int, tokens: int) -> float:
        return self.hop

    def coordinator_seconds(self, tokens: int) -> float:
        return self.coordinator

    def draft_seconds(self, machine: int) -> float:
        return self.draft

    def draft_call_seconds(self) -> float:
        return 0.0

    def host(self, stage: int) -> int:
        return 0 if self.shared_host else stage

    def parallel_stages(self, host: int) -> int:
        return 1


def test_plain_pipeline_costs_every_stage_hop_and_coordinator_per_token():
    costs = FlatCosts(stage_count=3)
    run = simulate(costs, Mode("plain"), DraftBehaviour(0.0), max_tokens=50)
    per_token = 3 * (costs.base + costs.per_token) + 4 * costs.hop + costs.coordinator
    assert run.passes == 49 and run.drafted_tokens == 0
    assert run.tokens_per_second == pytest.approx(1 / per_token)


def test_sync_speculation_with_perfect_drafts_grows_to_draft_max_plus_one_per_pass():
    costs = FlatCosts(stage_count=2)
    run = simulate(costs, Mode("sync", draft_max=4), DraftBehaviour(1.0), max_tokens=101)
    # the draft policy starts at one draft and grows as drafts are accepted: windows of
    # 1 and 2 drafts, then the maximum 4: 2 + 3 + 19 x 5 = the 100 tokens after the first
    assert run.passes == 21
    assert run.accepted_tokens == run.drafted_tokens == 1 + 2 + 19 * 4
    plain = simulate(costs, Mode("plain"), DraftBehaviour(1.0), max_tokens=101)
    assert run.tokens_per_second > 3 * plain.tokens_per_second


def test_wrong_drafts_make_speculation_slower_than_plain():
    costs = FlatCosts(stage_count=2)
    wrong = predict(costs, Mode("sync", 8), DraftBehaviour(0.0), max_tokens=64, runs=4)
    plain = predict(costs, Mode("plain"), DraftBehaviour(0.0), max_tokens=64, runs=4)
    assert wrong.acceptance_rate == 0.0
    assert wrong.passes_per_token == pytest.approx(plain.passes_per_token)
    # the adaptive limit falls to one draft a pass: each pass is a 2-token batch
    assert wrong.tokens_per_second < plain.tokens_per_second


def test_async_pipelines_passes_when_drafts_are_right():
    """With every draft right, async starts the next window while the first is in
    flight: stage 0 and stage 1 work at once, which sync never does."""
    costs = FlatCosts(stage_count=2)
    sync = simulate(costs, Mode("sync", 4), DraftBehaviour(1.0), max_tokens=201)
    asynchronous = simulate(costs, Mode("async", 4), DraftBehaviour(1.0), max_tokens=201)
    assert asynchronous.discarded_passes == 0
    assert asynchronous.tokens_per_second > 1.5 * sync.tokens_per_second
    assert min(asynchronous.stage_busy_seconds) / asynchronous.seconds > 0.8


def test_stages_sharing_one_core_cannot_pipeline():
    separate = simulate(FlatCosts(2), Mode("async", 4), DraftBehaviour(1.0), max_tokens=201)
    shared = simulate(FlatCosts(2, shared_host=True), Mode("async", 4), DraftBehaviour(1.0), max_tokens=201)
    sync = simulate(FlatCosts(2), Mode("sync", 4), DraftBehaviour(1.0), max_tokens=201)
    assert shared.passes == separate.passes
    assert sum(shared.stage_busy_seconds) <= shared.seconds  # never two stages at once
    assert shared.tokens_per_second < 0.7 * separate.tokens_per_second
    assert shared.tokens_per_second < 1.2 * sync.tokens_per_second  # only hops and the coordinator overlap


def test_first_acceptance_applies_to_the_first_draft_of_a_fresh_speculation():
    costs = FlatCosts(stage_count=2)
    never_first = simulate(costs, Mode("sync", 4), DraftBehaviour(1.0, first_acceptance=0.0), max_tokens=50)
    assert never_first.accepted_tokens == 0 and never_first.passes == 49
    always = simulate(costs, Mode("sync", 4), DraftBehaviour(0.0, first_acceptance=1.0), max_tokens=51)
    assert always.accepted_tokens == always.passes  # exactly the first draft of each pass


def test_async_discards_passes_started_on_failed_speculation():
    costs = FlatCosts(stage_count=2)
    run = simulate(costs, Mode("async", 4), DraftBehaviour(0.8), max_tokens=300, seed=3)
    assert run.discarded_passes > 0
    assert run.tokens == 300


def test_slow_drafter_costs_sync_its_drafting_time():
    fast = simulate(FlatCosts(2), Mode("sync", 4), DraftBehaviour(1.0), max_tokens=101)
    slow = simulate(FlatCosts(2, draft=0.002), Mode("sync", 4), DraftBehaviour(1.0), max_tokens=101)
    assert slow.drafted_tokens == fast.drafted_tokens == 79  # the same windows; the drafter drafts what a window takes
    assert slow.seconds == pytest.approx(fast.seconds + 79 * 0.002)


@pytest.mark.parametrize("draft", [0.01, 0.02, 0.05])
def test_no_drafter_drafts_faster_than_its_cost_per_token(draft):
    """Async drafts a lone sequence on the drafter beside stage 0, before a
    window and while its passes run, one token per ``draft`` seconds, so beyond
    the drafts made during the prompt's pass (draft_max, not simulated) it
    cannot have drafted more than seconds / draft tokens. A simulation that let async drafting
    be instant predicts several times the throughput and breaks this bound."""
    draft_max = 4
    run = simulate(FlatCosts(2, draft=draft), Mode("async", draft_max), DraftBehaviour(1.0), max_tokens=201)
    assert run.tokens == 201
    assert run.drafted_tokens - draft_max <= run.seconds / draft


def test_async_throughput_falls_as_drafting_gets_slower_than_a_stage():
    """A stage pass here takes about 15 ms: drafters at 5, 10, 20 then 50 ms a
    token draft less and less within it, and the prediction must fall each time."""
    speeds = [simulate(FlatCosts(2, draft=draft), Mode("async", 4), DraftBehaviour(1.0), max_tokens=201).tokens_per_second
              for draft in (0.0, 0.005, 0.01, 0.02, 0.05)]
    assert speeds == sorted(speeds, reverse=True) and len(set(speeds)) == len(speeds), speeds


def test_availability_and_continuation_set_draft_lengths():
    nothing = simulate(FlatCosts(2), Mode("sync", 8), DraftBehaviour(1.0, availability=0.0), max_tokens=40)
    assert nothing.drafted_tokens == 0 and nothing.passes == 39
    single = simulate(FlatCosts(2), Mode("sync", 8), DraftBehaviour(1.0, availability=1.0, continuation=0.0),
                      max_tokens=41)
    assert single.drafted_tokens == single.passes == 20  # one draft a pass, always accepted


def test_a_trace_replays_what_the_drafter_proposed_and_ends_where_the_text_ended():
    # proposals for tokens 1-8 right, nothing for 9, 10-14 right, 15 wrong, 16-19 right; the text ends at 20
    trace = DraftTrace((None,) + (True,) * 8 + (None,) + (True,) * 5 + (False,) + (True,) * 4)
    run = simulate(FlatCosts(2), Mode("sync", 8, step=PRIOR_STEP), trace, max_tokens=64)
    # the draft policy (its prior batch cost) grows the window as drafts are accepted (1, 2, 5, then 8):
    # pass 1: draft 1, accepted, the target adds 2; pass 2: drafts 3-4, accepted, the target adds 5;
    # pass 3: drafts 6-8 (nothing is proposed for 9), accepted, the target adds 9;
    # pass 4: drafts 10-17 (wrong from 15 on), accepts 10-14, the target adds 15;
    # pass 5: drafts 16-19 (nothing is proposed past the end), all accepted: the text is done
    assert run.tokens == 20
    assert run.passes == 5
    assert run.drafted_tokens == 1 + 2 + 3 + 8 + 4 and run.accepted_tokens == 1 + 2 + 3 + 5 + 4


def test_batch_curve_interpolates_and_extends_linearly():
    curve = BatchCurve((1, 2, 4), (1.0, 1.5, 2.5))
    assert curve.at(1) == 1.0 and curve.at(3) == 2.0 and curve.at(8) == 4.5
    with pytest.raises(ValueError):
        BatchCurve((2, 1), (1.0, 1.0))


def test_profile_split_recovers_block_head_and_fixed_costs():
    fixed, block, head = 0.002, 0.0005, 0.004
    stages = [
        {"first_block": 0, "end_block": 10, "seconds": [fixed + 10 * block]},
        {"first_block": 10, "end_block": 30, "seconds": [fixed + 20 * block + head]},
    ]
    whole = {"seconds": [fixed + 30 * block + head]}
    derived = split_costs(stages, whole)
    assert derived["fixed_seconds"][0] == pytest.approx(fixed)
    assert derived["block_seconds"][0] == pytest.approx(block)
    assert derived["head_seconds"][0] == pytest.approx(head)


def _shape(blocks: int = 10) -> ModelShape:
    return ModelShape.from_parameters("test", blocks=blocks, width=1024, vocab=32000, parameters=2e9,
                                      bits_per_weight=8, kv_heads_width=256)


def test_roofline_machine_reads_weights_once_per_pass_until_compute_bound():
    shape = _shape()
    machine = Machine("m", 64e9, bytes_per_second=100e9, flops_per_second=10e12)
    one = machine.stage_seconds(shape, 0, 5, 1)
    assert one == pytest.approx(shape.stage_bytes(0, 5) / 100e9)
    assert machine.stage_seconds(shape, 0, 5, 4) == pytest.approx(one)  # still memory-bound
    flops = 2 * 5 * shape.block_parameters * 4096
    assert machine.stage_seconds(shape, 0, 5, 4096) == pytest.approx(flops / 10e12)  # compute-bound


def test_links_carry_activations_and_the_chosen_tokens_back():
    """The last stage chooses the tokens (TokenChoice): one int32 per row comes back, not a logits row."""
    shape = _shape()
    link = Link(latency_seconds=0.001, bytes_per_second=1e9)
    software = Software(0.0001, 0.0, 0.0)
    machine = Machine("m", 64e9, 100e9, 10e12)
    costs = StageCosts(shape, [machine, machine], (0, 5), [link, link], software, (0.0, 0.0))
    assert costs.hop_seconds(0, 8) == pytest.approx(0.0001)
    assert costs.hop_seconds(1, 8) == pytest.approx(0.0001 + 0.001 + 8 * 1024 * 4 / 1e9)
    assert costs.hop_seconds(2, 8) == pytest.approx(0.0001 + 0.001 + 8 * 4 / 1e9)


def test_candidate_splits_cover_every_split_once():
    assert candidate_splits(4, 2, 1) == [(0, 1), (0, 2), (0, 3)]
    assert len(candidate_splits(10, 3, 1)) == math.comb(9, 2)


def _setup(memories: list[float], blocks: int = 10) -> Setup:
    machines = [Machine(f"m{index}", memory, 100e9, 10e12) for index, memory in enumerate(memories)]
    return Setup(_shape(blocks), machines, [Link(0.0001, 1e9)] * len(machines), Software(0.0001, 0.0001, 0.0),
                 DraftBehaviour(0.8), draft_seconds=[0.0005] * len(machines), context=256, max_tokens=64)


def test_recommendation_respects_each_machines_memory():
    # 2e9 parameters at 8 bits: ~0.19 GB a block; the first machine holds at most 2 blocks and the embedding
    small = _setup([0.6e9, 64e9])
    recommendation = recommend(small)
    assert recommendation.blocks_per_machine[0] <= 2
    assert all(need <= 0.9 * machine.memory_bytes
               for need, machine in zip(recommendation.memory_needed, small.machines))
    assert set(recommendation.predictions) == {"plain", "sync", "async"}


def test_a_model_that_fits_nowhere_is_refused():
    with pytest.raises(PlanError, match="does not fit"):
        recommend(_setup([0.5e9, 0.5e9]))


def test_importing_the_planner_loads_neither_ray_nor_llama_cpp():
    import subprocess
    import sys

    code = (
        "import sys, orchestrator.planning.simulation, orchestrator.planning.search, "
        "orchestrator.planning.costs, orchestrator.planning.report;"
        "print('ray' in sys.modules, 'llama_cpp' in sys.modules)"
    )
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert output.split() == ["False", "False"]


TRACES = [
    ".RRRRRRRRRRRRRRRRRRRRRRRRRRRRw..RRRRRRRRRRRRRRRRRRRRRRRRRRRRRRR",
    ".....................Rw..............w......RRw.RRRRRRRRRRwRRRRRR",
    ".RRRRRRRRRRRRRRRRRRRw..RRRRRRR",
]
END_TOKEN = 2


def _real_loop(schedule: str, texts: list[str], draft_max: int = 6):
    """generate_many() against an instant target, each sequence with drafters
    replaying its trace; returns the generations and the passes submitted."""
    from fakes import TraceDrafter, truth_target
    from orchestrator.decoding.drafting import Drafting
    from orchestrator.decoding.loop import Request, generate_many
    from orchestrator.decoding.schedule import Schedule

    requests, truths = [], []
    for index, text in enumerate(texts):
        trace = DraftTrace.from_text(text)
        prompt = [5, 6, 7, 5, 6 + index]
        # drafts may run past the end of the text
        truth = prompt + [10 + 100 * index + position for position in range(trace.end)] + [END_TOKEN] + [3] * 20
        drafters = [TraceDrafter(truth, len(prompt), trace, draft_max) for _ in range(2)]
        # the step the simulation takes from FlatCosts(2), as a run measures its own
        drafting = Drafting(drafters, Schedule(schedule), draft_max, step=pass_step(FlatCosts(2)))
        requests.append(Request(prompt, 200, SamplingSettings(), drafting))
        truths.append(truth)
    target = truth_target(truths)
    generations = generate_many(target, requests, lambda token: token == END_TOKEN)
    for generation, truth, text in zip(generations, truths, texts):
        prompt_length = len(generation.prompt_tokens)
        assert generation.tokens == truth[prompt_length : prompt_length + DraftTrace.from_text(text).end]
    return generations, target.submitted


def test_drafters_are_never_asked_past_the_tokens_a_request_may_still_produce():
    """The speculation budget in the loop: every ask of a drafter while a pass runs names
    at most the tokens still wanted after its context (the last one the target's own)."""
    from fakes import TraceDrafter, truth_target
    from orchestrator.decoding.drafting import Drafting
    from orchestrator.decoding.loop import Request, generate_many
    from orchestrator.decoding.schedule import Schedule

    class Asked(TraceDrafter):
        asks: list[tuple[int, int | None]] = []

        def speculate(self, context, most=None, sampling=None, tree=None):
            self.asks.append((len(context), most))
            super().speculate(context, most, sampling, tree)

    trace, prompt, max_tokens = DraftTrace.from_text(TRACES[0]), [5, 6, 7, 5, 6], 12
    truth = prompt + [10 + position for position in range(trace.end)] + [END_TOKEN]
    drafters = [Asked(truth, len(prompt), trace, 6) for _ in range(2)]
    drafting = Drafting(drafters, Schedule.ASYNC, 6, step=pass_step(FlatCosts(2)))
    (generation,) = generate_many(truth_target([truth]), [Request(prompt, max_tokens, SamplingSettings(), drafting)],
                                  lambda token: token == END_TOKEN)
    assert generation.tokens == truth[len(prompt):len(prompt) + max_tokens]
    assert Asked.asks and all(most is not None and length + most <= len(prompt) + max_tokens - 1
                              for length, most in Asked.asks), Asked.asks
    assert any(most < 6 for _, most in Asked.asks)  # the budget, not draft_max, bounded some asks


def _assert_same_decisions(real, simulated) -> None:
    stats = real.speculation
    assert simulated.tokens == len(real.tokens)
    assert (simulated.passes, simulated.discarded_passes) == (real.passes, stats.discarded_passes)
    assert (simulated.drafted_tokens, simulated.accepted_tokens) == (stats.drafted_tokens, stats.accepted_tokens)


@pytest.mark.parametrize("schedule", ["sync", "async"])
@pytest.mark.parametrize("text", TRACES)
def test_the_simulation_makes_the_same_passes_as_the_real_loop(schedule, text):
    """generate() against an instant target and drafters replaying a trace, beside
    simulate() on the same trace: the same passes, drafts, acceptances and discards."""
    (real,), _ = _real_loop(schedule, [text])
    _assert_same_decisions(real, simulate(FlatCosts(2), Mode(schedule, 6), DraftTrace.from_text(text), max_tokens=200))


@pytest.mark.parametrize("schedule", ["sync", "async"])
def test_two_sequences_interleaved_make_the_same_passes_in_the_real_loop_and_the_simulation(schedule):
    """Two sequences decoded at once share passes; each makes the same decisions
    in generate_many() as in simulate_many()."""
    texts = TRACES[:2]
    generations, submitted = _real_loop(schedule, texts)
    assert any(len(target_pass.windows) == 2 for target_pass in submitted)  # really interleaved
    simulated = simulate_many(FlatCosts(2), Mode(schedule, 6), [DraftTrace.from_text(text) for text in texts],
                              max_tokens=200)
    for real, run in zip(generations, simulated):
        _assert_same_decisions(real, run)
    for text, run in zip(texts, simulated):  # sharing passes changes no sequence's decisions
        alone = simulate(FlatCosts(2), Mode(schedule, 6), DraftTrace.from_text(text), max_tokens=200)
        assert (alone.passes, alone.discarded_passes, alone.drafted_tokens, alone.accepted_tokens) == \
            (run.passes, run.discarded_passes, run.drafted_tokens, run.accepted_tokens)


def test_bench_draft_statistics_count_first_and_later_tokens_apart():
    from orchestrator.decoding.stats import SpeculationStats

    # passes: 4 drafted; 3 accepted their first draft; 7 accepted in all; 2 rejections
    # (one at a first draft, one later); drafting: 5 awaited calls, 4 brought tokens,
    # 10 tokens, 2 stopped early (the empty one, and one after 2 tokens)
    stats = SpeculationStats(drafted_tokens=10, accepted_tokens=7, rejected_passes=2, drafted_passes=4,
                             first_accepted_passes=3, waited_calls=5, waited_nonempty=4, waited_tokens=10,
                             waited_stops=2)
    assert stats.acceptance_first == 3 / 4
    assert stats.acceptance_later == 4 / 5  # 4 later acceptances, 1 later rejection
    assert stats.draft_availability == 4 / 5
    assert stats.draft_continuation == 6 / 7  # 6 tokens after a first one, 1 stop after a token


@pytest.mark.parametrize("arguments", [["--help"], ["plan", "--help"],
                                       ["plan", "benchmarks/setups/llama-405b-two-machines.toml", "--draft-max", "4",
                                        "--max-tokens", "16"]])
def test_orchestrate_plan_and_help_load_neither_ray_nor_llama_cpp(arguments):
    """The command line imports what each command uses: planning needs neither."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys; from orchestrator.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit as end:\n    assert not end.code, end.code\n"
        "print('LOADED', 'ray' in sys.modules, 'llama_cpp' in sys.modules)"
    )
    output = subprocess.run([sys.executable, "-c", code, *arguments], capture_output=True, text=True, check=True,
                            cwd=Path(__file__).parents[2]).stdout
    assert output.splitlines()[-1] == "LOADED False False"


class TimedCosts(FlatCosts):
    """Whole seconds: every stage 1 s a pass, hops ``hop`` (a one-token hop: ``small_hop``)."""

    def __init__(self, stage_count, hop=0.0, small_hop=0.0, shared_host=False):
        super().__init__(stage_count, base=1.0, per_token=0.0, hop=hop, shared_host=shared_host)
        object.__setattr__(self, "small_hop", small_hop)

    def hop_seconds(self, hop: int, tokens: int) -> float:
        return self.small_hop if tokens == 1 else self.hop


def test_a_cancelled_pass_stops_where_it_runs_and_is_skipped_where_it_has_not_started():
    from orchestrator.planning.simulation import _Stages

    stages = _Stages(TimedCosts(3, small_hop=0.125))
    first = stages.run(0.0, tokens=4)  # stage 0 [0, 1], stage 1 [1, 2], stage 2 [2, 3]
    second = stages.run(0.0, tokens=4)  # stage 0 [1, 2], stage 1 [2, 3], stage 2 [3, 4]
    assert (first.boundaries, second.boundaries, second.result) == ([1, 2, 3], [2, 3, 4], 4)
    assert stages.cancel(first, 1.5) is first  # only the pass submitted last is cancelled
    cancelled = stages.cancel(second, 2.5)  # done by stage 0, stopped in stage 1, skipped by stage 2
    # stage 2 is busy with the first pass until 3, then hands the cancellation on
    assert cancelled.boundaries == [2, 2.5, 3] and cancelled.result == 3.125
    assert stages.busy == [2, 1.5, 1] and stages.free_at == [2, 2.5, 3]
    assert stages.cancel(cancelled, 2.75) is cancelled  # once
    after = stages.run(3.0, tokens=4)
    assert after.boundaries == [4, 5, 6]


def test_a_cancelled_pass_gives_back_the_core_it_shared_with_the_stage_before():
    from orchestrator.planning.simulation import _Stages

    stages = _Stages(TimedCosts(2, shared_host=True))  # one core for both stages
    stages.run(0.0, tokens=4)  # [0, 1] then [1, 2]
    second = stages.run(0.0, tokens=4)  # [2, 3] then [3, 4]
    cancelled = stages.cancel(second, 1.5)  # neither stage had started it
    assert cancelled.boundaries == [1.5, 2] and cancelled.result == 2
    assert stages.busy == [1, 1] and stages.free_at == [1, 2]
    assert stages.run(2.0, tokens=4).boundaries == [3, 4]  # the core is free again at 2


def test_a_pass_done_before_its_cancel_comes_is_unchanged():
    from orchestrator.planning.simulation import _Stages

    stages = _Stages(TimedCosts(2))
    only = stages.run(0.0, tokens=4)
    assert stages.cancel(only, 2.0) is only and stages.busy == [1, 1]


def test_async_through_three_stages_gains_by_cancelling_the_passes_a_rejection_invalidates(monkeypatch):
    from orchestrator.planning import simulation

    costs, mode, behaviour = FlatCosts(stage_count=3), Mode("async", 4), DraftBehaviour(0.6)
    cancelling = simulate(costs, mode, behaviour, max_tokens=200, seed=5)
    monkeypatch.setattr(simulation._Stages, "cancel", lambda stages, timeline, at: timeline)
    running_on = simulate(costs, mode, behaviour, max_tokens=200, seed=5)
    assert cancelling.discarded_passes == running_on.discarded_passes > 0  # the same decisions
    assert cancelling.passes == running_on.passes
    assert sum(cancelling.stage_busy_seconds) < sum(running_on.stage_busy_seconds)
    assert cancelling.seconds < running_on.seconds


def test_the_simulated_draft_policy_prices_a_wider_pass_from_the_costs_as_a_run_measures_it():
    costs = FlatCosts(2)  # a pass of n tokens: 3 hops of 0.2 ms and 2 stages of 10 + n ms
    one, eight = 3 * 0.0002 + 2 * 0.011, 3 * 0.0002 + 2 * 0.018
    assert pass_step(costs) == pytest.approx((eight / one - 1) / 7)
    behaviour = DraftBehaviour(0.6)
    computed = simulate(costs, Mode("sync", 6), behaviour, max_tokens=120, seed=2)
    given = simulate(costs, Mode("sync", 6, step=pass_step(costs)), behaviour, max_tokens=120, seed=2)
    dear = simulate(costs, Mode("sync", 6, step=2.0), behaviour, max_tokens=120, seed=2)
    assert (computed.passes, computed.drafted_tokens) == (given.passes, given.drafted_tokens)
    assert dear.drafted_tokens < computed.drafted_tokens  # a dear wider pass is drafted for less


def test_a_simulation_of_fewer_than_two_tokens_is_refused():
    # it starts at the first generated token: with max_tokens 1 it would never end
    for max_tokens in (1, 0):
        with pytest.raises(ValueError, match=rf"^max_tokens must be at least 2, not {max_tokens}$"):
            simulate(FlatCosts(2), Mode("sync", 4), DraftBehaviour(0.5), max_tokens=max_tokens)


def test_a_cancel_at_the_moment_a_stage_hands_the_pass_on_finds_it_done_there_and_unstarted_next():
    from orchestrator.planning.simulation import _Stages

    stages = _Stages(TimedCosts(3, small_hop=0.125))
    only = stages.run(0.0, tokens=4)  # [0, 1], [1, 2], [2, 3]
    cancelled = stages.cancel(only, 1.0)  # stage 0 ended at 1.0, stage 1 starts at 1.0: skipped, not stopped
    assert cancelled.boundaries == [1, 1, 1.125] and cancelled.result == 1.25
    assert stages.busy == [1, 0, 0] and stages.free_at == [1, 0, 0]


class HopByIndexCosts(TimedCosts):
    """One-token hops that cost more the further down the chain: hop i takes i / 8 s."""

    def hop_seconds(self, hop: int, tokens: int) -> float:
        return hop / 8 if tokens == 1 else 0.0


def test_a_cancellation_travels_on_at_the_cost_of_each_hop_after_the_stage_that_dropped_it():
    from orchestrator.planning.simulation import _Stages

    stages = _Stages(HopByIndexCosts(3))
    only = stages.run(0.0, tokens=4)  # [0, 1], [1, 2], [2, 3]
    cancelled = stages.cancel(only, 0.5)  # stopped in stage 0, then hops 1, 2 and 3
    assert cancelled.boundaries == [0.5, 0.625, 0.875] and cancelled.result == 0.875 + 3 / 8


class StepAtNine(FlatCosts):
    """A pass of up to 8 tokens costs what one does; from 9 on, twice that."""

    def stage_seconds(self, stage: int, tokens: int) -> float:
        return 0.01 if tokens <= 8 else 0.02

    def hop_seconds(self, hop: int, tokens: int) -> float:
        return 0.0


def test_the_simulated_step_compares_passes_of_one_and_of_eight_tokens_as_a_run_does():
    assert pass_step(StepAtNine(2)) == 0.0
    assert pass_step(StepAtNine(2), batch=9) == pytest.approx(1 / 8)


def _with_forks(text: str) -> str:
    """A trace with prompt lookup's other candidates: a right one where the
    first candidate is wrong, two wrong ones at every seventh position, none elsewhere."""
    forks = "".join("a" if symbol == "w" else "2" if position % 7 == 4 else "0" for position, symbol in enumerate(text))
    return f"{text}|{forks}"


@pytest.mark.parametrize("schedule", ["sync", "async"])
@pytest.mark.parametrize("text", TRACES[:2])
def test_the_simulation_makes_the_same_tree_passes_as_the_real_loop(schedule, text):
    """Token trees (step 0: every candidate row verified): generate() with a
    drafter replaying the trace's forks against simulate() on the same trace."""
    from fakes import TraceTreeDrafter, truth_target
    from orchestrator.decoding.drafting import Drafting
    from orchestrator.decoding.loop import generate
    from orchestrator.decoding.schedule import Schedule

    traced = _with_forks(text)
    trace = DraftTrace.from_text(traced)
    assert DraftTrace.from_text(trace.as_text()) == trace
    prompt = [5, 6, 7, 5, 6]
    truth = prompt + [10 + position for position in range(trace.end)] + [END_TOKEN] + [3] * 20
    drafters = [TraceTreeDrafter(truth, len(prompt), trace, 6) for _ in range(2)]
    drafting = Drafting(drafters, Schedule(schedule), 6, step=0.0, tree_leaves=4)
    real = generate(truth_target([truth]), prompt, 200, SamplingSettings(), lambda token: token == END_TOKEN,
                    drafting=drafting)
    assert real.tokens == truth[len(prompt): len(prompt) + trace.end]
    simulated = simulate(FlatCosts(2), Mode(schedule, 6, step=0.0, tree_leaves=4), trace, max_tokens=200)
    _assert_same_decisions(real, simulated)
    stats = real.speculation
    assert (simulated.tree_passes, simulated.side_accepted) == (stats.tree_passes, stats.side_accepted)
    assert stats.tree_passes > 0 and (stats.side_accepted > 0 or schedule == "async")


def test_a_trace_records_the_other_candidates_of_prompt_lookup():
    from speculators.prompt_lookup import PromptLookupSpeculator

    lookup = PromptLookupSpeculator(max_ngram=2, min_ngram=1)
    prompt = [1, 2, 3, 9, 1, 2, 4, 9, 1]
    output = [2, 3, 9, 7]
    trace = DraftTrace.replay(lookup.extend, prompt, output, lookup.candidates)
    # after "1 2" prompt lookup proposes 4 (wrong) and also offers 3, the right one
    assert trace.proposals[1] is False and trace.forks[1] == (1, 1)
    assert trace.as_text().split("|")[1][1] == "a"
    assert DraftTrace.from_text(trace.as_text()) == trace
    assert DraftTrace.replay(lookup.extend, prompt, output).forks == ()
    with pytest.raises(ValueError, match="forks hold only"):
        DraftTrace.from_text("RR|0z")
    with pytest.raises(ValueError, match="2 tokens with 1 forks"):
        DraftTrace.from_text("RR|0")
