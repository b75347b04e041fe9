"""`orchestrate run` across two real network hosts: a Ray head and a worker in
two network namespaces joined by a bandwidth-limited veth link (1 Gbit/s; a
1 ms delay too where the kernel has netem), the driver on the head's host.
Output must equal the whole model, and the stages must run on different hosts.
Skips where namespaces cannot be made (not root, no iproute2)."""

from __future__ import annotations

import json
import os
import warnings

import pytest
from conftest import PROMPTS
from network_hosts import NamespacesUnavailable, RayAcrossHosts, TwoHosts

pytestmark = pytest.mark.hosts

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def hosts():
    try:
        two_hosts = TwoHosts(str(os.getpid())).open()
    except NamespacesUnavailable as reason:
        pytest.skip(f"two-host test needs network namespaces: {reason}")
    try:
        yield two_hosts
    finally:
        two_hosts.close()


@pytest.fixture(scope="module")
def cluster(hosts):
    ray_nodes = RayAcrossHosts(hosts)
    try:
        alive = ray_nodes.start()
        assert sorted(alive) == sorted([hosts.first.address, hosts.second.address]), alive
        yield ray_nodes
    finally:
        ray_nodes.close()


@pytest.fixture(autouse=True)
def report_link(hosts):
    """Say what the link got; where netem is missing, say so as a pytest warning."""
    for note in hosts.link_notes:
        print(f"two-host link: {note}")
    if not hosts.netem_available:
        warnings.warn("two-host test ran WITHOUT link delay: netem is not available in this kernel", stacklevel=1)


def run_across_hosts(cluster: RayAcrossHosts, stage_files: list[str], *options: str) -> dict:
    """`orchestrate run` from the head's host; its JSON report."""
    result = cluster.driver(
        ["-m", "orchestrator.cli", "run", "--model-split", *stage_files, "--address", cluster.address,
         "--prompt", PROMPTS[0], "--max-tokens", str(MAX_TOKENS), "--json", *options],
        timeout=300,
    )
    assert result is not None, f"orchestrate run timed out\n{cluster.log_tail()}"
    assert result.returncode == 0, f"orchestrate run failed:\n{result.stderr}\n{cluster.log_tail()}"
    return json.loads(result.stdout)


@pytest.mark.parametrize("speculator, placed_by", [("none", "stage resources"), ("ngram", "--place")])
def test_run_across_two_hosts_equals_whole_model(cluster, splits, reference, speculator, placed_by):
    """The worker advertises specpipe-stage-0 and the head specpipe-stage-1: a run
    places the stages by those alone, or by --place, which wins over them."""
    first, second = cluster.hosts.first.address, cluster.hosts.second.address
    if placed_by == "--place":
        place, expected = ["--place", f"0={first},1={second}"], [first, second]
    else:
        place, expected = [], [second, first]
    report = run_across_hosts(cluster, splits[2], "--speculator", speculator, *place)
    assert report["tokens"] == reference.greedy(reference.tokenize(PROMPTS[0]), MAX_TOKENS).tokens
    assert [stage["host"] for stage in report["stages"]] == expected
    assert report["stages"][0]["node"] != report["stages"][1]["node"]
    if speculator == "ngram":
        assert {drafter["node"] for drafter in report["speculators"]} == {stage["node"] for stage in report["stages"]}
