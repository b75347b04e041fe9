"""How sequences draft: what a user chose (``SpeculationSettings``, the same
record for ``orchestrate run`` and ``orchestrate serve``) and what the
decoding loop is given for each sequence (``Drafting``: its drafters, its
schedule and the draft policy's prices)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from orchestrator.config import DRAFT_MAX
from orchestrator.decoding.schedule import Schedule
from orchestrator.decoding.targets import Drafter
from speculators.draft_length import DRAFTER_CALL_COST, PRIOR_STEP, DraftPrices
from speculators.model import DRAFT_DEVICES
from speculators.tree import MAX_TREE_ROWS
from stages.cost_curve import BatchCurve
from stages.settings import StageSettings

SPECULATORS = ("none", "ngram", "model")
DRAFT_SAMPLINGS = ("coupled", "top")


def draft_cells(draft_max: int, tree_leaves: int) -> int:
    """KV cells a window of drafts may take beyond the generated tokens:
    draft_max, or with trees a tree's most rows (each holds a cell while its
    pass runs, however shallow the tree)."""
    return MAX_TREE_ROWS if tree_leaves > 1 else draft_max


def tree_stage_settings(stage: StageSettings, tree_leaves: int) -> StageSettings:
    """``stage`` with the KV ids token trees of ``tree_leaves`` leaves need at
    every stage: one per side leaf beside the sequence's own (stages.engine)."""
    return replace(stage, tree_sequences=tree_leaves - 1) if tree_leaves > 1 else stage


class SpeculationError(ValueError):
    """Speculation asked for in a way that cannot work; the message is one line."""


@dataclass(frozen=True)
class SpeculationSettings:
    """speculator: none, ngram (prompt lookup) or model (draft_path, a whole GGUF model).
    schedule: async (draft while passes run, windows started ahead) or sync (draft, then verify).
    draft_max: most draft tokens per target pass; draft_p_min: a model draft stops
    below this probability; overlap: draft even while the machine's own stage
    runs (drafter actors only).
    tree_leaves: above 1, the drafter beside stage 0 drafts token trees of up
    to that many leaves when awaited (prompt lookup: its other matches; a
    draft model: its most probable continuations, speculators.model_tree),
    and every stage holds as many KV ids less one.
    draft_sampling: when a request samples, "coupled" drafters sample with
    the target's seeded uniforms, "top" take their top choices (the committed
    text is the seeded run's either way; only acceptance differs).
    draft_device: where a draft model computes on its machine (cpu, gpu, or
    auto: the GPU where the build has one; speculators.model.draft_gpu_layers);
    draft_threads: its CPU threads (None: the stages' --threads).
    drafter_nodes: Ray nodes (address or id) that draft instead of the
    machines beside the first stages: drafter i runs on drafter_nodes[i]
    (a drafter-only node, llama_duo's laptop drafting for a Mac Studio), the
    rest beside their stages."""

    speculator: str = "none"
    draft_path: str | None = None
    schedule: Schedule = Schedule.ASYNC
    draft_max: int = DRAFT_MAX
    draft_p_min: float = 0.0
    overlap: bool = False
    tree_leaves: int = 1
    draft_device: str = "auto"
    draft_threads: int | None = None
    drafter_nodes: tuple[str, ...] = ()
    draft_sampling: str = "coupled"

    def __post_init__(self):
        if self.speculator not in SPECULATORS:
            raise SpeculationError(f"unknown speculator {self.speculator!r} (choose {', '.join(SPECULATORS)})")
        if self.speculator == "model" and not self.draft_path:
            raise SpeculationError("--speculator model needs --draft DRAFT.gguf")
        if self.draft_path and self.speculator != "model":
            raise SpeculationError("--draft is only used with --speculator model")
        if self.draft_device not in DRAFT_DEVICES:
            raise SpeculationError(f"unknown draft device {self.draft_device!r} (choose {', '.join(DRAFT_DEVICES)})")
        if (self.draft_device != "auto" or self.draft_threads is not None) and self.speculator != "model":
            raise SpeculationError("--draft-device and --draft-threads are only used with --speculator model")
        if self.draft_threads is not None and self.draft_threads < 1:
            raise SpeculationError(f"--draft-threads must be at least 1, not {self.draft_threads}")
        if self.drafter_nodes and self.speculator != "model":
            raise SpeculationError("--drafter-node needs --speculator model (prompt lookup drafts in the coordinator)")
        if self.tree_leaves > 1 and not self.drafts:
            raise SpeculationError("--tree-leaves needs a speculator (ngram or model) to draft the trees")
        if self.draft_sampling not in DRAFT_SAMPLINGS:
            raise SpeculationError(f"unknown draft sampling {self.draft_sampling!r} (choose {', '.join(DRAFT_SAMPLINGS)})")

    @property
    def drafts(self) -> bool:
        return self.speculator != "none"

    @property
    def asynchronous(self) -> bool:
        """Drafting goes on while a pass runs, and passes overlap."""
        return self.drafts and self.schedule.asynchronous

    @property
    def draft_room(self) -> int:
        """KV cells a window of drafts may take beyond the generated tokens:
        draft_max, or a token tree's most rows (each holds a cell while its pass runs)."""
        return draft_cells(self.draft_max, self.tree_leaves) if self.drafts else 0


