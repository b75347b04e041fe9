"""Naming the log of a Ray worker that died (orchestrator.cluster.ray_calls.held_log), on folders laid out as
Ray's session logs: the worker's stderr log in logs/, or in logs/old/ once Ray's log monitor moved it."""

import os

from orchestrator.cluster.ray_calls import held_log

FATAL = "Fatal Python error: Segmentation fault\n\nThread 0x01 (most recent call first):\n"


def write(path, text: str, written: float):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    os.utime(path, (written, written))


def test_the_newest_log_of_the_process_id_is_named_with_its_fatal_error_moved_to_old_or_not(tmp_path):
    """A long session reuses process ids: an older worker's log of the same id (its name sorting last)
    is not the one, and the one may have been moved to old/."""
    logs = tmp_path / "logs"
    write(logs / "worker-ffff-01000000-4242.err", "an older worker's\n", 1000.0)
    write(logs / "old" / "worker-0000-01000000-4242.err", FATAL, 2000.0)
    write(logs / "worker-aaaa-01000000-4243.err", FATAL, 3000.0)  # another process
    assert held_log(str(logs), 4242) == (f"its log: {logs / 'old' / 'worker-0000-01000000-4242.err'} "
                                         "(Fatal Python error: Segmentation fault)")
    write(logs / "worker-1111-01000000-4242.err", "", 4000.0)  # newer still, without a fatal error
    assert held_log(str(logs), 4242) == f"its log: {logs / 'worker-1111-01000000-4242.err'}"
    assert held_log(str(logs), 77) is None
