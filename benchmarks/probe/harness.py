"""What every probe mode shares: the command line (``--repetitions``,
``--json``), the report (a first line saying what ran, the mode's tables and
notes in Markdown, then the repetitions, the machine and its load) and the
JSON file (every figure's per-repetition values, median and range, under the
mode's labels). The repetition loop is benchmarks.side_by_side's."""

from __future__ import annotations

import functools
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import click

import benchmarks.probe as package
from benchmarks.side_by_side import Samples
from orchestrator.output import write_whole


@dataclass
class Report:
    """What a mode measured: a first line, its tables and notes (Markdown
    lines), its samples by label ("" where there is one set) and anything
    else the JSON file should hold."""

    title: str
    lines: list[str]
    samples: dict[str, Samples]
    extra: dict = field(default_factory=dict)


def table(header: list[str], rows: list[list[str]], labels: int = 1) -> list[str]:
    """A Markdown table, the first ``labels`` columns left-aligned, the figures right."""
    return ["| " + " | ".join(header) + " |", "|" + " --- |" * labels + " ---: |" * (len(header) - labels),
            *("| " + " | ".join(row) + " |" for row in rows)]


def environment() -> dict:
    return {"cpus": os.cpu_count(), "load_average_1min": os.getloadavg()[0], "python": platform.python_version(),
            "platform": platform.platform()}


def _package_help() -> tuple[str, dict[str, str]]:
    """The package's docstring without its list of modes, and that list: mode -> one line."""
    text, summaries = [], {}
    for line in package.__doc__.strip().splitlines():
        name, _, summary = line.strip().partition("  ")
        if line.startswith("    ") and summary:
            summaries[name] = summary.strip()
        else:
            text.append(line)
    return "\n".join(text).strip().removesuffix(" The modes:"), summaries


HELP, SUMMARIES = _package_help()


@click.group(help=HELP)
def main() -> None:
    pass


def probe(name: str, repetitions: int):
    """Register a mode: ``function(repetitions=..., **its options) -> Report``;
    its docstring is its --help."""

    def register(function):
        @functools.wraps(function)
        def command(repetitions: int, json_path: Path | None, **options) -> None:
            started, before = time.strftime("%Y-%m-%d %H:%M:%S"), environment()
            report = function(repetitions=repetitions, **options)
            emit(name, report, repetitions, started, before, json_path)

        command = click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
                               help="Also write every figure here.")(command)
        command = click.option("--repetitions", default=repetitions, show_default=True, type=click.IntRange(1),
                               help="Times every variant of the mode runs (medians and ranges over them).")(command)
        return main.command(name, short_help=SUMMARIES.get(name))(command)

    return register


def emit(name: str, report: Report, repetitions: int, started: str, before: dict, json_path: Path | None) -> None:
    after = os.getloadavg()[0]
    command = "python -m benchmarks.probe " + shlex.join([name, *sys.argv[2:]])
    click.echo(report.title + "\n")
    click.echo("\n".join(report.lines))
    click.echo(f"\n{repetitions} repetitions, the variants in turn (the order rotating each repetition); "
               f"median (min-max) over them. `{command}`, {started}; {before['cpus']} CPUs, "
               f"load {before['load_average_1min']:.2f} -> {after:.2f}.")
    if json_path is not None:
        document = {"probe": name, "command": command, "started": started, "repetitions": repetitions,
                    "environment": before, "load_average_1min_after": after, "title": report.title,
                    "text": "\n".join(report.lines),
                    "samples": {label: samples.as_json() for label, samples in report.samples.items()},
                    **report.extra}
        write_whole(json_path, lambda path: path.write_text(json.dumps(document, indent=1) + "\n"))
