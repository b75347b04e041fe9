"""Stage files assembled on their own nodes from the model's source (``--model hf:...``).

The driver has read only the model's header. Each stage's node fetches just
its tensors' byte ranges from the source (orchestrator.sources.remote_file)
and writes its stage file from the same stage image a shipped stage is sent
from, so the file is byte for byte what ``orchestrate split`` makes, into
the same cache (stage_cache.CachedStageFile: a second run fetches nothing, an
interrupted one resumes from its ``.partial``, one lock per file). The nodes
fetch at once, each over its own link.

The SHA-256 of each assembled file is computed and reported. It is not
checked against an expectation: the Hub gives the digest of whole files
only, and no node holds a whole file. What keeps the bytes right instead:
the files are asked for at the commit the driver resolved (immutable), and
every response must carry exactly the byte range and file size asked for.

A node that cannot reach the source (no route, no name, ``HF_HUB_OFFLINE``
set there) says so; the driver then ships that stage itself
(shipping.ship_stage, reading the same ranges from the source), resuming
from what the node holds (at least the header it was given). The report
says which happened, per stage.

A ``.partial`` is resumed only if it was written from the same files (a
``<file>.partial.source`` beside it names their URLs, which carry the
commit): the cache is keyed by the header's digest, and a re-uploaded model
may keep its header and change its weights.

Plain class (``StageFetcher``) does the work; the Ray actor is its shell.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

from orchestrator.cluster.ray_calls import one_line
from orchestrator.cluster.stage_cache import CachedStageFile, CacheEntry, ShippingError, ShipProgress, stage_cache_root
from orchestrator.config import ACTOR_START_SECONDS, FETCH_IDLE_SECONDS, FETCH_POLL_SECONDS
from orchestrator.sources.remote_file import SourceUnreachable
from stages.errors import SpecpipeError
from stages.stage_image import StageImage


@dataclass(frozen=True)
class Fetched:
    """A stage file in the node's cache: it held ``resumed_from`` bytes
    before, fetched ``bytes_fetched`` now; sha256 of the whole file ("" when
    it was there whole already)."""

    path: str
    resumed_from: int
    bytes_fetched: int
    sha256: str


class StageFetcher(CachedStageFile):
    """One stage file assembled in this node's cache from its image's sources."""

    def __init__(self, root: Path, entry: CacheEntry, image: StageImage):
        super().__init__(root, entry, image.size)
        self.image = image
        self.done = 0  # bytes of the file this node holds so far
        self.activity = 0  # bytes written or read back: grows while the fetch is alive
        self.source_note = self.partial.with_name(self.partial.name + ".source")

    def fetch(self) -> Fetched:
        """SourceUnreachable if the source cannot be reached (the partial file kept for the driver to complete)."""
        with self.locked():
            if self.complete():
                self.done = self.size
                return Fetched(str(self.path), self.size, 0, "")
            held = self.done = self._resumable()
            self.source_note.write_text(self._sources())
            digest = self.append(held, self._counted(self.image.chunks(held)), self._read_back)
            self.keep()
            self.source_note.unlink(missing_ok=True)
            return Fetched(str(self.path), held, self.size - held, digest.hexdigest())

    def _sources(self) -> str:
        """The files this image's bytes come from, one per line (their URLs carry the commit)."""
        return "\n".join(sorted({str(getattr(part.path, "url", part.path)) for part in self.image.parts
                                  if hasattr(part, "path")}))

    def _resumable(self) -> int:
        """Bytes of the partial file to keep: none unless it was written from
        the same files and starts with this image's header (the cache is keyed
        by the source's fingerprint; a file of another name has another header)."""
        held = self.held()
        try:
            same_sources = self.source_note.read_text() == self._sources()
        except FileNotFoundError:
            same_sources = False
        if not held or not same_sources:
            return 0
        with open(self.partial, "rb") as partial:
            start = partial.read(min(held, len(self.image.header)))
        return held if start == self.image.header[:len(start)] else 0

    def _counted(self, chunks):
        for chunk in chunks:
            yield chunk
            self.done += len(chunk)
            self.activity += len(chunk)

    def _read_back(self, count: int) -> None:
        self.activity += count


@dataclass(frozen=True)
class FetchStatus:
    """What a fetcher actor says when asked: bytes held so far; once
    finished, the Fetched or why not (unreachable: the source could not be reached)."""

    done: int
    finished: bool
    activity: int = 0
    fetched: Fetched | None = None
    problem: str = ""
    unreachable: bool = False


