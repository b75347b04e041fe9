"""Helpers the tests share that are not test doubles (those are in tests/fakes.py):
network namespaces as hosts (network_hosts), the relay that delays their link
(delay_line) and the gguf package's reading of a file (gguf_reading). tests/ is on sys.path under pytest, so tests import them as
``support.network_hosts``; from the repository root they are
``tests.support.network_hosts`` (benchmarks.probe's delayed-link mode)."""
