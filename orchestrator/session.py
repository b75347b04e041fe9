"""One ``orchestrate run``: connect Ray, start the pipeline, generate, report."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.cluster import ray_session
from orchestrator.generate import Generation, generate
from orchestrator.pipeline import Pipeline, StageReport, check_stage_files
from orchestrator.sampling import SamplingSettings
from orchestrator.tokenizer import Tokenizer
from stages.engine import StageSettings


@dataclass(frozen=True)
class RunSettings:
    """Everything ``orchestrate run`` was asked to do."""

    stage_paths: list[str]
    prompt: str
    chat: bool
    max_tokens: int
    sampling: SamplingSettings
    stage: StageSettings
    address: str | None = None
    place: dict[int, str] | None = None
    wire_dtype: str = "f32"
    dashboard: bool = False


@dataclass(frozen=True)
class RunOutcome:
    text: str
    generation: Generation
    stages: list[StageReport]
    hop_seconds: float

    def as_json(self) -> dict:
        generation = self.generation
        return {
            "text": self.text,
            "tokens": generation.tokens,
            "prompt_tokens": len(generation.prompt_tokens),
            "tokens_per_second": generation.tokens_per_second,
            "seconds": generation.seconds,
            "stopped_by": generation.stopped_by,
            "hop_seconds": self.hop_seconds,
            "stages": [
                {
                    "layers": [stage.first_block, stage.end_block],
                    "node": stage.node_id,
                    "host": stage.host,
                    "busy_seconds": stage.busy_seconds,
                }
                for stage in self.stages
            ],
        }

    def summary_line(self) -> str:
        generation = self.generation
        placed = "; ".join(
            f"stage {stage.stage_index} blocks [{stage.first_block}, {stage.end_block}) on node "
            f"{stage.node_id[:8]} ({stage.host})"
            for stage in self.stages
        )
        return (
            f"[{len(generation.tokens)} tokens, {generation.tokens_per_second:.1f} tokens/s, "
            f"{len(self.stages)} stages: {placed}; hop {self.hop_seconds * 1e6:.0f} us]"
        )


def prompt_tokens(tokenizer: Tokenizer, prompt: str, chat: bool) -> list[int]:
    return tokenizer.chat_prompt(prompt) if chat else tokenizer.tokenize(prompt)


def run_generation(
    settings: RunSettings,
    on_text: Callable[[str], None] | None = None,
    on_status: Callable[[str], None] | None = None,
) -> RunOutcome:
    check_stage_files(settings.stage_paths)  # before Ray starts: bad files fail fast
    tokenizer = Tokenizer(settings.stage_paths[0])
    tokens = prompt_tokens(tokenizer, settings.prompt, settings.chat)
    if len(tokens) + settings.max_tokens > settings.stage.n_ctx:
        raise ValueError(
            f"prompt ({len(tokens)} tokens) + --max-tokens {settings.max_tokens} exceed the context of "
            f"{settings.stage.n_ctx} tokens; raise --n-ctx or lower --max-tokens"
        )
    stream = tokenizer.text_stream()
    pieces: list[str] = []

    def emit(token: int) -> None:
        text = stream.push(token)
        pieces.append(text)
        if on_text is not None and text:
            on_text(text)

    with ray_session(settings.address, dashboard=settings.dashboard) as dashboard_url:
        if dashboard_url and on_status is not None:
            on_status(f"[Ray dashboard: {dashboard_url}]")
        with Pipeline(settings.stage_paths, settings.stage, wire_dtype=settings.wire_dtype, place=settings.place) as pipeline:
            generation = generate(
                lambda positions, batch, keep: pipeline.forward(positions, batch, keep),
                tokens,
                settings.max_tokens,
                settings.sampling,
                tokenizer.is_end,
                batch_size=settings.stage.n_batch,
                on_token=emit,
            )
            reports = pipeline.reports()
            hop_seconds = pipeline.hop_seconds
    tail = stream.finish()
    pieces.append(tail)
    if on_text is not None and tail:
        on_text(tail)
    return RunOutcome("".join(pieces), generation, reports, hop_seconds)
