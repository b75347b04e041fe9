"""What an hf: source names, and which of a repo's files it means (orchestrator.sources.hub_reference)."""

from __future__ import annotations

import pytest

from orchestrator.sources.hub_reference import (HubReference, SourceReferenceError, choose_file, parse_reference,
                                                shard_names)

LLAMA = "Meta-Llama-3.1-405B-Instruct"
REPO_FILES = [
    "README.md", ".gitattributes",
    f"{LLAMA}-Q8_0.gguf",
    f"Q4_K_M/{LLAMA}-Q4_K_M-00001-of-00003.gguf", f"Q4_K_M/{LLAMA}-Q4_K_M-00002-of-00003.gguf",
    f"Q4_K_M/{LLAMA}-Q4_K_M-00003-of-00003.gguf",
    f"{LLAMA}-Q4_K_S.gguf", f"{LLAMA}-IQ4_XS.gguf", f"{LLAMA}-IQ4_XS-imat.gguf",
    "mmproj-model-Q8_0.gguf",
]


@pytest.mark.parametrize("text, expected", [
    ("hf:org/repo/model.gguf", HubReference("org/repo", "model.gguf")),
    ("hf:org/repo/sub/dir/model-00001-of-00003.gguf", HubReference("org/repo", "sub/dir/model-00001-of-00003.gguf")),
    ("hf:org/repo:Q4_K_M", HubReference("org/repo", quant="Q4_K_M")),
    ("hf:org/repo", HubReference("org/repo")),
    ("hf:org/repo/model.gguf@main", HubReference("org/repo", "model.gguf", revision="main")),
    ("hf:org/repo:q8_0@0123abcd", HubReference("org/repo", quant="q8_0", revision="0123abcd")),
    ("hf:org/repo@refs/pr/1", HubReference("org/repo", revision="refs/pr/1")),
    ("hf:org/repo/name@v2.gguf", HubReference("org/repo", "name@v2.gguf")),  # an @ in the file's own name
])
def test_references_parse(text, expected):
    assert parse_reference(text) == expected
    assert str(parse_reference(str(expected))) == str(expected)


@pytest.mark.parametrize("text, problem", [
    ("hf:org", "give hf:ORG/REPO/FILE.gguf"),
    ("hf:", "give hf:ORG/REPO/FILE.gguf"),
    ("hf:org/repo/config.json", "is not a .gguf file's path"),
    ("hf:org/repo/../x.gguf", "is not a .gguf file's path"),
    ("hf:org/repo:Q4 K", "is not a quantization name"),
    ("hf:org/repo/model.gguf:Q4_0", "a file or a quantization name, not both"),
    ("hf:-org/repo", "give hf:ORG/REPO/FILE.gguf"),
])
def test_malformed_references_are_one_line(text, problem):
    with pytest.raises(SourceReferenceError, match=problem) as raised:
        parse_reference(text)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("quant, expected", [
    ("Q8_0", f"{LLAMA}-Q8_0.gguf"),
    ("q4_k_m", f"Q4_K_M/{LLAMA}-Q4_K_M-00001-of-00003.gguf"),  # case aside; a sharded model by its first shard
    ("Q4_K_S", f"{LLAMA}-Q4_K_S.gguf"),
])
def test_a_quantization_name_chooses_one_model(quant, expected):
    assert choose_file(HubReference("org/repo", quant=quant), REPO_FILES) == expected


def test_a_quantization_name_is_a_whole_word():
    """Q4_K is in no name as a word (Q4_K_M and Q4_K_S are other quantizations): none matches, and all are listed."""
    with pytest.raises(SourceReferenceError, match="no model's name carries Q4_K; the repo has ") as raised:
        choose_file(HubReference("org/repo", quant="Q4_K"), REPO_FILES)
    assert "Q4_K_M-00002" not in str(raised.value) and "mmproj" not in str(raised.value)


def test_a_quantization_name_that_matches_several_lists_them():
    with pytest.raises(SourceReferenceError, match="2 models match IQ4_XS; name the file: ") as raised:
        choose_file(HubReference("org/repo", quant="IQ4_XS"), REPO_FILES)
    assert f"{LLAMA}-IQ4_XS.gguf" in str(raised.value) and f"{LLAMA}-IQ4_XS-imat.gguf" in str(raised.value)


def test_a_repo_is_enough_when_it_holds_one_model():
    assert choose_file(HubReference("org/repo"), ["README.md", "m.gguf", "mmproj-f16.gguf"]) == "m.gguf"
    with pytest.raises(SourceReferenceError, match="the repo has 5 models; name one"):
        choose_file(HubReference("org/repo"), REPO_FILES)
    with pytest.raises(SourceReferenceError, match="the repo has no .gguf model"):
        choose_file(HubReference("org/repo"), ["README.md"])


def test_a_long_listing_is_cut():
    files = [f"m-{index:03d}-Q4_0.gguf" for index in range(40)]
    with pytest.raises(SourceReferenceError, match="and 28 more$"):
        choose_file(HubReference("org/repo", quant="Q4_0"), files)


def test_shards_follow_from_the_first():
    assert shard_names("d/m-00001-of-00003.gguf") == ("d/m-00001-of-00003.gguf", "d/m-00002-of-00003.gguf",
                                                      "d/m-00003-of-00003.gguf")
    assert shard_names("m.gguf") == ("m.gguf",)
    with pytest.raises(SourceReferenceError, match="give the first shard"):
        shard_names("m-00002-of-00003.gguf")
