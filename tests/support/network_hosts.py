"""Two "hosts" on one machine: network namespaces joined by a shaped veth link,
and a Ray cluster with its head on one and a worker on the other.

Everything here is owned by the test that creates it: namespace names carry
the pytest process id, Ray runs as ``ray start --block`` processes in their
own process groups with their own temporary folder, and ``close`` kills those
groups (and anything else left in the namespaces) and deletes the namespaces.
It never runs ``ray stop``, which would stop every Ray on the machine.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]  # where drivers run `-m orchestrator.cli`
DELAY_LINE = Path(__file__).resolve().with_name("delay_line.py")

LINK_RATE = "1gbit"
LINK_DELAY = "1ms"  # one way, applied only where the kernel has netem
TBF_SHAPING = ["tbf", "rate", LINK_RATE, "burst", "256kb", "latency", "50ms"]
NETEM_SHAPING = ["netem", "delay", LINK_DELAY, "rate", LINK_RATE]
TERMINAL_COLOURS = re.compile(r"\x1b\[[0-9;]*m")


class NamespacesUnavailable(RuntimeError):
    """This machine or user cannot create network namespaces (the test skips)."""


@dataclass(frozen=True)
class Host:
    """One namespace: its name, its end of the veth link and that end's address."""

    namespace: str
    interface: str
    address: str

    def command(self, *arguments: str) -> list[str]:
        """``arguments`` run inside this host's namespace."""
        return [tool("ip"), "netns", "exec", self.namespace, *arguments]


