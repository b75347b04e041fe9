"""`orchestrate run` with draft-model token trees, end to end on the
session's cluster: a file of its own (about 4 minutes), so that
pytest-xdist runs it beside the other CLI runs (tests/ray/test_cli_runs.py)."""

import json

from conftest import PROMPTS


def test_draft_model_trees_through_the_pipeline_keep_the_greedy_and_the_seeded_text(
        splits, reference, realistic_draft, tmp_path, orchestrate_on_cluster):
    """--speculator model --tree-leaves 4 under a flat emulated curve (a pass
    of 64 tokens costs one, 1 s a stage, so a draft token costs under a
    hundredth of a pass and side rows pay for their growth; at 0.5 s they
    did not, 2026-12-06): greedy gives the whole model's tokens, with trees
    among the passes; a seeded run (coupled drafts, on this CPU's own passes,
    where trees seldom pay: seeded trees are held exact in process,
    tests/model/test_draft_model_trees.py) the plain seeded run's."""
    curve = tmp_path / "flat.json"
    curve.write_text(json.dumps({"name": "flat 1 s", "stages": [{"tokens": [1, 64], "ms": [1000, 1000]}]}))
    common = ["run", "--model-split", *splits[2], "--raw", "--prompt", PROMPTS[1], "--max-tokens", "16", "--json"]
    trees = ["--speculator", "model", "--draft", realistic_draft, "--tree-leaves", "4", "--schedule", "sync"]
    seeded = ["--temperature", "0.8", "--seed", "4"]
    greedy = orchestrate_on_cluster(*common, *trees, "--cost-curve", curve)
    plain_seeded = orchestrate_on_cluster(*common, *seeded)  # a curve changes no token: left out here
    tree_seeded = orchestrate_on_cluster(*common, *trees, *seeded)
    assert all(result.returncode == 0 for result in (greedy, plain_seeded, tree_seeded)), tree_seeded.stderr
    # where this CPU's side rows are inexact (stages.tree_check), the run drafts chains and says so
    said_off = "[token trees off: a side row's output differs from its path's on the machine of stage" in greedy.stderr
    greedy, plain_seeded, tree_seeded = (json.loads(result.stdout) for result in (greedy, plain_seeded, tree_seeded))
    assert greedy["tokens"] == reference.greedy(reference.tokenize(PROMPTS[1]), 16).tokens
    assert tree_seeded["tokens"] == plain_seeded["tokens"]
    assert (greedy["tree_passes"] == 0) if said_off else (greedy["tree_passes"] > 0)
