"""What verifying k tokens costs: one batch of k tokens through each stage.

Speculation on a CPU pays only if a k-token batch costs well under k single
tokens. Runs the default 2-stage SmolLM2 split in this process (no Ray), one
thread per stage, after a 200-token context; medians over repetitions.

    python -m benchmarks.batch_cost [--repetitions 15]
"""

from __future__ import annotations

import statistics
import time

import click
import numpy as np

SIZES = (1, 2, 4, 8, 16)
CONTEXT = 200


@click.command()
@click.option("--repetitions", default=15, show_default=True, type=click.IntRange(1))
def main(repetitions: int) -> None:
    from orchestrator.config import default_stage_paths
    from stages.engine import StageEngine
    from stages.settings import StageSettings

    first_stage, last_stage = (StageEngine(path, StageSettings(n_ctx=1024)) for path in default_stage_paths())
    context = np.arange(100, 100 + CONTEXT, dtype=np.int32)
    positions = np.arange(CONTEXT, dtype=np.int32)
    last_stage.decode(positions, hidden=first_stage.decode(positions, tokens=context))
    single = None
    for size in SIZES:
        first_times, last_times = [], []
        positions = np.arange(CONTEXT, CONTEXT + size, dtype=np.int32)
        tokens = np.arange(500, 500 + size, dtype=np.int32)
        for _ in range(repetitions):
            first_stage.remove(CONTEXT)
            last_stage.remove(CONTEXT)
            started = time.perf_counter()
            hidden = first_stage.decode(positions, tokens=tokens)
            middle = time.perf_counter()
            last_stage.decode(positions, hidden=hidden, logit_rows=np.arange(size, dtype=np.int32))
            first_times.append(middle - started)
            last_times.append(time.perf_counter() - middle)
        total = statistics.median(first_times) + statistics.median(last_times)
        single = single or total
        click.echo(
            f"{size:2d} tokens: stage 0 {statistics.median(first_times) * 1e3:6.2f} ms, "
            f"stage 1 {statistics.median(last_times) * 1e3:6.2f} ms, total {total * 1e3:6.2f} ms "
            f"= {total / single:4.2f}x one token"
        )


if __name__ == "__main__":
    main()
