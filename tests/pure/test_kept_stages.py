"""What a restarted coordinator takes over (orchestrator.cluster.kept_stages): the
newest actor of each stage named with the service's tag, and only a stage
that holds the slice the stage file describes."""

from __future__ import annotations

from pathlib import Path

from orchestrator.cluster.kept_stages import KeptStages, holds, stage_names
from orchestrator.workers.stage_server import StageDescription
from stages.gguf_file import StageFileInfo

TAG = "0a1b2c3d"


def test_each_stage_s_newest_actor_of_this_service_is_found():
    names = [f"specpipe-stage-0.{TAG}", f"specpipe-stage-1.{TAG}", f"specpipe-stage-1.{TAG}.r2",
             f"specpipe-stage-1.{TAG}.r1", "specpipe-stage-0.ffff0000", f"specpipe-drafter-0.{TAG}.9f9f",
             f"specpipe-stage-0.{TAG}x", "SERVE_CONTROLLER_ACTOR"]
    assert stage_names(TAG, names) == {0: (f"specpipe-stage-0.{TAG}", 0), 1: (f"specpipe-stage-1.{TAG}.r2", 2)}


def test_a_service_gets_its_own_tag_secret_and_certificate():
    one, other = KeptStages.new(tls=True), KeptStages.new(tls=False)
    assert one.tag != other.tag and one.secret != other.secret and len(one.tag) == 8
    assert one.certificate is not None and other.certificate is None
    assert one.group_name == f"specpipe-stages.{one.tag}"


def description(index=1, count=2, first=15, end=30, fingerprint="f" * 64) -> StageDescription:
    return StageDescription(index, count, first, end, "node", "127.0.0.1", 1, 49152, source_fingerprint=fingerprint)


def test_only_a_stage_holding_the_same_slice_of_the_same_model_is_taken_over():
    info = StageFileInfo(Path("stage-1.gguf"), 1, 2, 15, 15, 30, "f" * 64, "m")
    assert holds(description(), info)
    assert not holds(description(fingerprint="e" * 64), info)  # another model
    assert not holds(description(first=14), info)  # cut elsewhere
    assert not holds(description(index=0, first=0, end=15), info)
    assert holds(description(0, 1, 0, 30, ""), None)  # a whole model, one stage
    assert not holds(description(), None)
