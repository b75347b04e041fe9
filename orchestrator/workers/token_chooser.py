"""Choosing a pass's tokens beside the last stage: verification, structured output, logprobs.

The last stage (orchestrator.workers.stage_server) turns the logit rows of a
batch with a ``TokenChoice`` into the tokens its window commits, so that only
token ids (and, when asked, the top logprobs) travel back: the drafts
verified as plain decoding would choose (speculators.tree.verify_rows), under
the request's grammar when it has one (speculators.grammar.verify_constrained,
from the grammar's state after the tokens the choice says were generated),
then the chosen tokens' logprobs (speculators.logprobs). The in-process
target (orchestrator.in_process) chooses constrained windows the same way.
"""

from __future__ import annotations

import numpy as np

from orchestrator.transport.messages import TokenChoice
from speculators.grammar import verify_constrained
from stages.errors import GrammarError
from speculators.logprobs import TokenLogprobs, window_logprobs
from speculators.tree import verify_rows
from stages.grammar import GrammarConstraint, Vocabulary


class TokenChooser:
    """The choices of one last stage, over its model's vocabulary (a llama_vocab
    pointer that outlives it); keeps each KV sequence's grammar, so that a
    request's passes advance its state by their new tokens only."""

    def __init__(self, vocabulary_pointer):
        self._pointer = vocabulary_pointer
        self._vocabulary: Vocabulary | None = None  # made at the first grammar
        self._grammars: dict[int, GrammarConstraint] = {}  # by KV sequence: the grammar its last request used

    def choose(self, sequence: int, choice: TokenChoice, rows: np.ndarray) -> tuple[np.ndarray, TokenLogprobs | None]:
        """The tokens ``rows`` (float32[rows, n_vocab], the batch's logit rows)
        commit, and their logprobs if the choice asks."""
        drafts = choice.drafts.tolist()
        if choice.grammar is None:
            tokens = verify_rows(drafts, choice.parents, rows, choice.first_position, choice.sampling)
        else:
            tokens = self._constrained(sequence, choice, rows)
        logprobs = None if choice.top_logprobs < 0 else window_logprobs(rows, drafts, choice.parents, tokens,
                                                                        choice.top_logprobs)
        return np.array(tokens, np.int32), logprobs

    def _constrained(self, sequence: int, choice: TokenChoice, rows: np.ndarray) -> list[int]:
        """The tokens the rows commit under the choice's grammar. A window
        started ahead on a speculation the grammar forbids (prompt lookup
        proposes anything) cannot be valid: the committed text obeys the
        grammar, so it differs from that speculation before the window's
        start, and the loop discards the window. It gets the unconstrained
        choice, well formed and never used."""
        drafts = choice.drafts.tolist()
        try:
            state = self._grammar(sequence, choice.grammar).state_after(choice.generated.tolist())
        except GrammarError:
            return verify_rows(drafts, choice.parents, rows, choice.first_position, choice.sampling)
        try:
            return verify_constrained(drafts, choice.parents, rows, choice.first_position, choice.sampling, state)
        finally:
            state.free()

    def _grammar(self, sequence: int, grammar: str) -> GrammarConstraint:
        held = self._grammars.get(sequence)
        if held is None or held.grammar != grammar:
            if self._vocabulary is None:
                self._vocabulary = Vocabulary(self._pointer)
            held = self._grammars[sequence] = GrammarConstraint(self._vocabulary, grammar)
        return held
