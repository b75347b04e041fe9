"""`orchestrate bench --serve --quick`: a file of its own (about 3 minutes),
so that pytest-xdist runs it beside the quick bench and the planner's
check against it (tests/ray/test_bench.py)."""

import json

from conftest import orchestrate


def test_quick_serve_bench_compares_the_servers_under_load(tmp_path):
    """`orchestrate bench --serve --quick`: every server at concurrency 1 and 2,
    outputs equal to each server's solo run and to llama-cpp-python's server."""
    out = tmp_path / "serve-bench"
    result = orchestrate("bench", "--serve", "--quick", "--out", out, timeout=900)
    assert result.returncode == 0, result.stderr
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
