"""The reference decoder: llama-cpp-python's own ``Llama`` on the unsplit model.

Every mode of ``orchestrate bench`` and every exactness test compares its
tokens with this one's (greedy, no repeat penalty); bench also times it as
the ``whole`` and ``whole-lookup`` modes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from orchestrator.config import BENCH_CONTEXT


@dataclass(frozen=True)
class WholeRun:
    """One greedy generation: its tokens (end token excluded), generation-phase
    tokens/s (tokens after the first over their time), and seconds to the
    first and to the last token."""

    tokens: list[int]
    tokens_per_second: float
    first_token_seconds: float
    seconds: float


class WholeModel:
    """``Llama`` on one thread; with prompt_lookup_tokens, llama-cpp-python's own
    prompt-lookup speculative decoding drafting that many tokens."""

    def __init__(self, path: str, *, prompt_lookup_tokens: int | None = None, n_ctx: int = BENCH_CONTEXT):
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = None if prompt_lookup_tokens is None else LlamaPromptLookupDecoding(num_pred_tokens=prompt_lookup_tokens)
        self.llama = llama_cpp.Llama(path, n_ctx=n_ctx, n_threads=1, n_threads_batch=1, verbose=False, draft_model=draft)

    def tokenize(self, text: str) -> list[int]:
        return self.llama.tokenize(text.encode(), add_bos=True)

    def greedy(self, prompt_tokens: list[int], max_tokens: int) -> WholeRun:
        import llama_cpp

        self.llama.reset()
        produced: list[int] = []
        vocabulary = llama_cpp.llama_model_get_vocab(self.llama.model)
        started = time.perf_counter()
        first = last = started
        for token in self.llama.generate(prompt_tokens, temp=0.0, repeat_penalty=1.0, reset=True):
            if llama_cpp.llama_vocab_is_eog(vocabulary, token) or len(produced) >= max_tokens:
                break
            last = time.perf_counter()
            if not produced:
                first = last
            produced.append(token)
        rate = (len(produced) - 1) / (last - first) if len(produced) > 1 and last > first else 0.0
        return WholeRun(produced, rate, first - started, last - started)
