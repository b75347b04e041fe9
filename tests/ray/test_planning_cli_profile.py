"""`orchestrate profile` of this machine, and `orchestrate plan` from that profile, as a user runs them."""

import json

from conftest import orchestrate


def test_profile_measures_batches_drafter_and_hop(profile_path):
    profile = json.loads(profile_path.read_text())
    assert profile["batch_sizes"] == [1, 2, 4, 8, 16, 32, 64]
    assert [stage["first_block"] for stage in profile["stages"]] == [0, 15]
    for stage in profile["stages"]:
        assert len(stage["seconds"]) == 7 and all(seconds > 0 for seconds in stage["seconds"])
    assert len(profile["block_seconds"]) == len(profile["head_seconds"]) == len(profile["fixed_seconds"]) == 7
    assert profile["hop_seconds"] > 0 and profile["coordinator_pass_seconds"] > 0
    assert profile["drafter_seconds_per_token"]["ngram"] > 0
    assert not list(profile_path.parent.glob("*.partial*"))


def test_plan_from_a_profile_predicts_each_mode(profile_path):
    result = orchestrate("plan", "--profile", profile_path, "--acceptance", "0.9", "--continuation", "0.9",
                         "--draft-max", "8", "--max-tokens", "64", "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["starts"] == [0, 15]  # the profiled split
    assert set(plan["predictions"]) == {"plain", "sync", "async"}
    assert all(mode["tokens_per_second"] > 0 for mode in plan["predictions"].values())
    assert plan["predictions"]["sync"]["draft_max"] == 8
