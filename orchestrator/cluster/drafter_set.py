"""One speculator's drafters beside a running pipeline, what a drafted token
costs the target there, and the Drafting a generation decodes with.

How `orchestrate run`, serve's coordinator, the bench, the peers' runner
and the probes start their drafters (``start_drafter_set``), price them
(``DrafterSet.measure_prices``) and hand them to the decoding loop
(``DrafterSet.drafting``): the same steps in one place, after the stages
(cluster.pipeline_settings.PipelineSettings.start) and before the loop
(decoding.loop.generate, or serve's Service). ``start_speculation`` is the
first two as run and serve take them, from a pipeline's SpeculationSettings."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.cluster.drafters import (DrafterClient, DrafterSettings, draft_prices, drafter_settings,
                                           start_drafters, stop_drafters)
from orchestrator.config import CORRECTIONS_RELAYED_MOST
from orchestrator.decoding.drafting import Drafting, SpeculationSettings
from orchestrator.decoding.schedule import Schedule
from orchestrator.decoding.targets import InstantDrafter
from speculators.draft_length import PRIOR_STEP, DraftPrices, ask_cost
from stages.cost_curve import BatchCurve


@dataclass
class DrafterSet:
    """kind: the speculator, "ngram" (prompt lookup) or "model" (a draft
    model); drafters: one beside each stage (or where --drafter-node puts
    it); make_speculator: what each drafter built its speculator with;
    prices: what drafting a token costs the target (measure_prices; nothing
    until measured)."""

    kind: str
    drafters: list[DrafterClient]
    make_speculator: Callable
    prices: DraftPrices = DraftPrices()

    def measure_prices(self, pipeline, context: list[int], pass_seconds: float) -> DraftPrices:
        """Measure (and keep) what drafting a token costs, in one-token passes
        of ``pass_seconds`` (cluster.drafters.draft_prices), after ``context``."""
        self.prices = draft_prices(self.kind, pipeline, self.drafters, context, pass_seconds)
        return self.prices

    def drafting(self, schedule: Schedule, draft_max: int, *, step: float = PRIOR_STEP, tree_leaves: int = 1,
                 pass_curve: BatchCurve | None = None, coupled: bool = True, corrections: bool = True,
                 branches: bool = False) -> Drafting:
        """The Drafting of one generation: prompt lookup is asked before a
        window in this process (no round trip; the actors beside the stages
        still draft while async passes run), a draft model beside stage 0.
        step: a wider pass's cost (Pipeline.draft_step's). tree_leaves: the
        trees' leaves (prompt lookup's other matches, or the draft model's
        tree grown beside stage 0); pass_curve: the pass timed at every
        width the trees may take, for their rule. coupled: drafters sample
        with the target's uniforms (--draft-sampling). corrections: an async
        draft model's drafter also drafts corrections while a pass runs
        (Drafting.corrects), where drafting then costs the passes little
        (config.CORRECTIONS_RELAYED_MOST) and its price was measured; False:
        the chain alone, the bench's comparison. branches: branch windows
        where passes are flat and the draft fast (Drafting.branches; off
        unless asked: the probe across-rejections measured them slower)."""
        if self.kind == "ngram":
            return Drafting(self.drafters, schedule, draft_max, first=InstantDrafter(self.make_speculator(), draft_max),
                            call_cost=ask_cost(self.kind), step=step, tree_leaves=tree_leaves, pass_curve=pass_curve,
                            branches=branches)
        return Drafting(self.drafters, schedule, draft_max, call_cost=ask_cost(self.kind), step=step,
                        tree_leaves=tree_leaves, draft_prices=self.prices, pass_curve=pass_curve, coupled=coupled,
                        corrects=(corrections and schedule.asynchronous
                                  and self.prices.awaited > 0  # measured (unmeasured: not known to be cheap)
                                  and self.prices.relayed <= CORRECTIONS_RELAYED_MOST), branches=branches)

    def stop(self) -> None:
        """Stop every drafter (their actors killed)."""
        stop_drafters(self.drafters)


def start_drafter_set(pipeline, kind: str, make_speculator: Callable, settings: DrafterSettings, *,
                      named: bool = False, on_restart: Callable[[int], None] | None = None,
                      progress=None) -> DrafterSet:
    """Start ``kind``'s drafters beside ``pipeline``'s stages
    (cluster.drafters.start_drafters: a draft model shipped to their nodes
    first, progress as it goes; a lost one restarted, on_restart told its
    index). named: their actors' names carry the kind, so that several sets
    stand beside one pipeline (the bench's)."""
    drafters = start_drafters(pipeline, make_speculator, settings, on_restart=on_restart,
                              kind=kind if named else "", progress=progress)
    return DrafterSet(kind, drafters, make_speculator)


def start_speculation(pipeline, speculation: SpeculationSettings, make_speculator: Callable, context: list[int],
                      pass_seconds: float, *, max_restarts: int, sequences: int = 1,
                      on_restart: Callable[[int], None] | None = None, progress=None) -> DrafterSet:
    """``speculation``'s drafters beside ``pipeline``'s stages, each drafting
    for ``sequences`` requests and restarted up to ``max_restarts`` times
    (cluster.drafters.drafter_settings), priced after ``context`` in one-token
    passes of ``pass_seconds``: what `orchestrate run` and serve's coordinator
    decode with. Stopped again if the pricing fails."""
    drafter_set = start_drafter_set(
        pipeline, speculation.speculator, make_speculator,
        drafter_settings(speculation, pipeline.settings, max_restarts, sequences=sequences),
        on_restart=on_restart, progress=progress)
    try:
        drafter_set.measure_prices(pipeline, context, pass_seconds)
    except BaseException:
        with contextlib.suppress(Exception):  # the pricing's failure is the one to report
            drafter_set.stop()
        raise
    return drafter_set
