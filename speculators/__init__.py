"""Speculation: draft tokens proposed ahead of the target, and their verification.

Pure: arrays and token lists in, token lists out. Importing this package never
imports Ray or llama.cpp (the model drafter loads llama.cpp only when built).

* ``verify``: sample-and-match verification of a draft against target logits.
* ``prompt_lookup``: drafts by matching the recent n-gram against earlier text.
* ``model``: drafts greedily with a small GGUF model of the same vocabulary.
* ``draft_length``: how many drafts the next pass verifies.
* ``tree``: token trees (preorder rows), their walk and the rule that picks the rows that pay.
* ``Speculator`` (below): the one protocol every drafter proposes from.
"""

from typing import Protocol


class Speculator(Protocol):
    """What every drafter proposes from (llama.cpp's common/speculative.h plays
    the same part): prompt lookup, a draft model. A drafter asks it for one
    token at a time, so drafting stops the moment it is collected."""

    def extend(self, context: list[int], sampling=None) -> int | None:
        """The next draft token after context, or None to stop drafting;
        sampling (speculators.sampling.SamplingSettings): a draft model's
        coupled draw (speculators.model_tree); prompt lookup ignores it."""
