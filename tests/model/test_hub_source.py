"""``--model hf:...`` without Ray: the header read by range on the driver, a
stage assembled on its node from just its tensors' ranges (byte for byte what
``orchestrate split`` makes), resumed after an interruption, not fetched
again; and every bad source one line. A stand-in Hub (tests/support/hub_server.py)
serves the SmolLM2 file and a 3-shard copy; huggingface_hub is pointed at it
(HF_ENDPOINT, as the ray and hosts tiers set it)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import orchestrate
from support.gguf_reading import write_shards
from support.hub_server import HubServer

from orchestrator.cluster.fetching import StageFetcher
from orchestrator.cluster.stage_cache import CacheEntry
from orchestrator.sources import remote_file
from orchestrator.sources.hub import read_model_source
from orchestrator.sources.hub_reference import SourceReferenceError
from orchestrator.sources.remote_file import SourceError
from stages.gguf_file import ModelFileError, read_model
from stages.split import plan_split, stage_file_image
from stages.stage_image import SourceRange

TOKEN = "hf_test_token_of_the_private_repo"


@pytest.fixture(scope="module")
def hub(smollm2, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hub")
    write_shards(smollm2, str(folder / "smol.gguf"), tensors_per_shard=120)
    name = Path(smollm2).name
    readme = folder / "README.md"
    readme.write_text("# not a model\n" * 100)
    server = HubServer().start()
    server.add("org/smol", {name: Path(smollm2), "README.md": readme, "notes.gguf": readme})
    server.add("org/shards", {f"smol-{k:05d}-of-00003.gguf": folder / f"smol-{k:05d}-of-00003.gguf"
                              for k in (1, 2, 3)})
    server.add("org/private", {name: Path(smollm2)}, token=TOKEN)
    server.add("org/quants", {"a-Q4_1.gguf": Path(smollm2), "b-Q4_1.gguf": Path(smollm2)})
    server.add("org/no-ranges", {name: Path(smollm2)}, ranges=False)
    server.add("org/shifted", {name: Path(smollm2)}, shift=1)
    server.add("org/reuploaded", {name: Path(smollm2)})  # another commit of the same file
    server.folder = folder
    yield server
    server.close()


@pytest.fixture(autouse=True)
def endpoint(hub, monkeypatch):
    """huggingface_hub read HF_ENDPOINT when first imported; here it is set afterwards."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)


def served_bytes(hub, start_index: int = 0) -> int:
    return sum(item.sent for item in hub.served()[start_index:])


def tensor_bytes_after(image, held: int) -> int:
    """Bytes of the image's tensors (what comes from the source) past file offset ``held``."""
    total, position = 0, len(image.header)
    for part in image.parts:
        if isinstance(part, SourceRange):
            total += max(0, position + part.length - max(held, position))
        position += part.length
    return total


def test_the_header_is_read_by_range_and_names_the_same_model(hub, smollm2):
    before = len(hub.served())
    remote = read_model_source(f"hf:org/smol/{Path(smollm2).name}")
    local = read_model(smollm2)
    assert remote.fingerprint == local.fingerprint and remote.name == local.name
    assert [(t.name, t.offset, t.n_bytes) for t in remote.tensors] == [(t.name, t.offset, t.n_bytes)
                                                                       for t in local.tensors]
    header = min(tensor.offset for tensor in local.tensors)
    assert header < served_bytes(hub, before) <= 2 * header + remote_file.SOURCE_FIRST_HEADER_BYTES
    assert served_bytes(hub, before) < Path(smollm2).stat().st_size / 20
    assert str(remote.paths[0]).startswith("hf:org/smol/") and "@" in str(remote.paths[0])


def test_a_quantization_name_and_a_bare_repo_find_the_file(hub, smollm2):
    local = read_model(smollm2).fingerprint
    assert read_model_source("hf:org/smol:Q4_1").fingerprint == local
    assert read_model_source("hf:org/shards").name == "smol-00001-of-00003.gguf"  # the repo's one model


def fetch_stage(model, starts, index, root: Path):
    split = plan_split(model, len(starts), list(starts[1:]))
    image = stage_file_image(split, index)
    entry = CacheEntry(model.fingerprint, tuple(split.starts), model.block_count, index)
    return image, StageFetcher(root, entry, image)


@pytest.mark.parametrize("repo", ["org/smol", "org/shards"])
def test_a_node_fetches_only_its_slice_and_writes_the_split_file(hub, smollm2, tmp_path, repo):
    source = f"hf:{repo}/{Path(smollm2).name}" if repo == "org/smol" else f"hf:{repo}/smol-00001-of-00003.gguf"
    remote = read_model_source(source)
    local = read_model(smollm2 if repo == "org/smol" else hub.folder / "smol-00001-of-00003.gguf")
    for index in (0, 1):
        image, fetcher = fetch_stage(remote, (0, 15), index, tmp_path)
        before = len(hub.served())
        fetched = fetcher.fetch()
        expected = b"".join(stage_file_image(plan_split(local, 2, [15]), index).chunks())
        assert Path(fetched.path).read_bytes() == expected
        assert served_bytes(hub, before) == tensor_bytes_after(image, 0) < Path(smollm2).stat().st_size * 0.7
        assert (fetched.resumed_from, fetched.bytes_fetched) == (0, len(expected))

    before = len(hub.served())
    again = fetch_stage(remote, (0, 15), 1, tmp_path)[1].fetch()
    assert len(hub.served()) == before and (again.resumed_from, again.bytes_fetched) == (len(expected), 0)


