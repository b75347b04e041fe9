"""The chaos soak's verdict (benchmarks.chaos): which fault each request that
did not equal its solo output is laid to, and what fails the soak."""

from __future__ import annotations

from benchmarks.chaos import Fault, Outcome, Soak, cut_link, leaks, passed, refusal, report
from benchmarks.chaos_hosts import LINK_SECONDS, HostsCluster


def soak(*outcomes: tuple[str, float], faults=(("stage", 1.0, 2.0), ("replica", 5.0, 9.0))) -> Soak:
    state = Soak()
    state.faults = [Fault(kind, at, recovered_seconds=back) for kind, at, back in faults]
    state.outcomes = [Outcome(index, kind, "", ended) for index, (kind, ended) in enumerate(outcomes)]
    return state


def test_each_request_not_equal_is_laid_to_the_last_fault_before_it_ended():
    result = report(soak(("equal", 0.5), ("retryable", 1.5), ("retryable", 6.0), ("retryable", 7.0), ("equal", 8.0)),
                    [0, 0], [], 10.0)
    assert result["requests"] == 5 and result["outcomes"]["equal"] == 2
    assert result["not_equal_by_fault"]["stage"] == {"retryable": 1}
    assert result["not_equal_by_fault"]["replica"] == {"retryable": 2}
    assert result["faults"]["stage"] == 1 and result["recovery_seconds"]["replica"] == {"p50": 9.0, "p95": 9.0}
    assert passed(result)


def test_a_wrong_token_a_cut_stream_a_held_cell_or_a_leak_fails_the_soak():
    assert not passed(report(soak(("wrong", 0.5)), [0, 0], [], 1.0))
    assert not passed(report(soak(("cut", 1.5)), [0, 0], [], 1.0))  # during the stage fault: it must replay
    assert not passed(report(soak(("cut", 6.0)), [0, 0], [], 1.0))  # the coordinator's: the front asks again
    assert not passed(report(soak(("equal", 1.5)), [0, 12], [], 1.0))
    assert not passed(report(soak(("equal", 1.5)), [0, 0], ["process 7: more descriptors"], 1.0))


def test_a_surviving_process_holding_more_descriptors_sockets_or_a_tenth_more_memory_leaks():
    before = {7: {"fds": 30, "sockets": 4, "rss_mb": 200.0}, 8: {"fds": 30, "sockets": 4, "rss_mb": 200.0}}
    assert leaks(before, {7: {"fds": 30, "sockets": 4, "rss_mb": 219.0}}) == []  # 8 was replaced: fresh
    assert len(leaks(before, {7: {"fds": 31, "sockets": 4, "rss_mb": 200.0}})) == 1
    assert len(leaks(before, {7: {"fds": 30, "sockets": 5, "rss_mb": 200.0}})) == 1
    assert len(leaks(before, {7: {"fds": 30, "sockets": 4, "rss_mb": 221.0}})) == 1


def test_only_the_service_s_own_refusals_are_retryable_and_only_a_bare_proxy_500_is_a_cut():
    assert refusal(503, {"Retry-After": "5"}, "the service is degraded") == "retryable"
    assert refusal(429, {"Retry-After": "1"}, "busy") == "retryable"
    assert refusal(503, {}, "no reason to retry given") == "failed"
    assert refusal(500, {}, "Internal Server Error") == "cut"
    assert refusal(500, {}, '{"error": "a bug"}') == "failed"


class Hosts:
    """What cut_link asks of the hosts (benchmarks.chaos_hosts.HostsCluster), without Ray or `ip`."""

    head = "198.18.2.1"

    def __init__(self, nodes: dict[str, str]):
        self.nodes, self.switched = nodes, []

    def stage_host(self, node_id: str) -> str:
        return self.nodes[node_id]

    def link(self, address: str, state: str) -> None:
        self.switched.append((address, state))


def test_a_link_cut_hits_a_stage_off_the_head_and_only_a_passing_one_comes_back(monkeypatch):
    import random
    import time

    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    stages = [{"node": "a"}, {"node": "b"}]
    for seed in range(8):  # stage 0 is on the head's host: never cut there
        hosts = Hosts({"a": "198.18.2.1", "b": "198.18.2.3"})
        assert "stage 1's host 198.18.2.3" in cut_link("link", hosts, stages, random.Random(seed))
        assert hosts.switched == [("198.18.2.3", "down"), ("198.18.2.3", "up")]
    assert slept == [LINK_SECONDS] * 8
    lost = Hosts({"a": "198.18.2.2", "b": "198.18.2.3"})
    assert "for good" in cut_link("link-lost", lost, stages, random.Random(0))
    assert len(lost.switched) == 1 and lost.switched[0][1] == "down" and len(slept) == 8


def test_the_hosts_are_handed_to_the_soak_inside_the_head_s_host_as_they_are():
    hosts = HostsCluster("198.18.2.1:6379", "198.18.2.1", {"198.18.2.2": ["ip", "down"]}, {"198.18.2.2": ["ip", "up"]})
    assert HostsCluster.from_json(hosts.to_json()) == hosts