@dataclass(frozen=True)
class Drafting:
    """How a sequence drafts: drafters[i] sits beside stage i (one per
    stage), the schedule, and the most drafts a window carries.

    first: the drafter the loop waits for before a window (the schedule's
    drafts_first); None: the one beside stage 0. Prompt lookup runs here, in
    this process: it costs microseconds, where asking an actor costs a round
    trip each window.
    call_cost: what that ask costs, in one-token passes (the draft policy's).
    step: what each extra token of a pass costs, in one-token passes
    (Pipeline.draft_step measures it before a run).
    tree_leaves: above 1, ``first`` drafts token trees of up to that many
    leaves (collect_tree; the stages need as many tree_sequences less one),
    and the schedule verifies the rows that pay.
    side_row_step: what the tree rule prices a side row at, in one-token
    passes (None: ``step``, as any row; the bench's tree-all mode: 0).
    draft_prices: what drafting a token costs the target (awaited, relayed:
    speculators.draft_length.DraftPrices, measured before a run,
    orchestrator.cluster.drafters.draft_prices; prompt lookup in process: nothing).
    pass_curve: a pass's seconds at several widths (Pipeline.pass_curve),
    which the tree rule reads at every width; None: the line through ``step``.
    coupled: when a request samples, its drafters sample with the target's
    seeded uniforms (SpeculationSettings.draft_sampling); else their top choices.
    corrects: while an async pass runs, its drafter also drafts corrections at
    the drafts being verified (speculators.corrections; a draft model's
    drafter actors, whose speculate takes forks and who have corrections()).
    branches: branch windows where passes are flat and the draft fast
    (SequenceState.branching; orchestrator.decoding.branches): asked for
    only by the probe across-rejections and the simulation's Mode, since
    they measured slower than the schedule before them (docs/measurements.md,
    "Branch windows").
    """

    drafters: Sequence[Drafter]
    schedule: Schedule
    draft_max: int
    first: Drafter | None = None
    call_cost: float = DRAFTER_CALL_COST
    step: float = PRIOR_STEP
    tree_leaves: int = 1
    side_row_step: float | None = None
    draft_prices: DraftPrices = DraftPrices()
    pass_curve: BatchCurve | None = None
    coupled: bool = True
    corrects: bool = False
    branches: bool = False

    @property
    def drafter_first(self) -> Drafter:
        return self.first or self.drafters[0]


def exact_trees(speculation: SpeculationSettings, inexact: list[int],
                on_status: Callable[[str], None] | None) -> SpeculationSettings:
    """Token trees where every stage computes their side rows exactly, else
    chains (the text must stay the whole model's), said on the status line."""
    if speculation.tree_leaves == 1 or not inexact:
        return speculation
    if on_status is not None:
        stages = ", ".join(map(str, inexact))
        on_status(f"[token trees off: a side row's output differs from its path's on the machine of stage "
                  f"{stages} (llama.cpp's kernels there), so trees could change the text; drafting chains]")
    return replace(speculation, tree_leaves=1)
