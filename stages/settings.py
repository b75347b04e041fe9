"""How a stage's llama.cpp context is built. Pure: importing it loads no llama.cpp.

The defaults follow llama-cpp-python's ``Llama`` (n_batch = n_ubatch = 512),
because ``Llama`` on the whole model is the reference the output must equal
token for token; the context is that of a long conversation.
"""

from __future__ import annotations

from dataclasses import dataclass

from stages.cost_curve import CostCurve

DEFAULT_CONTEXT = 4096  # KV cache positions per sequence
DEFAULT_BATCH = 512  # tokens per llama_decode call, as Llama's default
ALL_LAYERS = -1  # n_gpu_layers: every layer this build can offload
# One request's grammar text: it travels with every pass of the request, beside the tokens generated so far,
# in a frame header of at most 64 KiB (orchestrator.transport.wire); the last stage compiles it.
MAX_GRAMMAR_BYTES = 16 * 1024


@dataclass(frozen=True)
class StageSettings:
    """n_ctx: KV cache cells (positions) per sequence.
    threads: CPU threads for decoding (single tokens and batches alike).
    n_gpu_layers: layers (blocks and the output layer) offloaded to a GPU where
    this llama.cpp build has one; ALL_LAYERS (-1, llama.cpp's own default):
    all of them; 0: none. A CPU build computes everything on the CPU either way.
    n_batch: most tokens decoded in one llama_decode call.
    sequences: KV sequences the stage holds at once (one per request being
    served; each has its own n_ctx cells, so a stage holds n_ctx * sequences).
    tree_sequences: extra KV sequence ids for token trees' side leaves (a tree
    of up to tree_sequences + 1 leaves per pass; 0: chains only). Needs
    sequences = 1 (stages.engine says why).
    prefix_sequences: KV sequences after the served ones (ids sequences ..
    sequences + prefix_sequences - 1) that keep finished requests' prefixes
    for later ones to copy (orchestrator.decoding.prefix_cache); each has
    its own n_ctx cells too.
    cost_curve: for measurements only, the emulated costs of other machines
    (stages.cost_curve): every pass then lasts at least the curve's time.
    """

    n_ctx: int = DEFAULT_CONTEXT
    threads: int = 1
    n_gpu_layers: int = ALL_LAYERS
    n_batch: int = DEFAULT_BATCH
    sequences: int = 1
    tree_sequences: int = 0
    prefix_sequences: int = 0
    cost_curve: CostCurve | None = None
