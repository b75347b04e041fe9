"""`orchestrate plan` from a setup file, and `plan` and `profile` refusing bad setups, profiles and stage files,
as a user runs them (a profile measured on this machine: tests/ray/test_planning_cli_profile.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import orchestrate

SETUP_405B = Path(__file__).parents[2] / "benchmarks" / "setups" / "llama-405b-two-machines.toml"


def test_plan_projects_405b_on_two_machines_within_memory():
    """One draft length and short generations: the split and its memory do not depend on
    them (every draft length, the default: about 25 s of simulation here)."""
    result = orchestrate("plan", SETUP_405B, "--json", "--draft-max", "4", "--max-tokens", "64")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert sum(plan["blocks_per_stage"]) == 126 and len(plan["blocks_per_stage"]) == 2
    assert all(need <= 0.9 * 192e9 for need in plan["memory_needed_bytes"])
    assert plan["predictions"]["sync"]["tokens_per_second"] > plan["predictions"]["plain"]["tokens_per_second"]


@pytest.mark.parametrize("text, message", [
    ("not = [toml", "not TOML"),
    ("[model]\nblocks = 2\n", "width is missing"),
    ("[model]\nblocks = 126\nwidth = 16384\nvocab = 128256\nparameters = 405e9\nbits_per_weight = 4\nkv_width = 1024\n"
     "[[machines]]\nmemory_gb = 16\nbandwidth_gb_per_s = 100\ncompute_tflops = 1\n", "does not fit"),
])
def test_bad_setups_get_one_line(tmp_path, text, message):
    setup = tmp_path / "setup.toml"
    setup.write_text(text)
    result = orchestrate("plan", setup)
    assert result.returncode == 1
    assert result.stderr.startswith("error:") and message in result.stderr and "Traceback" not in result.stderr


def test_profile_of_bad_stage_files_writes_nothing(tmp_path):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a model")
    out = tmp_path / "profile.json"
    result = orchestrate("profile", bogus, bogus, "--whole", bogus, "--out", out)
    assert result.returncode == 1 and result.stderr.startswith("error:")
    assert not out.exists()


@pytest.mark.parametrize("content, message", [
    ('{"kind": "specpipe-profile", "version": 1}', "incomplete or older profile"),
    ("[1, 2", "not JSON"),
    ('{"kind": "something else"}', "not a profile"),
])
def test_bad_profiles_get_one_line(tmp_path, content, message):
    profile = tmp_path / "profile.json"
    profile.write_text(content)
    result = orchestrate("plan", "--profile", profile)
    assert result.returncode == 1
    assert result.stderr.startswith("error:") and message in result.stderr and "Traceback" not in result.stderr
