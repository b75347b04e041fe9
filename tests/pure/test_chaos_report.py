"""The chaos soak's verdict (benchmarks.chaos): which fault each request that
did not equal its solo output is laid to, and what fails the soak."""

from __future__ import annotations

from benchmarks.chaos import Fault, Outcome, Soak, leaks, passed, refusal, report


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
