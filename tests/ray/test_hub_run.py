"""`orchestrate run --model hf:ORG/REPO:QUANT` on a local Ray: the driver reads
the header, each stage's node fetches just its slice from the stand-in Hub
(tests/support/hub_server.py, through HF_ENDPOINT), the tokens are the whole
model's, and a second run fetches nothing (the model tier covers resuming and
bad sources: tests/model/test_hub_source.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import PROMPTS, orchestrate
from stages.gguf_file import read_model
from stages.split import plan_split, stage_file_image
from stages.stage_image import SourceRange
from support.hub_server import HubServer

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def hub(smollm2):
    server = HubServer().start()
    server.add("org/smol", {Path(smollm2).name: Path(smollm2)})
    yield server
    server.close()


def hub_run(hub, cache: Path) -> dict:
    result = orchestrate("run", "--model", "hf:org/smol:Q4_1", "--stages", "2", "--raw", "--prompt", PROMPTS[0],
                         "--max-tokens", str(MAX_TOKENS), "--json",
                         env={"HF_ENDPOINT": hub.endpoint, "SPECPIPE_STAGE_CACHE": str(cache)})
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    report["stderr"] = result.stderr
    return report


def test_each_node_fetches_its_slice_from_the_hub_and_a_second_run_nothing(hub, smollm2, splits, reference,
                                                                          tmp_path):
    expected = reference.greedy(reference.tokenize(PROMPTS[0]), MAX_TOKENS).tokens
    data_start = min(tensor.offset for tensor in read_model(smollm2).tensors)
    images = [stage_file_image(plan_split(read_model(smollm2), 2, [15]), index) for index in (0, 1)]

    first = hub_run(hub, tmp_path)
    assert first["tokens"] == expected
    assert [stage["layers"] for stage in first["stages"]] == [[0, 15], [15, 30]]
    assert [item["from"] for item in first["shipped"]] == ["source", "source"]
    for item, split_file in zip(first["shipped"], splits[2]):
        assert Path(item["path"]).read_bytes() == Path(split_file).read_bytes()
    assert "fetching stage 0:" in first["stderr"] and "fetching stage 1:" in first["stderr"]

    served = hub.served()
    header_reads = [item for item in served if item.start < data_start]
    tensor_ranges = sorted((item.start, item.sent) for item in served if item.start >= data_start)
    asked = sorted((part.offset, part.length) for image in images for part in image.parts
                   if isinstance(part, SourceRange))
    assert tensor_ranges == asked  # each stage's tensors, once each (the stages share the tied embedding)
    assert sum(sent for _, sent in tensor_ranges) < 2 * Path(smollm2).stat().st_size * 0.7
    assert sum(item.sent for item in header_reads) <= 3 * data_start  # the driver read the header, no more

    again = hub_run(hub, tmp_path)
    assert again["tokens"] == expected
    assert [item["bytes_sent"] for item in again["shipped"]] == [0, 0]
    assert all(item.start < data_start for item in hub.served()[len(served):])  # only the driver's header reads