def tool(name: str) -> str:
    """The full path of a system command (root's sbin folders may be off PATH), or just its name."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin:/bin") or name


def _run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=30)


def _check(command: list[str]) -> None:
    result = _run(command)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {result.stderr.strip()}")


class TwoHosts:
    """Namespaces ``first`` (198.18.0.1) and ``second`` (198.18.0.2) joined by
    a veth pair limited to 1 Gbit/s each way, plus a 1 ms delay each way where
    netem exists; or, with ``delay_ms``, by two TUN devices and a relay
    process that delays every packet that long one way
    (delay_line.py beside this file), limited to 1 Gbit/s with tbf as well.
    ``link_notes`` says what the link got and what it lacks."""

    def __init__(self, tag: str, delay_ms: float | None = None):
        self.delay_ms = delay_ms
        ends = ("tun-a", "tun-b") if delay_ms is not None else ("veth-a", "veth-b")
        self.first = Host(f"specpipe-{tag}-a", ends[0], "198.18.0.1")
        self.second = Host(f"specpipe-{tag}-b", ends[1], "198.18.0.2")
        self.link_notes: list[str] = []
        self.netem_available = False
        self.delayed = False  # every packet crosses the delay line
        self._created: list[str] = []
        self._process_groups: list[subprocess.Popen] = []
        self._stopped: set[int] = set()

    def open(self) -> TwoHosts:
        if os.geteuid() != 0:
            raise NamespacesUnavailable("network namespaces need root")
        missing = [name for name in ("ip", "tc") if tool(name) == name]
        if missing:
            raise NamespacesUnavailable(f"no {' or '.join(missing)} command (iproute2)")
        result = _run([tool("ip"), "netns", "add", self.first.namespace])
        if result.returncode != 0:
            raise NamespacesUnavailable(f"cannot create a network namespace: {result.stderr.strip()}")
        self._created.append(self.first.namespace)
        try:
            _check([tool("ip"), "netns", "add", self.second.namespace])
            self._created.append(self.second.namespace)
            if self.delay_ms is not None:
                self._open_delay_line()
            else:
                # Created straight inside the namespaces: no name clash with other runs.
                veth = _run([tool("ip"), "link", "add", self.first.interface, "netns", self.first.namespace, "type",
                             "veth", "peer", "name", self.second.interface, "netns", self.second.namespace])
                if veth.returncode != 0:
                    raise NamespacesUnavailable(f"cannot create a veth pair: {veth.stderr.strip()}")
            for host in (self.first, self.second):
                _check([tool("ip"), "-n", host.namespace, "link", "set", "lo", "up"])
                if self.delay_ms is None:
                    _check([tool("ip"), "-n", host.namespace, "address", "add", f"{host.address}/24", "dev",
                            host.interface])
                    _check([tool("ip"), "-n", host.namespace, "link", "set", host.interface, "up"])
                self._shape(host)
        except BaseException:
            self.close()
            raise
        return self

    def _open_delay_line(self) -> None:
        """Start the relay that makes the two TUN ends and carries packets between them."""
        if not os.path.exists("/dev/net/tun"):
            raise NamespacesUnavailable("no /dev/net/tun for the delay line")
        ready = Path(tempfile.mkdtemp(prefix="specpipe-delay-")) / "ready"
        with open(ready.with_name("delay_line.log"), "wb") as log:
            process = subprocess.Popen(
                [sys.executable, str(DELAY_LINE), self.first.namespace, self.first.address,
                 self.second.namespace, self.second.address, str(self.delay_ms), str(ready)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPOSITORY)
        self._process_groups.append(process)
        deadline = time.monotonic() + 30
        while not ready.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise NamespacesUnavailable(f"the delay line did not start: {ready.with_name('delay_line.log').read_text()}")
            time.sleep(0.05)
        self.delayed = True

    def _shape(self, host: Host) -> None:
        """Bandwidth limit on the host's end of the link, with a delay if netem exists
        (or the delay line's: then tbf alone)."""
        if self.delayed:
            _check(host.command(tool("tc"), "qdisc", "add", "dev", host.interface, "root", *TBF_SHAPING))
            self.link_notes.append(f"{host.interface}: tbf rate {LINK_RATE}, delay {self.delay_ms:g} ms one way "
                                   "(tests/support/delay_line.py)")
            return
        netem = _run(host.command(tool("tc"), "qdisc", "add", "dev", host.interface, "root", *NETEM_SHAPING))
        if netem.returncode == 0:
            self.netem_available = True
            note = f"{host.interface}: netem delay {LINK_DELAY}, rate {LINK_RATE}"
        else:
            _check(host.command(tool("tc"), "qdisc", "add", "dev", host.interface, "root", *TBF_SHAPING))
            reason = netem.stderr.strip().splitlines()[0] if netem.stderr.strip() else f"exit {netem.returncode}"
            note = f"{host.interface}: tbf rate {LINK_RATE}, NO delay (netem unavailable: {reason})"
        self.link_notes.append(note)

    def start(self, host: Host, arguments: list[str], log_path: Path, environment: dict[str, str]) -> subprocess.Popen:
        """Start a long-running command in ``host``, in its own process group, logging to ``log_path``."""
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                host.command(*arguments), stdout=log, stderr=subprocess.STDOUT, env=environment,
                start_new_session=True,
            )
        self._process_groups.append(process)
        return process

    def stop(self, process: subprocess.Popen) -> None:
        """Kill the process group that ``start`` gave ``process`` (once: its id may be reused after)."""
        if process.pid in self._stopped:
            return
        self._stopped.add(process.pid)
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass

    def close(self) -> None:
        """Kill what was started here and everything left in the namespaces; delete the namespaces."""
        for process in self._process_groups:
            self.stop(process)
        for namespace in self._created:
            pids = _run([tool("ip"), "netns", "pids", namespace]).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for namespace in reversed(self._created):
            _run([tool("ip"), "netns", "delete", namespace])  # takes its end of the veth pair with it
        self._created.clear()
        self._process_groups.clear()


NODES_PROBE = """
import json, sys, time
import ray
ray.init(address=sys.argv[1], log_to_driver=False, configure_logging=False)
deadline = time.monotonic() + float(sys.argv[3])
while True:
    alive = sorted(node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"])
    if len(alive) >= int(sys.argv[2]) or time.monotonic() > deadline:
        break
    time.sleep(0.5)
print(json.dumps(alive))
"""


