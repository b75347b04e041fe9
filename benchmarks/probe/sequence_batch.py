"""Does one pass with several requests' tokens cost less than a pass each?

The measurement behind the service's choice of one window per pass (docs/serving.md,
"Many requests in the pipeline, not in one batch"). On the whole model, with one KV stream per sequence as the stages
keep them (stages.engine), after PROFILE_CONTEXT tokens of context in each
sequence, it times k sequences' next token decoded

* separately: k llama_decode calls of one token each, and
* together: one llama_decode call of k tokens, one per sequence,

and, for comparison, k tokens of one sequence in one call (what a window of
drafts costs, as ``orchestrate profile`` measures). For each k the three
take turns repetition by repetition (benchmarks.side_by_side); medians and
ranges over the repetitions, in one run:

    python -m benchmarks.probe sequence-batch [--threads 1] [--repetitions 7]
"""

from __future__ import annotations

import time

import click
import numpy as np

from benchmarks.probe.harness import Report, probe, table
from benchmarks.side_by_side import Outcome, Samples, side_by_side
from orchestrator.config import PROFILE_CONTEXT, PROFILE_REPETITIONS, default_model_path

SEQUENCE_COUNTS = (1, 2, 4, 8)
WAYS = ["separate", "together", "one_sequence"]


class Decoder:
    """The whole model in a llama.cpp context of ``sequences`` KV streams."""

    def __init__(self, path: str, sequences: int, threads: int, context: int):
        import llama_cpp

        from stages.engine import ensure_backend, quiet_logs

        ensure_backend()
        quiet_logs()
        self.llama_cpp = llama_cpp
        self.model = llama_cpp.llama_model_load_from_file(path.encode(), llama_cpp.llama_model_default_params())
        parameters = llama_cpp.llama_context_default_params()
        parameters.n_ctx = context * sequences
        parameters.n_batch = parameters.n_ubatch = 512
        parameters.n_threads = parameters.n_threads_batch = threads
        parameters.n_seq_max = sequences
        parameters.kv_unified = False
        parameters.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.context = llama_cpp.llama_init_from_model(self.model, parameters)
        self.memory = llama_cpp.llama_get_memory(self.context)
        self.batch = llama_cpp.llama_batch_init(512, 0, 1)

    def decode(self, rows: list[tuple[int, int, int]]) -> None:
        """One llama_decode of rows (token, position, sequence), the logits of every row."""
        batch = self.batch
        batch.n_tokens = len(rows)
        for index, (token, position, sequence) in enumerate(rows):
            batch.token[index], batch.pos[index] = token, position
            batch.n_seq_id[index], batch.seq_id[index][0], batch.logits[index] = 1, sequence, 1
        status = self.llama_cpp.llama_decode(self.context, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")

    def drop(self, sequence: int, first: int) -> None:
        self.llama_cpp.llama_memory_seq_rm(self.memory, sequence, first, -1)

    def close(self) -> None:
        self.llama_cpp.llama_batch_free(self.batch)
        self.llama_cpp.llama_free(self.context)
        self.llama_cpp.llama_model_free(self.model)


def measure(path: str, threads: int, repetitions: int) -> dict[int, Samples]:
    """For each k, the seconds of each way ("seconds"), one per repetition."""
    rng = np.random.default_rng(0)
    decoder = Decoder(path, max(SEQUENCE_COUNTS), threads, PROFILE_CONTEXT + 16)
    try:
        for sequence in range(max(SEQUENCE_COUNTS)):  # the same context length in every sequence
            prompt = rng.integers(100, 20000, PROFILE_CONTEXT)
            decoder.decode([(int(token), position, sequence) for position, token in enumerate(prompt)])
        results = {}
        for count in SEQUENCE_COUNTS:
            def run(mode: str, repetition: int, count: int = count) -> Outcome:
                for sequence in range(count):
                    decoder.drop(sequence, PROFILE_CONTEXT)
                started = time.perf_counter()
                if mode == "separate":
                    for sequence in range(count):
                        decoder.decode([(500, PROFILE_CONTEXT, sequence)])
                elif mode == "together":
                    decoder.decode([(500, PROFILE_CONTEXT, sequence) for sequence in range(count)])
                else:
                    decoder.decode([(500, PROFILE_CONTEXT + row, 0) for row in range(count)])
                return Outcome({"seconds": time.perf_counter() - started})

            results[count] = side_by_side(WAYS, repetitions, run)
        return results
    finally:
        decoder.close()


@probe("sequence-batch", repetitions=PROFILE_REPETITIONS)
@click.option("--threads", default=1, show_default=True, type=click.IntRange(1))
def sequence_batch(repetitions: int, threads: int) -> Report:
    """One llama.cpp call of k sequences' next tokens against k calls of one,
    and k tokens of one sequence (the whole default model, no Ray)."""
    results = measure(str(default_model_path()), threads, repetitions)
    rows = []
    for count, samples in results.items():
        ratio = samples.median("together", "seconds") / samples.median("separate", "seconds")
        rows.append([str(count), samples.spread("separate", "seconds", 1e3, 1),
                     samples.spread("together", "seconds", 1e3, 1), f"{ratio:.2f}",
                     samples.spread("one_sequence", "seconds", 1e3, 1)])
    lines = table(["sequences k", "k passes of 1 (ms)", "1 pass of k sequences (ms)", "together / separate",
                   "k tokens of 1 sequence (ms)"], rows)
    return Report(f"SmolLM2-135M whole, {threads} thread(s), {PROFILE_CONTEXT} tokens of context per sequence; "
                  "together / separate is a ratio of medians", lines,
                  {f"{count} sequences": samples for count, samples in results.items()})
