"""Stage CPUs where the OS has no per-thread affinity (macOS): every CPU, and pinning skipped."""

import os

import pytest

from orchestrator.workers import affinity


def test_on_linux_a_process_reads_and_pins_its_cpus():
    if not affinity.can_pin():
        pytest.skip("this OS has no per-thread affinity")
    cpus = affinity.process_cpus()
    assert cpus == tuple(sorted(os.sched_getaffinity(0)))
    assert affinity.pin_threads(cpus) and affinity.process_cpus() == cpus


def test_without_the_linux_calls_every_cpu_is_the_process_and_pinning_is_skipped(monkeypatch):
    for name in ("sched_getaffinity", "sched_setaffinity"):
        monkeypatch.delattr(os, name, raising=False)
    assert affinity.process_cpus() == tuple(range(os.cpu_count()))
    assert not affinity.can_pin() and affinity.pin_threads((0,)) is False


def test_without_a_thread_list_pinning_is_skipped(monkeypatch, tmp_path):
    monkeypatch.setattr(affinity, "THREADS", str(tmp_path / "no-such-folder"))
    assert affinity.pin_threads((0,)) is False