class RayAcrossHosts:
    """A Ray head on ``hosts.first`` and a worker on ``hosts.second``.

    Token authentication stays on: a fresh token is given to the head, the
    worker and every driver in RAY_AUTH_TOKEN (with RAY_AUTH_MODE=token), so
    it works the same whether or not ~/.ray/auth_token exists, and that file
    is neither read nor written."""

    port = 6379  # the namespaces are private, so the default port is free in them

    def __init__(self, hosts: TwoHosts):
        self.hosts = hosts
        self.address = f"{hosts.first.address}:{self.port}"
        self.folder = Path(tempfile.mkdtemp(prefix="specpipe-ray-"))  # short: Ray's socket paths must fit 107 bytes
        self.environment = {name: value for name, value in os.environ.items() if not name.startswith("RAY_")}
        self.environment.update(
            RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32), RAY_USAGE_STATS_ENABLED="0",
        )
        self._nodes: list[tuple[str, subprocess.Popen]] = []

    def dead_after_missed_checks(self, missed: int) -> None:
        """Ray's health checks a second apart, a node called dead after ``missed`` of them (set before start):
        a host cut off is found dead in about that many seconds, not 30-60 s on at Ray's defaults."""
        self.environment.update(RAY_health_check_period_ms="1000", RAY_health_check_timeout_ms="1000",
                                RAY_health_check_failure_threshold=str(missed))

    @staticmethod
    def ray_command() -> str:
        beside_python = Path(sys.executable).with_name("ray")
        return str(beside_python) if beside_python.exists() else "ray"

    def _start_node(self, name: str, host: Host, arguments: list[str]) -> None:
        temporary = self.folder / name
        temporary.mkdir()
        command = [
            self.ray_command(), "start", *arguments, "--node-ip-address", host.address, "--num-cpus", "2",
            "--object-store-memory", str(100 * 1000**2), "--temp-dir", str(temporary), "--disable-usage-stats",
            "--block",
        ]
        environment = {**self.environment, "SPECPIPE_STAGE_CACHE": str(self.stage_cache(name))}
        self._nodes.append((name, self.hosts.start(host, command, self.folder / f"{name}.log", environment)))

    def stage_cache(self, name: str) -> Path:
        """Node ``name``'s own stage cache (the hosts share one file system; each node gets a folder)."""
        return self.folder / f"{name}-stages"

    def start(self, timeout: float = 120.0) -> list[str]:
        """Start head and worker; return the alive nodes' addresses once both are up."""
        # Each host advertises the stage it holds, as cluster.yaml starts them, but
        # the other way round (the worker holds stage 0), so that a placement by
        # these resources cannot be mistaken for Ray's own choice.
        self._start_node("head", self.hosts.first, ["--head", "--port", str(self.port), "--include-dashboard=false",
                                                    "--resources", '{"specpipe-stage-1": 1}'])
        self._start_node("worker", self.hosts.second, ["--address", self.address,
                                                       "--resources", '{"specpipe-stage-0": 1}'])
        deadline = time.monotonic() + timeout
        alive: list[str] = []
        while time.monotonic() < deadline:
            self._check_running()
            remaining = max(deadline - time.monotonic(), 1.0)
            probe = self.driver(["-c", NODES_PROBE, self.address, "2", str(min(remaining, 30.0))],
                                timeout=min(remaining, 30.0) + 30)
            if probe is not None and probe.returncode == 0:
                alive = json.loads(probe.stdout.strip().splitlines()[-1])
                if len(alive) >= 2:
                    return alive
            time.sleep(1.0)
        raise RuntimeError(f"Ray nodes not all up within {timeout:.0f} s (alive: {alive})\n{self.log_tail()}")

    def _check_running(self) -> None:
        for name, process in self._nodes:
            if process.poll() is not None:
                raise RuntimeError(f"ray {name} exited with status {process.returncode}\n{self.log_tail()}")

    def driver(self, arguments: list[str], timeout: float, env: dict[str, str] | None = None
               ) -> subprocess.CompletedProcess | None:
        """Run this Python with ``arguments`` on the head's host as a driver
        (env: variables added); None if it timed out."""
        try:
            return subprocess.run(
                self.hosts.first.command(sys.executable, *arguments), capture_output=True, text=True,
                env={**self.environment, **(env or {})}, timeout=timeout, cwd=REPOSITORY,
            )
        except subprocess.TimeoutExpired:
            return None

    def log_tail(self, lines: int = 15) -> str:
        """The last lines of each node's output and of its raylet and GCS logs."""
        names = [name for name, _ in self._nodes]
        files = [self.folder / f"{name}.log" for name in names]
        for name in names:
            files += sorted((self.folder / name).glob("session_*/logs/raylet.out"))
            files += sorted((self.folder / name).glob("session_*/logs/gcs_server.out"))
        parts = []
        for path in files:
            if path.exists():
                text = TERMINAL_COLOURS.sub("", path.read_text(errors="replace")).splitlines()[-lines:]
                parts.append(f"--- {path.relative_to(self.folder)}\n" + "\n".join(text))
        return "\n".join(parts) or "(no Ray logs were written)"

    def close(self) -> None:
        """Kill both nodes' process groups and remove the temporary folder."""
        for _, process in self._nodes:
            self.hosts.stop(process)
        shutil.rmtree(self.folder, ignore_errors=True)


