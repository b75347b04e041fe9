"""What an ``hf:`` model source names, and which of a repo's files it means.
Pure: no network (orchestrator.sources.hub asks the Hub).

    hf:ORG/REPO/PATH/FILE.gguf   that file (or, given its first shard, all shards)
    hf:ORG/REPO:QUANT            the repo's one model whose name carries QUANT (Q4_K_M, Q8_0, ...)
    hf:ORG/REPO                  the repo's one model
    ...@REVISION                 at a branch, tag or commit (default: main)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from stages.errors import SpecpipeError
from stages.gguf_file import SHARD_PATTERN

PREFIX = "hf:"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_QUANT = re.compile(r"[A-Za-z0-9_]+")
_SHOWN_FILES = 12  # a listing of candidates stops there


class SourceReferenceError(SpecpipeError):
    """An ``hf:`` source that names nothing usable; the message is one line."""


@dataclass(frozen=True)
class HubReference:
    """repo: ORG/REPO; filename: a path in it (None: chosen by quant, or the
    only model); revision: None for the default branch."""

    repo: str
    filename: str | None = None
    quant: str | None = None
    revision: str | None = None

    def __str__(self) -> str:
        named = f"/{self.filename}" if self.filename else (f":{self.quant}" if self.quant else "")
        return f"{PREFIX}{self.repo}{named}" + (f"@{self.revision}" if self.revision else "")


def is_hub_source(text: str) -> bool:
    return text.startswith(PREFIX)


def parse_reference(text: str) -> HubReference:
    """``hf:ORG/REPO[/FILE.gguf | :QUANT][@REVISION]``; SourceReferenceError if malformed."""
    if not is_hub_source(text):
        raise SourceReferenceError(f"{text!r:.100} is not an hf: source")
    body, revision = text[len(PREFIX):], None
    head, at, tail = body.rpartition("@")
    if at and tail and not tail.endswith(".gguf"):
        body, revision = head, tail
    quant = None
    if ":" in body:
        body, _, quant = body.partition(":")
        if not _QUANT.fullmatch(quant):
            raise SourceReferenceError(f"{text!r:.100}: {quant!r:.40} is not a quantization name (e.g. Q4_K_M)")
    parts = body.split("/")
    if len(parts) < 2 or not all(_NAME.fullmatch(part) for part in parts[:2]):
        raise SourceReferenceError(f"{text!r:.100}: give hf:ORG/REPO/FILE.gguf, hf:ORG/REPO:QUANT or hf:ORG/REPO")
    filename = "/".join(parts[2:]) or None
    if filename is not None and quant is not None:
        raise SourceReferenceError(f"{text!r:.100}: give a file or a quantization name, not both")
    if filename is not None and (not filename.endswith(".gguf") or any(not part or part == ".."
                                                                      for part in filename.split("/"))):
        raise SourceReferenceError(f"{text!r:.100}: {filename!r:.80} is not a .gguf file's path in the repo")
    return HubReference("/".join(parts[:2]), filename, quant, revision)


def shard_names(filename: str) -> tuple[str, ...]:
    """Every file of the model whose only file, or first shard, is ``filename``."""
    match = SHARD_PATTERN.search(filename)
    if not match:
        return (filename,)
    number, count = int(match.group(1)), int(match.group(2))
    if number != 1:
        raise SourceReferenceError(f"{filename}: give the first shard (-00001-of-{count:05d}.gguf), not shard {number}")
    stem = filename[:match.start()]
    return tuple(f"{stem}-{index:05d}-of-{count:05d}.gguf" for index in range(1, count + 1))


def _models(files: list[str]) -> list[str]:
    """The language models among a repo's files: .gguf files, a sharded one by
    its first shard; vision projectors (mmproj*) are not models of their own."""
    models = []
    for name in files:
        base = name.rsplit("/", 1)[-1]
        match = SHARD_PATTERN.search(base)
        if name.endswith(".gguf") and not base.lower().startswith("mmproj") and (not match or int(match.group(1)) == 1):
            models.append(name)
    return sorted(models)


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN_FILES])
    return shown + (f" and {len(names) - _SHOWN_FILES} more" if len(names) > _SHOWN_FILES else "")


def choose_file(reference: HubReference, files: list[str]) -> str:
    """The file ``reference`` means among the repo's ``files`` (its paths):
    the one model whose path carries the quantization name as a whole word
    (case aside), or the repo's only model. SourceReferenceError naming the
    candidates when that is not exactly one."""
    if reference.filename is not None:
        return reference.filename
    models = _models(files)
    if not models:
        raise SourceReferenceError(f"{reference}: the repo has no .gguf model")
    if reference.quant is None:
        if len(models) > 1:
            raise SourceReferenceError(f"{reference}: the repo has {len(models)} models; name one by file or by "
                                       f"quantization (hf:{reference.repo}:Q4_K_M): {_listing(models)}")
        return models[0]
    word = re.compile(rf"(?<![A-Za-z0-9_]){re.escape(reference.quant)}(?![A-Za-z0-9_])", re.IGNORECASE)
    matching = [name for name in models if word.search(name)]
    if len(matching) == 1:
        return matching[0]
    if not matching:
        raise SourceReferenceError(f"{reference}: no model's name carries {reference.quant}; the repo has "
                                   f"{_listing(models)}")
    raise SourceReferenceError(f"{reference}: {len(matching)} models match {reference.quant}; name the file: "
                               f"{_listing(matching)}")
