"""`orchestrate bench --serve --quick` (about 2 minutes): servers under
load, so in `make test-system`, not `make test` (the `system` marker)."""

import json

import pytest

pytestmark = pytest.mark.system  # servers under load for minutes: `make test-system`


def drivers_of(command: str) -> int:
    """How many drivers `orchestrate COMMAND` has had on this worker's cluster (Ray's job table: the
    state API would need the dashboard, which the session's cluster leaves off)."""
    from ray._private.state import jobs

    return sum(f"orchestrator.cli {command} " in job["Entrypoint"] for job in jobs())


def test_quick_serve_bench_compares_the_servers_under_load(tmp_path, orchestrate_on_cluster):
    """`orchestrate bench --serve --quick` on the session's cluster (this
    project's servers join it, as they would a user's): every server at
    concurrency 1 and 2, outputs equal to each server's solo run and to
    llama-cpp-python's server."""
    out = tmp_path / "serve-bench"
    served, benched = drivers_of("serve"), drivers_of("bench")
    result = orchestrate_on_cluster("bench", "--serve", "--quick", "--out", out, timeout=900)
    assert result.returncode == 0, result.stderr
    # both of this project's servers and the in-process run joined the cluster: no Ray of their own
    assert (drivers_of("serve") - served, drivers_of("bench") - benched) == (2, 1)
    results = json.loads((out / "serve.json").read_text())
    from benchmarks.peers import built

    servers = ["specpipe-2-stages-no-http", "specpipe-2-stages", "specpipe-whole", "llama-cpp-server"]
    servers += ["cpp-llama-server"] * built()  # llama.cpp's own server, where make peers built it
    assert results["servers"] == servers
    assert [(row["server"], row["concurrency"]) for row in results["rows"]] == [
        (server, level) for server in servers for level in (1, 2)]
    for row in results["rows"]:
        if row["server"] == "cpp-llama-server":  # a peer: its errors and exactness are reported, not required
            assert row["errors"] == 0 or row["error_examples"], row  # a failed request says why
        else:
            assert row["errors"] == 0 and row["matches_solo"] and row["matches_llama_cpp_server"], row
        rate = row["tokens_per_second"]
        assert rate["min"] > 0 and rate["min"] <= rate["median"] <= rate["max"]
        assert row["ttft_p50"]["median"] > 0 and row["itl_p50"]["median"] > 0
    table = (out / "serve.md").read_text()
    assert table.count("| specpipe-2-stages |") == 2 and "× llama-cpp-server" in table
    assert (out / "serve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(path.name for path in out.iterdir()) == ["serve.json", "serve.md", "serve.png"]
