"""What ``orchestrate plan`` prints: a table of predictions, or one JSON object."""

from __future__ import annotations

from orchestrator.planning.search import Recommendation
from orchestrator.planning.inputs import Setup

MODE_NAMES = {"plain": "plain pipeline", "sync": "sync speculation", "async": "async speculation"}


def _stage_lines(setup: Setup, recommendation: Recommendation) -> list[str]:
    costs = setup.costs(recommendation.starts)
    lines = []
    for stage, machine in enumerate(setup.machines):
        first, end = costs.stage_range(stage)
        lines.append(
            f"  stage {stage} on {machine.name}: blocks [{first}, {end}) ({end - first} blocks), "
            f"{recommendation.memory_needed[stage] / 1e9:.1f} GB of {machine.memory_bytes / 1e9:.0f} GB, "
            f"one token {costs.stage_seconds(stage, 1) * 1e3:.2f} ms"
        )
    return lines


def plan_lines(setup: Setup, recommendation: Recommendation) -> list[str]:
    lines = [f"{setup.model.name}: {setup.model.blocks} blocks over {len(setup.machines)} stages"]
    lines += _stage_lines(setup, recommendation)
    if setup.behaviour is not None:
        drafts = setup.behaviour
        lines.append(f"draft: acceptance {drafts.first:.2f} first, {drafts.acceptance:.2f} later; availability "
                     f"{drafts.availability:.2f}, continuation {drafts.continuation:.2f}; "
                     f"{min(setup.draft_seconds or [0]) * 1e3:.3f} ms per token")
    lines.append(f"{'mode':20s} {'tokens/s':>9s} {'passes/token':>13s} {'draft max':>10s} {'vs plain':>9s}")
    plain = recommendation.predictions["plain"].tokens_per_second
    for name, prediction in recommendation.predictions.items():
        draft = str(prediction.mode.draft_max) if name != "plain" else "-"
        lines.append(f"{MODE_NAMES[name]:20s} {prediction.tokens_per_second:9.2f} {prediction.passes_per_token:13.2f} "
                     f"{draft:>10s} {prediction.tokens_per_second / plain:8.2f}x")
    best = recommendation.best
    lines.append(f"recommended: {MODE_NAMES[best.mode.schedule.value]}"
                 + (f" with --draft-max {best.mode.draft_max}" if best.mode.schedule.speculative else "")
                 + f", stages starting at blocks {list(recommendation.starts)}")
    return lines


def plan_json(setup: Setup, recommendation: Recommendation) -> dict:
    return {
        "model": setup.model.name,
        "starts": list(recommendation.starts),
        "blocks_per_stage": list(recommendation.blocks_per_machine),
        "memory_needed_bytes": list(recommendation.memory_needed),
        "machines": [machine.name for machine in setup.machines],
        "draft_behaviour": {
            "acceptance_first": setup.behaviour.first, "acceptance_later": setup.behaviour.acceptance,
            "availability": setup.behaviour.availability, "continuation": setup.behaviour.continuation,
        } if setup.behaviour else None,
        "max_tokens": setup.max_tokens,
        "predictions": {
            name: {
                "tokens_per_second": prediction.tokens_per_second,
                "draft_max": prediction.mode.draft_max if name != "plain" else None,
                "passes_per_token": prediction.passes_per_token,
                "acceptance_rate": prediction.acceptance_rate,
                "discarded_passes_per_run": prediction.discarded_passes_per_run,
                "stage_busy_fraction": list(prediction.stage_busy_fraction),
            }
            for name, prediction in recommendation.predictions.items()
        },
    }