def test_an_interrupted_fetch_resumes_where_it_stopped(hub, smollm2, tmp_path, monkeypatch):
    monkeypatch.setattr(remote_file, "SOURCE_RETRIES", 1)
    monkeypatch.setattr(remote_file.time, "sleep", lambda seconds: None)
    remote = read_model_source(f"hf:org/smol/{Path(smollm2).name}")
    image, fetcher = fetch_stage(remote, (0, 15), 1, tmp_path)
    key = f"org/smol/{Path(smollm2).name}"
    hub.cut(key, 20_000_000)
    with pytest.raises(SourceError, match="the transfer failed 2 times at byte") as raised:
        fetcher.fetch()
    assert "\n" not in str(raised.value)
    held = fetcher.held()
    assert held > len(image.header) + 10_000_000 and not fetcher.complete()  # less what was in flight

    hub.cut(key, None)
    before = len(hub.served())
    fetched = fetch_stage(remote, (0, 15), 1, tmp_path)[1].fetch()
    assert fetched.resumed_from == held and fetched.bytes_fetched == image.size - held
    assert served_bytes(hub, before) == tensor_bytes_after(image, held)
    assert Path(fetched.path).read_bytes() == b"".join(stage_file_image(plan_split(read_model(smollm2), 2, [15]),
                                                                        1).chunks())


def test_a_partial_file_from_another_commit_is_started_again(hub, smollm2, tmp_path, monkeypatch):
    """Same header, so the same cache entry; but another commit may hold other weights: not spliced."""
    monkeypatch.setattr(remote_file, "SOURCE_RETRIES", 0)
    name = Path(smollm2).name
    image, fetcher = fetch_stage(read_model_source(f"hf:org/smol/{name}"), (0, 15), 0, tmp_path)
    hub.cut(f"org/smol/{name}", 5_000_000)
    with pytest.raises(SourceError):
        fetcher.fetch()
    hub.cut(f"org/smol/{name}", None)
    assert fetcher.held() > len(image.header)
    fetched = fetch_stage(read_model_source(f"hf:org/reuploaded/{name}"), (0, 15), 0, tmp_path)[1].fetch()
    assert fetched.resumed_from == 0 and Path(fetched.path).read_bytes() == b"".join(image.chunks())


def test_a_partial_file_of_another_header_is_started_again(hub, smollm2, tmp_path):
    """The cache is keyed by the source's fingerprint: a copy under another name has another header."""
    remote = read_model_source(f"hf:org/smol/{Path(smollm2).name}")
    image, fetcher = fetch_stage(remote, (0, 15), 0, tmp_path)
    fetcher.partial.parent.mkdir(parents=True)
    fetcher.partial.write_bytes(image.header.replace(b"SmolLM2-135M", b"SmolLM2-999M"))
    fetcher.source_note.write_text(fetcher._sources())
    fetched = fetcher.fetch()
    assert fetched.resumed_from == 0
    assert Path(fetched.path).read_bytes() == b"".join(image.chunks())


@pytest.mark.parametrize("source, token, problem", [
    ("hf:org/nothing/m.gguf", None, "hf:org/nothing/m.gguf: no such repo, revision or file (HTTP 404)"),
    ("hf:org/smol/nothing.gguf", None, "no such repo, revision or file (HTTP 404)"),
    ("hf:org/smol/SmolLM2-135M-Instruct.Q4_1.gguf@v9", None, "no such repo, revision or file (HTTP 404)"),
    ("hf:org/private/SmolLM2-135M-Instruct.Q4_1.gguf", None, "no access (HTTP 401); set HF_TOKEN"),
    ("hf:org/private/SmolLM2-135M-Instruct.Q4_1.gguf", "hf_another", "no access (HTTP 403); set HF_TOKEN"),
    ("hf:org/smol/notes.gguf", None, "not a GGUF file"),
    ("hf:org/quants:Q4_1", None, "2 models match Q4_1; name the file: a-Q4_1.gguf, b-Q4_1.gguf"),
    ("hf:org/quants:Q8_0", None, "no model's name carries Q8_0; the repo has a-Q4_1.gguf, b-Q4_1.gguf"),
    ("hf:org/smol", None, "the repo has 2 models"),
    ("hf:org/shards/smol-00002-of-00003.gguf", None, "give the first shard"),
    ("hf:org/a..b:Q4_1", None, "not a repo id the Hub takes"),
    ("hf:org/no-ranges/SmolLM2-135M-Instruct.Q4_1.gguf", None, "sent the whole file, not the range asked for"),
    ("hf:org/shifted/SmolLM2-135M-Instruct.Q4_1.gguf", None, "asked for bytes 0-524287/98362432, the server sent "
                                                            "'bytes 1-524288/98362432'"),
])
def test_each_bad_source_is_one_line(source, token, problem, monkeypatch):
    if token:
        monkeypatch.setenv("HF_TOKEN", token)
    with pytest.raises((SourceError, SourceReferenceError, ModelFileError)) as raised:
        read_model_source(source)
    assert problem in str(raised.value) and "\n" not in str(raised.value)


