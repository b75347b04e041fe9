"""Files read over HTTP by byte range: a model's header on the driver, each
stage's tensors on the node that runs it.

A ``RemoteFile`` is a file at a pinned URL (a commit's: its bytes cannot change
between the driver reading the header and a node resuming a transfer) and its
size. Every request asks for one bounded range and must be answered ``206``
with exactly that ``Content-Range`` over exactly that size; anything else is a
``SourceError`` naming the file. Every request has deadlines (to connect, and
for each read); a connection that drops mid-range is asked again from where
it stopped, up to ``SOURCE_RETRIES`` times. A server that cannot be reached at all
(no route, no name, refused, ``HF_HUB_OFFLINE``) is a ``SourceUnreachable``:
the caller may then get the bytes another way.

Requests go through huggingface_hub's HTTP client (its proxies and settings);
it drops the token when the Hub redirects to its content delivery network.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from orchestrator.config import (SOURCE_CHUNK_BYTES, SOURCE_CONNECT_SECONDS, SOURCE_CONNECT_TRIES,
                                 SOURCE_FIRST_HEADER_BYTES, SOURCE_MOST_HEADER_BYTES, SOURCE_READ_SECONDS,
                                 SOURCE_RETRIES)
from stages.errors import SpecpipeError


class SourceError(SpecpipeError):
    """A remote file could not be read; the message names it and says why."""


class SourceUnreachable(SourceError):
    """The file's server could not be reached at all (nothing was read)."""


@dataclass(frozen=True)
class RemoteFile:
    """``size`` bytes at ``url``, named ``label`` in messages (``hf:ORG/REPO/FILE@COMMIT``).
    headers: sent with every request (the token's Authorization), never shown."""

    url: str
    size: int
    label: str
    headers: tuple[tuple[str, str], ...] = field(default=(), repr=False, compare=False)

    @property
    def name(self) -> str:
        return self.label.rsplit("@", 1)[0].rsplit("/", 1)[-1]

    def __str__(self) -> str:
        return self.label

    def open(self, mode: str = "rb") -> HeaderReader:
        """A read-only file object over the start of the file (stages.gguf_file scans headers with it)."""
        if mode != "rb":
            raise ValueError(f"a remote file opens only for reading, not {mode!r}")
        return HeaderReader(RangeReader(self))

    def open_ranges(self) -> RangeReader:
        """A ByteSource over the file (stages.stage_image reads tensors with it)."""
        return RangeReader(self)


def status_problem(status: int) -> str:
    """What an HTTP status from the Hub (or a file it serves) means, for a one-line error."""
    if status in (401, 403):
        return (f"no access (HTTP {status}); set HF_TOKEN to a token that may read the repo (a private or gated "
                "repo; the Hub also answers 401 for a repo that does not exist)")
    if status == 404:
        return "no such repo, revision or file (HTTP 404)"
    if status == 200:
        return "the server sent the whole file, not the range asked for (it does not serve ranges)"
    return f"HTTP {status}"


class RangeReader:
    """Bounded range requests to one RemoteFile; ``fetched``: bytes received
    so far. Also a ByteSource (stages.stage_image)."""

    def __init__(self, remote: RemoteFile):
        self.remote = remote
        self.fetched = 0

    def read(self, offset: int, length: int, chunk_bytes: int = SOURCE_CHUNK_BYTES) -> Iterator[bytes]:
        """Bytes [offset, offset + length) of the file, in chunks of at most chunk_bytes."""
        import httpx2

        if offset < 0 or length < 0 or offset + length > self.remote.size:
            raise SourceError(f"{self.remote}: bytes [{offset}, {offset + length}) are outside its "
                              f"{self.remote.size} bytes")
        position, end, failures = offset, offset + length, 0
        while position < end:
            try:
                for chunk in self._response(position, end, chunk_bytes):
                    position += len(chunk)
                    self.fetched += len(chunk)
                    yield chunk
                if position < end:
                    raise httpx2.RemoteProtocolError("the response ended early")
            except httpx2.TransportError as error:
                failures += 1
                if self.fetched == 0 and isinstance(error, (httpx2.ConnectError, httpx2.ConnectTimeout)) \
                        and failures >= SOURCE_CONNECT_TRIES:
                    raise SourceUnreachable(f"{self.remote}: cannot reach its server ({error or type(error).__name__})"
                                            ) from None
                if failures > SOURCE_RETRIES:
                    raise SourceError(f"{self.remote}: the transfer failed {failures} times at byte {position} "
                                      f"({error or type(error).__name__})") from None
                time.sleep(min(2.0 ** failures, 8.0))
            except (httpx2.HTTPError, httpx2.InvalidURL, httpx2.StreamError) as error:
                raise SourceError(f"{self.remote}: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
                                  ) from None

    def _response(self, low: int, end: int, chunk_bytes: int) -> Iterator[bytes]:
        import httpx2
        from huggingface_hub import constants
        from huggingface_hub.utils import get_session

        if constants.HF_HUB_OFFLINE:
            raise SourceUnreachable(f"{self.remote}: HF_HUB_OFFLINE is set on this machine")
        headers = {**dict(self.remote.headers), "Range": f"bytes={low}-{end - 1}", "Accept-Encoding": "identity"}
        timeout = httpx2.Timeout(SOURCE_READ_SECONDS, connect=SOURCE_CONNECT_SECONDS)
        with get_session().stream("GET", self.remote.url, headers=headers, timeout=timeout,
                                  follow_redirects=True) as response:
            if 500 <= response.status_code < 600 or response.status_code == 429:
                raise httpx2.RemoteProtocolError(f"HTTP {response.status_code}")  # worth asking again
            if response.status_code != 206:
                raise SourceError(f"{self.remote}: {status_problem(response.status_code)}")
            expected = f"bytes {low}-{end - 1}/{self.remote.size}"
            if response.headers.get("Content-Range") != expected:
                raise SourceError(f"{self.remote}: asked for {expected}, the server sent "
                                  f"{response.headers.get('Content-Range')!r:.80} (did the file change?)")
            left = end - low
            for chunk in response.iter_bytes(chunk_bytes):
                chunk = chunk[:left]
                left -= len(chunk)
                yield chunk
                if not left:
                    return

    def close(self) -> None:
        """Nothing held between reads (each range is its own request on the shared client)."""


class HeaderReader:
    """A read-only file object over the start of a RemoteFile: what has been
    read is kept, and reading past it fetches the next window (twice the last,
    from SOURCE_FIRST_HEADER_BYTES), so a header of h bytes costs about 2h fetched."""

    def __init__(self, ranges: RangeReader):
        self.ranges = ranges
        self.remote = ranges.remote
        self.buffer = bytearray()
        self.position = 0
        self.window = SOURCE_FIRST_HEADER_BYTES

    def _fill(self, end: int) -> None:
        end = min(end, self.remote.size)
        while len(self.buffer) < end:
            want = min(max(end - len(self.buffer), self.window), self.remote.size - len(self.buffer))
            self.window = min(self.window * 2, SOURCE_MOST_HEADER_BYTES)
            for chunk in self.ranges.read(len(self.buffer), want):
                self.buffer += chunk

    def read(self, count: int = -1) -> bytes:
        end = self.remote.size if count < 0 else self.position + count
        self._fill(end)
        data = bytes(self.buffer[self.position:end])
        self.position += len(data)
        return data

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.position, os.SEEK_END: self.remote.size}[whence]
        self.position = base + offset
        return self.position

    def tell(self) -> int:
        return self.position

    def close(self) -> None:
        self.ranges.close()

    def __enter__(self) -> HeaderReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
