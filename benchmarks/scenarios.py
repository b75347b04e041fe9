"""The bench's scenarios: TOML files (benchmarks/scenarios/ and the folders
beside it) naming a model, how to split it, the speculators to try, prompts,
max tokens and repetitions; loaded and checked here (one line naming the
file for a bad one), run by benchmarks.suite and the probes."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from orchestrator.config import BENCH_TREE_LEAVES, DRAFT_MAX
from stages.errors import SpecpipeError

SCENARIO_DIR = Path(__file__).parent / "scenarios"
QUICK_REPETITIONS = 1
QUICK_MAX_TOKENS = 48
SPECULATOR_KINDS = ("ngram", "model")


class ScenarioError(SpecpipeError):
    """A scenario file that cannot be used; the message names the file."""


@dataclass(frozen=True)
class Scenario:
    """One benchmark scenario, as declared in its TOML file."""

    name: str
    description: str
    model: str
    stages: int
    boundaries: tuple[int, ...] | None
    speculators: tuple[str, ...]
    draft: str
    chat: bool
    max_tokens: int
    repetitions: int
    quick: bool
    prompts: tuple[str, ...]
    temperature: float = 0.0
    seed: int = 0
    tree_leaves: int = BENCH_TREE_LEAVES
    draft_max: int = DRAFT_MAX

    @property
    def sampled(self) -> bool:
        return self.temperature > 0.0

    def quick_version(self) -> Scenario:
        return Scenario(**{**self.__dict__, "repetitions": QUICK_REPETITIONS,
                           "max_tokens": min(self.max_tokens, QUICK_MAX_TOKENS), "prompts": self.prompts[:1]})


def load_scenario(path: Path) -> Scenario:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise ScenarioError(f"{path}: {error}") from None
    known = {"name", "description", "model", "stages", "boundaries", "speculators", "draft", "chat", "max_tokens",
             "repetitions", "quick", "prompts", "temperature", "seed", "tree_leaves", "draft_max"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ScenarioError(f"{path}: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
    if not data.get("prompts") or not all(isinstance(prompt, str) and prompt for prompt in data["prompts"]):
        raise ScenarioError(f"{path}: needs a non-empty list of prompts")
    kinds = tuple(data.get("speculators", ["ngram"]))
    bad = [kind for kind in kinds if kind not in SPECULATOR_KINDS]
    if bad:
        raise ScenarioError(f"{path}: unknown speculator {bad[0]!r} (choose from {', '.join(SPECULATOR_KINDS)})")
    if not 0.0 <= float(data.get("temperature", 0.0)) <= 10.0 or not 1 <= int(data.get("tree_leaves", 4)) <= 64 \
            or not 1 <= int(data.get("draft_max", DRAFT_MAX)) <= 64:
        raise ScenarioError(f"{path}: temperature must be in [0, 10], tree_leaves and draft_max in 1..64")
    boundaries = data.get("boundaries")
    try:
        return Scenario(
            name=str(data.get("name", path.stem)),
            description=str(data.get("description", "")),
            model=str(data.get("model", "default")),
            stages=int(data.get("stages", len(boundaries) + 1 if boundaries else 2)),
            boundaries=tuple(int(block) for block in boundaries) if boundaries else None,
            speculators=kinds,
            draft=str(data.get("draft", "default")),
            chat=bool(data.get("chat", True)),
            max_tokens=int(data.get("max_tokens", 64)),
            repetitions=int(data.get("repetitions", 3)),
            quick=bool(data.get("quick", False)),
            prompts=tuple(data["prompts"]),
            temperature=float(data.get("temperature", 0.0)),
            seed=int(data.get("seed", 0)),
            tree_leaves=int(data.get("tree_leaves", BENCH_TREE_LEAVES)),
            draft_max=int(data.get("draft_max", DRAFT_MAX)),
        )
    except (TypeError, ValueError) as error:
        raise ScenarioError(f"{path}: {error}") from None


def load_scenarios(folder: Path = SCENARIO_DIR, *, quick: bool = False, only: list[str] | None = None) -> list[Scenario]:
    paths = sorted(folder.glob("*.toml"))
    if not paths:
        raise ScenarioError(f"{folder}: no scenario files (*.toml)")
    scenarios = [load_scenario(path) for path in paths]
    if only:
        missing = sorted(set(only) - {scenario.name for scenario in scenarios})
        if missing:
            raise ScenarioError(f"no scenario named {missing[0]!r} in {folder}")
        scenarios = [scenario for scenario in scenarios if scenario.name in only]
    if quick:
        scenarios = [scenario.quick_version() for scenario in scenarios if scenario.quick]
    return scenarios


def prompts_of(tokenizer, scenario: Scenario) -> list[list[int]]:
    """A scenario's prompts as tokens (in the chat template if it says so)."""
    return [tokenizer.chat_prompt(text) if scenario.chat else tokenizer.tokenize(text) for text in scenario.prompts]
