"""A node's stage cache: where stage files shipped from the driver
(orchestrator.cluster.shipping) or fetched from their source by the node
(orchestrator.cluster.fetching) are kept, under a name that says which file
each is::

    $SPECPIPE_STAGE_CACHE (default ~/.cache/specpipe/stages)
        / <source fingerprint>-blocks-<starts>-of-<blocks> / stage-<k+1>-of-<n>.gguf

and how one is written: into ``<file>.partial`` (kept for a later run to
resume), renamed into place once whole and checked, one transfer at a time
under ``<file>.lock``."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from orchestrator.config import cache_dir
from orchestrator.planning.cluster_split import NodeMemory
from stages.errors import SpecpipeError
from stages.gguf_file import ModelFile
from stages.stage_image import CHUNK_BYTES

STAGE_CACHE_VARIABLE = "SPECPIPE_STAGE_CACHE"
_FINGERPRINT = re.compile(r"[0-9a-f]{64}")

# Called with (stage index, bytes done, bytes in all, "shipping" or "fetching") as a transfer goes.
ShipProgress = Callable[[int, int, int, str], None]


class ShippingError(SpecpipeError):
    """A stage file could not be shipped; the message names the stage and node."""


def transfer_role(stage_index: int) -> str:
    """The handshake role of the connection that carries stage ``stage_index``'s file."""
    return f"stage file of stage {stage_index}"


def stage_cache_root() -> Path:
    """This machine's stage cache (on a node: where received stage files are kept)."""
    configured = os.environ.get(STAGE_CACHE_VARIABLE)
    return Path(configured) if configured else cache_dir() / "stages"


@dataclass(frozen=True)
class CacheEntry:
    """Which stage file: of the model with this fingerprint, cut at ``starts``
    (first block of each stage) out of ``blocks``, stage ``stage_index``.
    whole: instead the model's own file, unsplit (a draft model: draft_entry)."""

    fingerprint: str
    starts: tuple[int, ...]
    blocks: int
    stage_index: int
    whole: bool = False

    def __post_init__(self):
        if not _FINGERPRINT.fullmatch(self.fingerprint):
            raise ShippingError(f"a source fingerprint that is not 64 hex digits: {self.fingerprint!r:.80}")
        if (not self.starts or self.starts[0] != 0 or list(self.starts) != sorted(set(self.starts))
                or self.starts[-1] >= self.blocks or not 0 <= self.stage_index < len(self.starts)):
            raise ShippingError(f"stage {self.stage_index} of starts {list(self.starts)} over {self.blocks} blocks "
                                "is not a split")

    def path(self, root: Path) -> Path:
        if self.whole:
            return root / f"{self.fingerprint}-whole" / "model.gguf"
        folder = f"{self.fingerprint}-blocks-{'-'.join(map(str, self.starts))}-of-{self.blocks}"
        return root / folder / f"stage-{self.stage_index + 1}-of-{len(self.starts)}.gguf"

    @property
    def role(self) -> str:
        """The handshake role of the connection that carries its file."""
        return "a whole model's file" if self.whole else transfer_role(self.stage_index)

    def on_node(self, node: NodeMemory) -> str:
        """Where the file goes, as messages name it."""
        what = "the draft model" if self.whole else f"stage {self.stage_index}"
        return f"{what} on node {node.address} ({node.node_id[:8]})"


def draft_entry(model: ModelFile) -> CacheEntry:
    """A draft model's file as it is kept in a node's cache: whole, by its fingerprint."""
    return CacheEntry(model.fingerprint, (0,), model.block_count, 0, whole=True)


class CachedStageFile:
    """A stage file's place in this node's cache: the file once whole, and
    ``<file>.partial`` while it is being written (kept for a later run to
    resume), under ``<file>.lock``. Plain class: StageReceiver and
    orchestrator.cluster.fetching.StageFetcher write through it."""

    def __init__(self, root: Path, entry: CacheEntry, size: int):
        self.path = entry.path(root)
        self.partial = self.path.with_name(self.path.name + ".partial")
        self.size = size

    def complete(self) -> bool:
        """The file is here, whole (renamed into place only once all of it was
        written: after its digest matched the sender's, or fetched from a pinned source)."""
        try:
            return self.path.stat().st_size == self.size
        except FileNotFoundError:
            return False

    def held(self) -> int:
        """Bytes of an earlier, interrupted transfer (0 if none or if it cannot be the same file)."""
        try:
            held = self.partial.stat().st_size
        except FileNotFoundError:
            return 0
        return held if held <= self.size else 0

    @contextlib.contextmanager
    def locked(self):
        """This file's lock, or ShippingError if another transfer holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(self.path.name + ".lock"), "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ShippingError(f"another transfer of {self.path.name} to this node is under way") from None
            yield

    def append(self, offset: int, chunks, on_read_back: Callable[[int], None] = lambda count: None) -> hashlib._Hash:
        """Keep the partial file's first ``offset`` bytes, write ``chunks`` after
        them, and return the SHA-256 of all of it (the part kept is read back:
        on_read_back(count) after each piece)."""
        digest = hashlib.sha256()
        with open(self.partial, "r+b" if self.partial.exists() else "wb") as out:
            out.truncate(offset)
            while out.tell() < offset:
                piece = out.read(min(CHUNK_BYTES, offset - out.tell()))
                digest.update(piece)
                on_read_back(len(piece))
            for chunk in chunks:
                out.write(chunk)
                digest.update(chunk)
            if out.tell() != self.size:
                raise ShippingError(f"{self.path.name}: {out.tell()} of {self.size} bytes written")
            out.flush()
            os.fsync(out.fileno())
        return digest

    def keep(self) -> None:
        """The partial file is whole and checked: make it the stage file."""
        os.replace(self.partial, self.path)
