"""A setup's projection over a range of draft acceptance rates, as a markdown table.

The acceptance of a draft for a target is the least known number in a
projection, so it is varied; everything else comes from the setup file.

    python -m benchmarks.projection benchmarks/setups/llama-405b-two-machines.toml
"""

from __future__ import annotations

import sys
from dataclasses import replace

import click

from orchestrator.planning.loaders import load_setup
from orchestrator.planning.search import recommend
from orchestrator.planning.simulation import DraftBehaviour


@click.command()
@click.argument("setup_file", type=click.Path(exists=True, dir_okay=False))
@click.option("--acceptance", "rates", multiple=True, type=float, default=(0.5, 0.6, 0.7, 0.8, 0.9), show_default=True)
def main(setup_file: str, rates: tuple[float, ...]) -> None:
    setup = load_setup(setup_file)
    drafts = setup.behaviour or DraftBehaviour(1.0)
    click.echo(f"Produced by `python -m benchmarks.projection {' '.join(sys.argv[1:])}`.\n")
    click.echo("| acceptance per token | split (blocks) | plain pipeline | sync speculation | async speculation |")
    click.echo("| --- | --- | --- | --- | --- |")
    for rate in rates:
        recommendation = recommend(replace(setup, behaviour=replace(drafts, acceptance=rate, first_acceptance=None)))
        predictions = recommendation.predictions
        plain = predictions["plain"].tokens_per_second

        def cell(name: str) -> str:
            prediction = predictions[name]
            return (f"{prediction.tokens_per_second:.2f} tok/s ({prediction.tokens_per_second / plain:.2f}x, "
                    f"draft max {prediction.mode.draft_max})")

        blocks = " + ".join(str(count) for count in recommendation.blocks_per_machine)
        click.echo(f"| {rate:g} | {blocks} | {plain:.2f} tok/s | {cell('sync')} | {cell('async')} |")


if __name__ == "__main__":
    main()
