"""The status line `orchestrate run --dashboard` and `orchestrate serve` print
(orchestrator.cluster.connect.dashboard_line): where the dashboard is and how
to get past Ray's token authentication."""

from orchestrator.cluster.connect import dashboard_line

RAY = "/opt/specpipe/.venv/bin/ray"


def test_with_token_authentication_the_line_names_the_command_that_prints_the_token():
    line = dashboard_line("127.0.0.1:8265", "http://10.0.0.5:8080/metrics", True, RAY)
    assert line == ("Ray dashboard: http://127.0.0.1:8265 (it asks for Ray's token: "
                    f"`{RAY} get-auth-token` prints it); metrics: http://10.0.0.5:8080/metrics")


def test_without_token_authentication_the_line_says_no_token_is_needed():
    line = dashboard_line("127.0.0.1:8265", None, False, RAY)
    assert line == "Ray dashboard: http://127.0.0.1:8265 (no token needed: Ray's token authentication is off)"
    assert "get-auth-token" not in line


def test_without_a_dashboard_only_the_metrics_or_nothing():
    assert dashboard_line(None, "http://10.0.0.5:8080/metrics", True, RAY) == "metrics: http://10.0.0.5:8080/metrics"
    assert dashboard_line("", None, True, RAY) is None
    assert dashboard_line(None, None, False, RAY) is None