def test_a_private_repo_opens_with_its_token(hub, smollm2, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    remote = read_model_source(f"hf:org/private/{Path(smollm2).name}")
    fetched = fetch_stage(remote, (0, 15), 0, tmp_path)[1].fetch()
    assert fetched.bytes_fetched > 0
    assert TOKEN not in repr(remote.paths[0])


def test_the_command_says_it_in_one_line_before_ray_starts(hub):
    result = orchestrate("run", "--model", "hf:org/private/SmolLM2-135M-Instruct.Q4_1.gguf", "--prompt", "hi",
                         env={"HF_ENDPOINT": hub.endpoint, "HF_TOKEN": ""}, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: hf:org/private/SmolLM2-135M-Instruct.Q4_1.gguf: no access (HTTP 401); set HF_TOKEN to a token that "
        "may read the repo (a private or gated repo; the Hub also answers 401 for a repo that does not exist)"]


def test_a_draft_from_the_hub_is_fetched_whole_once_into_the_drivers_cache(hub, smollm2, tmp_path, monkeypatch):
    """--draft hf:...: the draft's file, byte for byte, in this machine's stage
    cache (from where it is checked and shipped as any draft); a second run
    fetches nothing; a sharded one is refused in one line."""
    from orchestrator.cluster.model_files import local_draft
    from stages.gguf_file import ModelFileError

    monkeypatch.setenv("SPECPIPE_STAGE_CACHE", str(tmp_path))
    before = len(hub.served())
    shown: list[str] = []
    path = local_draft("hf:org/smol:Q4_1", shown.append)
    assert Path(path).is_relative_to(tmp_path) and Path(path).read_bytes() == Path(smollm2).read_bytes()
    assert served_bytes(hub, before) < Path(smollm2).stat().st_size * 1.1
    assert shown and all(line.startswith("fetching the draft model hf:org/smol:Q4_1: ") for line in shown)
    again = len(hub.served())
    assert local_draft("hf:org/smol:Q4_1") == path and served_bytes(hub, again) < Path(smollm2).stat().st_size / 20
    assert local_draft(smollm2) == smollm2  # a file here as it is
    with pytest.raises(ModelFileError, match="^hf:org/shards: a draft model must be one file, not 3 shards$"):
        local_draft("hf:org/shards")


def test_a_bad_draft_source_is_one_line_before_ray_starts(hub, splits):
    result = orchestrate("run", "--model-split", *splits[2], "--prompt", "hi", "--speculator", "model",
                         "--draft", "hf:org/private/SmolLM2-135M-Instruct.Q4_1.gguf",
                         env={"HF_ENDPOINT": hub.endpoint, "HF_TOKEN": ""}, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith(
        "error: hf:org/private/SmolLM2-135M-Instruct.Q4_1.gguf: no access (HTTP 401)")


def test_offline_the_copy_in_huggingface_hubs_cache_is_used(hub, smollm2, tmp_path, monkeypatch):
    from huggingface_hub import constants, hf_hub_download

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    name = Path(smollm2).name
    with pytest.raises(SourceError, match="HF_HUB_OFFLINE is set and huggingface_hub's cache has no copy of it"):
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
        read_model_source(f"hf:org/smol/{name}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    hf_hub_download("org/smol", name)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    before = len(hub.served())
    model = read_model_source(f"hf:org/smol/{name}")
    assert isinstance(model.paths[0], Path) and model.fingerprint == read_model(smollm2).fingerprint
    assert len(hub.served()) == before
    shutil.rmtree(tmp_path / "hf-cache")


def test_the_drivers_vocabulary_file_is_enough_for_the_tokenizer_and_the_kv_budget(hub, smollm2):
    """`serve --model hf:` sizes its sequences and tokenizes from the header alone (no tensor on the driver)."""
    from orchestrator.cluster.model_files import WholeModelSettings, kv_bytes_per_sequence, with_source
    from stages.tokenizer import Tokenizer

    settings = with_source(WholeModelSettings(f"hf:org/smol/{Path(smollm2).name}"))
    assert settings.source is not None and settings.vocabulary_path != smollm2
    assert kv_bytes_per_sequence(settings.vocabulary_path, 2048) == kv_bytes_per_sequence(smollm2, 2048)
    assert Tokenizer(settings.vocabulary_path).vocabulary_digest() == Tokenizer(smollm2).vocabulary_digest()
