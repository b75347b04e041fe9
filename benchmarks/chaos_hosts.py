"""The chaos soak across namespace hosts (``python -m benchmarks.chaos
--hosts``, as root): the links between machines are cut, not only processes
killed or stopped.

Three network namespaces on one switch (tests/support/network_hosts.py's
ThreeHosts: 198.18.2.1-3), a Ray node of two CPUs on each, Ray's health
checks a second apart and HEALTH_MISSES missed before a node is called dead
(as tests/hosts/test_lost_host.py). The soak itself runs again inside the
first host (the head's, as `ray exec` runs a command there): a driver of that
cluster, starting ``orchestrate serve`` beside it and sending the requests
from there, so that a cut link is one between the service's machines, never
between the clients and the service. Its faults are the soak's own but the
Ray node removal (``ray.cluster_utils`` cannot remove a node of its own
host), and two of the links':

- ``link``: the switch port of a stage's host (not the head's) down for
  LINK_SECONDS, then up: a cable pulled and put back, TCP's resends carry the
  chain on (the stage is found silent only after
  ``StageDeadlines.silence_seconds``);
- ``link-lost``: that port down for good, once: the host is unreachable, its
  stage found silent, Ray calls the node dead, the stage restarts on another
  host.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.support import network_hosts

REPOSITORY = Path(__file__).resolve().parents[1]
LINK_SECONDS = 8.0
HEALTH_MISSES = 12  # Ray's health checks missed (a second apart) before a cut host's node is dead


@dataclass(frozen=True)
class HostsCluster:
    """What the soak inside the head's host needs of the hosts: Ray's address,
    the head's address, and for each other host the commands that take its
    link down and up. Passed to it as JSON (``--on-hosts``)."""

    address: str
    head: str
    down: dict[str, list[str]]
    up: dict[str, list[str]]

    def to_json(self) -> str:
        return json.dumps({"address": self.address, "head": self.head, "down": self.down, "up": self.up})

    @staticmethod
    def from_json(text: str) -> HostsCluster:
        fields = json.loads(text)
        return HostsCluster(fields["address"], fields["head"], fields["down"], fields["up"])

    def stage_host(self, node_id: str) -> str:
        """The address of the host that runs Ray node ``node_id``."""
        import ray

        [address] = [node["NodeManagerAddress"] for node in ray.nodes() if node["NodeID"] == node_id]
        return address

    def link(self, address: str, state: str) -> None:
        subprocess.run((self.down if state == "down" else self.up)[address], check=True, timeout=30)


def run_on_hosts(argv: list[str]) -> int:
    """Open the hosts and their Ray nodes, run the soak (``argv``) inside the
    head's host, close everything; the soak's exit status."""
    try:
        hosts = network_hosts.ThreeHosts(f"chaos{os.getpid()}").open()
    except network_hosts.NamespacesUnavailable as reason:
        raise SystemExit(f"chaos --hosts needs network namespaces and a bridge (run as root): {reason}")
    try:
        ray_nodes = network_hosts.RayOnThreeHosts(hosts)
        ray_nodes.dead_after_missed_checks(HEALTH_MISSES)
        ray_nodes.environment.update(RAY_worker_niceness="0")  # the stages are the work (connect.ray_environment)
        try:
            ray_nodes.start()
            others = (hosts.second, hosts.third)
            cluster = HostsCluster(ray_nodes.address, hosts.first.address,
                                   {host.address: hosts.cut_command(host) for host in others},
                                   {host.address: hosts.restore_command(host) for host in others})
            command = hosts.first.command(sys.executable, "-m", "benchmarks.chaos", *argv,
                                          "--on-hosts", cluster.to_json())
            started = time.monotonic()
            # from this folder (a relative --out), this checkout importable there
            soak = subprocess.run(command, env={**ray_nodes.environment, "PYTHONPATH": str(REPOSITORY)})
            if soak.returncode != 0:
                print(f"chaos --hosts: the soak ended with status {soak.returncode} after "
                      f"{time.monotonic() - started:.0f} s\n{ray_nodes.log_tail()}", file=sys.stderr)
            return soak.returncode
        finally:
            ray_nodes.close()
    finally:
        hosts.close()
