"""cluster.yaml: valid for `ray up` (Ray's own checks) and right for this project.

No network and no ssh: `ray up` itself is walked through in docs/cluster.md.
"""

import json
import shlex
from pathlib import Path

import pytest
import yaml

from orchestrator.cluster.placement import stage_resource

CLUSTER_YAML = Path(__file__).resolve().parents[2] / "cluster.yaml"
PROJECT_RAY = "~/specpipe/.venv/bin/ray"


@pytest.fixture(scope="module")
def cluster() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def ray_start_options(command: str) -> dict[str, str]:
    """The --name=value options of a `ray start` command, as the shell passes them."""
    words = shlex.split(command)
    assert "start" in words, command
    return dict(word[2:].partition("=")[::2] for word in words if word.startswith("--"))


def only_ray_start(commands: list[str]) -> str:
    starts = [command for command in commands if f"{PROJECT_RAY} start" in command]
    assert len(starts) == 1, commands
    return starts[0]


def test_ray_up_accepts_it(cluster):
    """What `ray up` applies (ray.autoscaler._private.commands._bootstrap_config):
    prepare_config, then validate_config (which alone would wrongly reject the
    top-level min_workers that prepare_config moves into the node type)."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(cluster)
    validate_config(prepared)
    assert prepared["provider"]["type"] == "local"
    assert prepared["provider"]["head_ip"] not in prepared["provider"]["worker_ips"]
    assert cluster["min_workers"] == cluster["max_workers"] == len(prepared["provider"]["worker_ips"])


def test_no_machine_is_tied_to_a_stage(cluster):
    """Stages are placed (and their files shipped) when a run starts, so one
    worker command serves any number of workers: no stage resource in it."""
    for commands in (cluster["head_start_ray_commands"], cluster["worker_start_ray_commands"]):
        options = ray_start_options(only_ray_start(commands))
        assert "resources" not in options or not any(
            name.startswith(stage_resource(0)[:-1]) for name in json.loads(options["resources"]))


def test_more_workers_need_only_their_addresses(cluster):
    """Three workers: the same file with worker_ips and the worker counts changed passes Ray's checks."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    more = {**cluster, "provider": {**cluster["provider"], "worker_ips": ["192.0.2.11", "192.0.2.12", "192.0.2.13"]},
            "min_workers": 3, "max_workers": 3}
    prepared = prepare_config(more)
    validate_config(prepared)
    assert len(prepared["provider"]["worker_ips"]) == 3


def test_the_worker_joins_the_head(cluster):
    head = ray_start_options(only_ray_start(cluster["head_start_ray_commands"]))
    worker = ray_start_options(only_ray_start(cluster["worker_start_ray_commands"]))
    assert "head" in head and "address" not in head
    assert worker["address"] == f"$RAY_HEAD_IP:{head['port']}"  # the autoscaler sets RAY_HEAD_IP
    assert head["autoscaling-config"] == "~/ray_bootstrap_config.yaml"  # the head launches the worker
    assert head["dashboard-host"] == "0.0.0.0"


def test_the_worker_commands_cannot_stop_the_head(cluster):
    """On one box a `ray stop` among the worker's commands stops the head too."""
    assert not any("ray stop" in command for command in cluster["worker_start_ray_commands"])


def test_every_machine_installs_the_project_and_runs_its_ray(cluster):
    assert cluster["file_mounts"]["~/specpipe"] == "."
    assert ".gitignore" in cluster["rsync_filter"]  # not the local .venv
    assert any("make install" in command and "~/specpipe" in command for command in cluster["setup_commands"])
    for commands in (cluster["head_start_ray_commands"], cluster["worker_start_ray_commands"]):
        for command in commands:
            assert shlex.split(command)[0] in ("RAY_AUTH_MODE=token", PROJECT_RAY), command


def test_token_authentication_is_set_up(cluster):
    assert cluster["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    for commands in (cluster["head_start_ray_commands"], cluster["worker_start_ray_commands"]):
        assert shlex.split(only_ray_start(commands))[0] == "RAY_AUTH_MODE=token"