class ThreeHosts:
    """Namespaces ``first`` (198.18.2.1), ``second`` (.2) and ``third`` (.3)
    on one bridge inside ``first``, a switch with a port per other host
    (unshaped: these tests cut links, they do not time them). ``cut(host)``
    takes the host's port on the switch down: its machine is still there,
    its link is not. The same start/stop/close as TwoHosts."""

    def __init__(self, tag: str):
        self.first = Host(f"specpipe-{tag}-x1", "br-specpipe", "198.18.2.1")
        self.second = Host(f"specpipe-{tag}-x2", "veth-x2", "198.18.2.2")
        self.third = Host(f"specpipe-{tag}-x3", "veth-x3", "198.18.2.3")
        self._helper = TwoHosts(tag)  # its start, stop and close, over these namespaces
        self._created = self._helper._created

    def open(self) -> ThreeHosts:
        if os.geteuid() != 0:
            raise NamespacesUnavailable("network namespaces need root")
        for host in (self.first, self.second, self.third):
            result = _run([tool("ip"), "netns", "add", host.namespace])
            if result.returncode != 0:
                self.close()
                raise NamespacesUnavailable(f"cannot create a network namespace: {result.stderr.strip()}")
            self._created.append(host.namespace)
        try:
            switch = self.first
            bridge = _run([tool("ip"), "-n", switch.namespace, "link", "add", switch.interface, "type", "bridge"])
            if bridge.returncode != 0:
                raise NamespacesUnavailable(f"cannot create a bridge: {bridge.stderr.strip()}")
            for host in (self.second, self.third):
                _check([tool("ip"), "link", "add", self.port(host), "netns", switch.namespace, "type", "veth",
                        "peer", "name", host.interface, "netns", host.namespace])
                _check([tool("ip"), "-n", switch.namespace, "link", "set", self.port(host), "master",
                        switch.interface, "up"])
            for host in (self.first, self.second, self.third):
                _check([tool("ip"), "-n", host.namespace, "link", "set", "lo", "up"])
                _check([tool("ip"), "-n", host.namespace, "address", "add", f"{host.address}/24", "dev",
                        host.interface])
                _check([tool("ip"), "-n", host.namespace, "link", "set", host.interface, "up"])
        except BaseException:
            self.close()
            raise
        return self

    @staticmethod
    def port(host: Host) -> str:
        """The switch's port for ``host``."""
        return f"{host.interface}-sw"

    def cut_command(self, host: Host) -> list[str]:
        """The command that takes ``host``'s link down (run it from anywhere on this machine)."""
        return [tool("ip"), "-n", self.first.namespace, "link", "set", self.port(host), "down"]

    def restore_command(self, host: Host) -> list[str]:
        """The command that puts ``host``'s link back up (benchmarks.chaos_hosts: a cut that heals)."""
        return [tool("ip"), "-n", self.first.namespace, "link", "set", self.port(host), "up"]

    def start(self, host: Host, arguments: list[str], log_path: Path, environment: dict[str, str]) -> subprocess.Popen:
        return self._helper.start(host, arguments, log_path, environment)

    def stop(self, process: subprocess.Popen) -> None:
        self._helper.stop(process)

    def close(self) -> None:
        self._helper.close()


class RayOnThreeHosts(RayAcrossHosts):
    """A Ray head on ``hosts.first`` and a worker on each other host, none
    advertising a stage: a pipeline of two stages spreads over them with one
    node spare."""

    def start(self, timeout: float = 120.0) -> list[str]:
        self._start_node("head", self.hosts.first, ["--head", "--port", str(self.port), "--include-dashboard=false"])
        for name, host in (("second", self.hosts.second), ("third", self.hosts.third)):
            self._start_node(name, host, ["--address", self.address])
        deadline = time.monotonic() + timeout
        alive: list[str] = []
        while time.monotonic() < deadline:
            self._check_running()
            probe = self.driver(["-c", NODES_PROBE, self.address, "3", "30"], timeout=60)
            if probe is not None and probe.returncode == 0:
                alive = json.loads(probe.stdout.strip().splitlines()[-1])
                if len(alive) >= 3:
                    return alive
            time.sleep(1.0)
        raise RuntimeError(f"Ray nodes not all up within {timeout:.0f} s (alive: {alive})\n{self.log_tail()}")