def _fetcher_actor_class():
    import ray

    @ray.remote(num_cpus=0, max_restarts=0)
    class StageFetcherActor:
        """Thin Ray shell over a StageFetcher, on the stage's node; it starts fetching at once."""

        def __init__(self, entry: CacheEntry, image: StageImage):
            self.fetcher = StageFetcher(stage_cache_root(), entry, image)
            self.outcome: Fetched | BaseException | None = None
            self.finished = threading.Event()
            threading.Thread(target=self._run, daemon=True).start()

        def _run(self) -> None:
            try:
                self.outcome = self.fetcher.fetch()
            except Exception as error:  # reported by status(), whatever it was
                self.outcome = error
            finally:
                self.finished.set()

        def status(self, wait_seconds: float) -> FetchStatus:
            fetcher = self.fetcher
            if not self.finished.wait(wait_seconds):
                return FetchStatus(fetcher.done, False, fetcher.activity)
            if isinstance(self.outcome, Fetched):
                return FetchStatus(fetcher.done, True, fetcher.activity, self.outcome)
            if isinstance(self.outcome, OSError):
                problem = self.outcome.strerror or str(self.outcome)
            elif isinstance(self.outcome, SpecpipeError):
                problem = str(self.outcome)
            else:
                problem = f"{type(self.outcome).__name__}: {self.outcome}"
            return FetchStatus(fetcher.done, True, fetcher.activity, problem=problem,
                               unreachable=isinstance(self.outcome, SourceUnreachable))

    return StageFetcherActor


@dataclass(frozen=True)
class FetchJob:
    """Stage ``entry.stage_index``'s file to assemble on its node (``where``
    names both in messages) from ``image``."""

    entry: CacheEntry
    image: StageImage
    scheduling_strategy: object
    where: str


def fetch_stages(jobs: list[FetchJob], progress: ShipProgress) -> tuple[dict[int, Fetched], dict[int, str]]:
    """Every job's node fetches its stage at once. Returns (stage index ->
    Fetched, stage index -> why its node could not reach the source);
    ShippingError naming the stage and node for any other failure."""
    import ray


    actors = {job.entry.stage_index: _fetcher_actor_class().options(
        scheduling_strategy=job.scheduling_strategy).remote(job.entry, job.image) for job in jobs}
    by_index = {job.entry.stage_index: job for job in jobs}
    fetched: dict[int, Fetched] = {}
    unreachable: dict[int, str] = {}
    last = {index: (-1, time.monotonic()) for index in actors}  # activity, when it last grew
    try:
        while len(fetched) + len(unreachable) < len(actors):
            pending = [index for index in actors if index not in fetched and index not in unreachable]
            try:
                statuses = ray.get([actors[index].status.remote(FETCH_POLL_SECONDS) for index in pending],
                                   timeout=ACTOR_START_SECONDS + FETCH_POLL_SECONDS)
            except ray.exceptions.GetTimeoutError:
                raise ShippingError(f"{', '.join(by_index[index].where for index in pending)}: the fetcher did not "
                                    f"answer within {ACTOR_START_SECONDS:.0f} s") from None
            except ray.exceptions.RayError as error:
                raise ShippingError(f"{', '.join(by_index[index].where for index in pending)}: could not fetch: "
                                    f"{one_line(error)}") from None
            for index, status in zip(pending, statuses):
                _take(index, status, by_index[index], fetched, unreachable, last, progress)
    finally:
        for actor in actors.values():
            ray.kill(actor)
    return fetched, unreachable


def _take(index: int, status: FetchStatus, job: FetchJob, fetched: dict, unreachable: dict, last: dict,
          progress: ShipProgress) -> None:
    now = time.monotonic()
    if status.activity != last[index][0]:
        last[index] = (status.activity, now)
        progress(index, status.done, job.image.size, "fetching")
    if status.finished and status.fetched is not None:
        fetched[index] = status.fetched
    elif status.finished and status.unreachable:
        unreachable[index] = status.problem
    elif status.finished:
        raise ShippingError(f"{job.where}: could not fetch its slice: {status.problem}")
    elif now - last[index][1] > FETCH_IDLE_SECONDS:
        raise ShippingError(f"{job.where}: its fetch got no byte for {FETCH_IDLE_SECONDS:.0f} s")
