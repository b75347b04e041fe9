"""The plain decoding loop: prompt in, one token per pass out.

It needs only a ``forward`` function (a Pipeline's, or any stand-in with the
same contract), so the loop is the same whatever carries the passes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from orchestrator.messages import PassResult
from orchestrator.sampling import SamplingSettings, choose_token

# forward(positions int32[n], tokens int32[n], keep) -> PassResult with the last row's logits
Forward = Callable[[np.ndarray, np.ndarray, int], PassResult]


@dataclass
class Generation:
    """What one generation produced and how long it took.

    tokens: generated ids (an end-of-generation token is not included).
    prefill_seconds: from start to the first generated token.
    decode_seconds: from the first generated token to the last.
    stage_seconds: busy seconds of each stage, summed over passes.
    """

    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    passes: int = 0
    stage_seconds: list[float] = field(default_factory=list)
    stopped_by: str = "length"

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    @property
    def tokens_per_second(self) -> float:
        """Generation phase: tokens after the first over the time they took."""
        if len(self.tokens) < 2 or self.decode_seconds <= 0:
            return 0.0
        return (len(self.tokens) - 1) / self.decode_seconds


def generate(
    forward: Forward,
    prompt_tokens: list[int],
    max_tokens: int,
    sampling: SamplingSettings,
    is_end: Callable[[int], bool],
    *,
    batch_size: int,
    on_token: Callable[[int], None] | None = None,
) -> Generation:
    """Decode up to max_tokens after the prompt, one token per pass."""
    if not prompt_tokens:
        raise ValueError("the prompt is empty")
    result = Generation(list(prompt_tokens))
    started = time.perf_counter()

    def run(tokens: list[int], first_position: int) -> np.ndarray:
        reply = forward(
            np.arange(first_position, first_position + len(tokens), dtype=np.int32),
            np.asarray(tokens, dtype=np.int32),
            first_position,
        )
        result.passes += 1
        if not result.stage_seconds:
            result.stage_seconds = [0.0] * len(reply.stage_seconds)
        for index, seconds in enumerate(reply.stage_seconds):
            result.stage_seconds[index] += seconds
        return reply.logits[-1]

    # Prefill in chunks the stages accept in one batch.
    logits = None
    for first in range(0, len(prompt_tokens), batch_size):
        logits = run(prompt_tokens[first : first + batch_size], first)
    position = len(prompt_tokens)
    first_token_time = None
    while len(result.tokens) < max_tokens:
        token = choose_token(logits, position, sampling)  # type: ignore[arg-type]
        if is_end(token):
            result.stopped_by = "end"
            break
        now = time.perf_counter()
        if first_token_time is None:
            first_token_time = now
            result.prefill_seconds = now - started
        result.decode_seconds = now - first_token_time
        result.tokens.append(token)
        if on_token is not None:
            on_token(token)
        if len(result.tokens) == max_tokens:
            break
        logits = run([token], position)
        position += 1
    return result
