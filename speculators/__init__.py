"""Speculation: draft tokens proposed ahead of the target, and their verification.

Pure: arrays and token lists in, token lists out. Importing this package never
imports Ray or llama.cpp (the model drafter loads llama.cpp only when built).

* ``verify``: sample-and-match verification of a draft against target logits.
* ``prompt_lookup``: drafts by matching the recent n-gram against earlier text.
* ``model``: drafts greedily with a small GGUF model of the same vocabulary.
* ``draft_length``: how many drafts the next pass verifies.
"""
