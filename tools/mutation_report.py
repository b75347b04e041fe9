"""The end of `make mutation`: the killed share of mutmut's mutants, per module.

Reads what `mutmut run` left in mutants/ (one ``<module>.py.meta`` per mutated
file: each mutant's exit code) and the survivors listed as equivalent in
tests/mutation_equivalents.md (a mutant name in backticks, with its reason).
A module's share is killed / (mutants - equivalent): a survivor not listed as
equivalent counts against it, and so does a mutant no pure test reaches.

    python tools/mutation_report.py [--fail-under 90] [--markdown]

Exit status 1 under --fail-under when the share of all modules is lower, or
when the list names a mutant that no longer survives (or no longer exists),
so the list cannot go stale unnoticed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MUTANTS = ROOT / "mutants"
EQUIVALENTS = ROOT / "tests" / "mutation_equivalents.md"

# mutmut's exit codes (mutmut/stats.py): a timeout is a kill, as mutmut scores it
KILLED = {1, 3, 36, 24, -24, 152, 255}
SURVIVED = {0}
NO_TESTS = {5, 33}


def listed_equivalents(path: Path = EQUIVALENTS) -> set[str]:
    if not path.exists():
        return set()
    return set(re.findall(r"`([^`\s]+__mutmut_\d+)`", path.read_text(encoding="utf-8")))


def results(mutants: Path = MUTANTS) -> dict[str, dict[str, int | None]]:
    """Exit code of every mutant, by source file (relative to the repository)."""
    by_module = {}
    for meta in sorted(mutants.rglob("*.py.meta")):
        module = meta.relative_to(mutants).as_posix().removesuffix(".meta")
        by_module[module] = json.loads(meta.read_text())["exit_code_by_key"]
    return by_module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fail-under", type=float, default=None, metavar="PERCENT")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown (README)")
    arguments = parser.parse_args(argv)

    by_module = results()
    if not by_module:
        print(f"no mutmut results in {MUTANTS}: run `make mutation`", file=sys.stderr)
        return 1
    equivalent = listed_equivalents()
    rows = []
    unexplained: list[str] = []
    unreached: list[str] = []
    other: list[str] = []
    stale = set(equivalent)
    totals = Counter()
    for module, codes in by_module.items():
        count = Counter()
        for name, code in codes.items():
            count["mutants"] += 1
            if code in KILLED:
                count["killed"] += 1
                continue
            if name in equivalent and code in SURVIVED:
                count["equivalent"] += 1
                stale.discard(name)
                continue
            if code in SURVIVED:
                count["survived"] += 1
                unexplained.append(name)
            elif code in NO_TESTS:
                count["no tests"] += 1
                unreached.append(name)
            else:  # not checked, suspicious, segfault, interrupted
                count["other"] += 1
                other.append(f"{name} (exit code {code})")
        totals.update(count)
        rows.append((module, count))
    rows.append(("all", totals))

    def share(count: Counter) -> float:
        relevant = count["mutants"] - count["equivalent"]
        return 100.0 * count["killed"] / relevant if relevant else 100.0

    columns = ("mutants", "killed", "equivalent", "survived", "no tests", "other")
    if arguments.markdown:
        print("| module | " + " | ".join(columns) + " | killed of non-equivalent |")
        print("| --- |" + " ---: |" * (len(columns) + 1))
        for module, count in rows:
            name = "**all**" if module == "all" else f"`{module}`"
            print(f"| {name} | " + " | ".join(str(count[c]) for c in columns) + f" | {share(count):.1f} % |")
    else:
        width = max(len(module) for module, _ in rows)
        print(f"{'module':<{width}}  " + "  ".join(f"{c:>10}" for c in columns) + "  killed of non-equivalent")
        for module, count in rows:
            print(f"{module:<{width}}  " + "  ".join(f"{count[c]:>10}" for c in columns) + f"  {share(count):6.1f} %")

    for title, names in (("survived, not listed as equivalent", unexplained),
                         ("reached by no pure test", unreached), ("neither killed nor survived", other)):
        if names:
            print(f"\n{title} ({len(names)}; `mutmut show NAME` shows one):")
            for name in names:
                print(f"  {name}")
    failed = False
    if stale:
        print(f"\nlisted in {EQUIVALENTS.relative_to(ROOT)} but not surviving: remove them from the list")
        for name in sorted(stale):
            print(f"  {name}")
        failed = True
    if arguments.fail_under is not None and share(totals) < arguments.fail_under:
        print(f"\nkilled {share(totals):.1f} % of non-equivalent mutants, under {arguments.fail_under:g} %")
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
