"""Choosing the next token from logits: pure numpy.

Greedy (temperature 0) takes the argmax, as llama.cpp's greedy sampler does.
Sampling applies temperature, then nucleus (top-p) filtering, then draws by
the Gumbel-max rule: the token whose log probability plus its Gumbel noise is
largest, the noise (one number per token) from a generator seeded by
(seed, position). That is an exact draw from the filtered distribution; the
draw for a given absolute position never depends on how many passes came
before it, so a speculative decoder that verifies several positions per pass
picks exactly the tokens plain decoding picks for the same seed.

Why Gumbel-max rather than one uniform number through the cumulative sum:
a draft model that draws with the same noise (coupled drafting,
speculators.model_tree) lands on the target's token whenever the two
distributions are close, since one token's small change in probability
moves no other token's score. Through a cumulative sum in token order every
small difference before a token shifts where the uniform lands. Measured by
``python -m benchmarks.probe draft-coupling`` (2026-12-03; the bench's
realistic draft, SmolLM2 Q4_0 drafting for Q4_1, on its chat prompts): the
draft's draw is the target's for 0.69 of tokens at temperature 1.0 (0.67 at
0.6), against 0.50 (0.64) through the cumulative sum and 0.50 (0.60) for the
draft's top choice; the most any coupling can reach, 1 - TV, is 0.71 (0.70).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingSettings:
    """temperature 0 means greedy; top_p 1.0 keeps the whole distribution."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def position_noise(seed: int, position: int, size: int) -> np.ndarray:
    """float64[size]: the Gumbel noise of each token at an absolute position."""
    return np.random.default_rng([seed, position]).gumbel(size=size)


def token_probabilities(logits: np.ndarray, settings: SamplingSettings) -> np.ndarray:
    """float64[n_vocab] probabilities after temperature and top-p (zeros outside the nucleus)."""
    # The maximum first, then the temperature: however small the temperature,
    # nothing overflows (a tiny one puts all the mass on the argmax, as greedy).
    scaled = (logits.astype(np.float64) - float(logits.max())) / settings.temperature
    probabilities = np.exp(scaled)
    probabilities /= probabilities.sum()
    if settings.top_p < 1.0:
        order = np.argsort(-probabilities, kind="stable")
        cumulative = np.cumsum(probabilities[order])
        keep = int(np.searchsorted(cumulative, settings.top_p)) + 1  # smallest set reaching top_p
        mask = np.zeros_like(probabilities, dtype=bool)
        mask[order[:keep]] = True
        probabilities = np.where(mask, probabilities, 0.0)
        probabilities /= probabilities.sum()
    return probabilities


def choose_token(logits: np.ndarray, position: int, settings: SamplingSettings) -> int:
    """The token at absolute ``position`` given its logits float32[n_vocab]."""
    if settings.greedy:
        return int(np.argmax(logits))
    probabilities = token_probabilities(logits, settings)
    with np.errstate(divide="ignore"):  # log 0: a token outside the nucleus never wins
        scores = np.log(probabilities) + position_noise(settings.seed, position, len(probabilities))
    return int(np.argmax(scores))


def choice_sampling(settings: SamplingSettings, choice: int) -> SamplingSettings:
    """How choice ``choice`` of a request with several (OpenAI's n) chooses:
    choice 0 as the request says, so it equals the request with n = 1; each
    later one draws with a seed of its own, made from (seed, choice), so the
    choices differ and each is reproducible. Greedy choices are all alike."""
    if choice == 0:
        return settings
    state = np.random.SeedSequence([settings.seed % 2**64, choice]).generate_state(2, np.uint32)
    return SamplingSettings(settings.temperature, settings.top_p, (int(state[0]) << 31) ^ int(state[1]))
