"""``python -m benchmarks.probe draft-coupling``: how often a draft model's
draw is the target's own, token by token, along the whole model's greedy
text on the bench's chat prompts, with the bench's draft of realistic
agreement (SmolLM2 requantized to Q4_0, drafting for SmolLM2 Q4_1):

* top: the draft's top choice, the target sampling (today's chains);
* cumulative: the draft sampling with the target's uniform number for the
  position through the cumulative sum in token order (the draw the
  project used before Gumbel-max);
* gumbel: the draft sampling with the target's seeded Gumbel noise
  (speculators.sampling.choose_token: coupled drafting);
* best coupling: 1 - TV, the most any coupling can agree;
* tree: the target's draw among a node's children as a draft-model tree
  offers them (speculators.model_tree.children_of: the coupled draw and the
  draft's top choices, TOP_K in all), against the TOP_K top choices alone.

A repetition draws every position's noise with another seed. No timing:
the figures are shares of tokens.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import click
import numpy as np

from benchmarks.drafts import realistic_draft
from benchmarks.probe.harness import Report, probe, table
from benchmarks.scenarios import SCENARIO_DIR, load_scenario, prompts_of
from benchmarks.side_by_side import Outcome, Samples, side_by_side
from orchestrator.config import default_model_path
from speculators.model_tree import TOP_K, children_of
from speculators.sampling import SamplingSettings, choose_token, token_probabilities
from stages.settings import StageSettings

FIGURES = ("top", "cumulative", "gumbel", "best coupling", "tree: coupled + top", "tree: top only")
TEMPERATURES = (0.6, 1.0)


def _cumulative_draw(probabilities: np.ndarray, uniform: float) -> int:
    cumulative = np.cumsum(probabilities)
    return int(min(np.searchsorted(cumulative, uniform * cumulative[-1], side="right"), len(cumulative) - 1))


def _rows(target, draft, prompts, max_tokens: int):
    """(position, target logits, draft logits) at every generated position of the target's greedy text."""
    rows = []
    for prompt in prompts:
        for engine in (target, draft):
            engine.remove(0, 0)
        tokens, fed = list(prompt), 0
        for _ in range(max_tokens):
            positions, chunk = np.arange(fed, len(tokens), dtype=np.int32), np.asarray(tokens[fed:], np.int32)
            target_logits = target.decode(positions, tokens=chunk)[-1]
            draft_logits = draft.decode(positions, tokens=chunk)[-1]
            fed = len(tokens)
            rows.append((len(tokens), target_logits, draft_logits))
            tokens.append(int(np.argmax(target_logits)))
    return rows


def _shares(rows, temperature: float, seed: int) -> dict[str, float]:

    sampling = SamplingSettings(temperature=temperature, seed=seed)
    hits = dict.fromkeys(FIGURES, 0.0)
    for position, target_logits, draft_logits in rows:
        target_p, draft_p = token_probabilities(target_logits, sampling), token_probabilities(draft_logits, sampling)
        chosen = choose_token(target_logits, position, sampling)
        uniform = float(np.random.default_rng([seed, position, 1]).random())
        hits["top"] += target_p[int(np.argmax(draft_p))]
        hits["cumulative"] += _cumulative_draw(target_p, uniform) == _cumulative_draw(draft_p, uniform)
        hits["gumbel"] += chosen == choose_token(draft_logits, position, sampling)
        hits["best coupling"] += float(np.minimum(target_p, draft_p).sum())
        hits["tree: coupled + top"] += chosen in {token for token, _ in children_of(draft_logits, position, sampling)}
        hits["tree: top only"] += float(target_p[np.argsort(-draft_p)[:TOP_K]].sum())
    return {name: value / len(rows) for name, value in hits.items()}


@probe("draft-coupling", repetitions=3)
@click.option("--max-tokens", default=48, show_default=True, type=click.IntRange(4, 512),
              help="Tokens of the whole model's greedy text per chat prompt.")
def draft_coupling(repetitions: int, max_tokens: int) -> Report:
    """How often the draft's draw is the target's: top choice, a uniform through the cumulative sum,
    the shared Gumbel noise (coupled drafting), and a tree's children."""

    from stages.engine import StageEngine
    from stages.tokenizer import Tokenizer

    model = str(default_model_path())
    with tempfile.TemporaryDirectory() as folder:
        draft_path = realistic_draft(model, Path(folder))
        prompts = prompts_of(Tokenizer(model), load_scenario(SCENARIO_DIR / "chat.toml"))
        target, draft = StageEngine(model, StageSettings(n_ctx=2048)), StageEngine(draft_path, StageSettings(n_ctx=2048))
        try:
            rows = _rows(target, draft, prompts, max_tokens)
        finally:
            target.close()
            draft.close()
    modes = [f"temperature {temperature:g}" for temperature in TEMPERATURES]
    samples: Samples = side_by_side(
        modes, repetitions, lambda mode, repetition: Outcome(_shares(rows, float(mode.split()[-1]), 1000 + repetition)))
    header = ["figure", *modes]
    lines = table(header, [[name, *(samples.spread(mode, name, digits=3) for mode in modes)] for name in FIGURES])
    lines.append("")
    lines.append(f"{len(rows)} positions of the whole model's greedy text on the chat prompts; "
                 "the draft is SmolLM2 requantized Q4_1 -> Q4_0 (benchmarks.drafts). Gumbel over top: "
                 + ", ".join(f"{mode} {samples.median(mode, 'gumbel') / samples.median(mode, 'top'):.2f}x"
                             for mode in modes) + ".")
    return Report("The draft's draw against the target's, per token (shares of tokens; no timing)", lines,
                  {"": samples})
