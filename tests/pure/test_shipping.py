"""The stage-file transfer (orchestrator.cluster.shipping) between a sender and a
receiver on a socket pair: complete, resumed after an interruption, refused
for a wrong digest, and strict about what it reads. The file is a synthetic
StageImage over a temporary source (pure: no model, no Ray)."""

from __future__ import annotations

import hashlib
import socket
import struct
import threading
import time

import msgpack
import pytest

from orchestrator.cluster import shipping, stage_cache
from orchestrator.cluster.shipping import DIGEST_REFUSED, DigestRefused, StageReceiver, send_stage
from orchestrator.cluster.stage_cache import CacheEntry, ShippingError, stage_cache_root
from stages.stage_image import SourceRange, StageImage, Zeros

FINGERPRINT = "ab" * 32


@pytest.fixture
def image(tmp_path):
    """A 'stage file' of a header, a source range and padding: 3 MiB and a bit."""
    source = tmp_path / "source.bin"
    data = hashlib.sha256(b"seed").digest() * (100 * 1024)
    source.write_bytes(data)
    return StageImage(b"HEADER" * 1000, (Zeros(10), SourceRange(source, 7, len(data) - 100), Zeros(3),
                                         SourceRange(source, 0, 50)))


def image_bytes(image: StageImage) -> bytes:
    return b"".join(image.chunks())


def receiver(tmp_path, image, stage_index=0) -> StageReceiver:
    entry = CacheEntry(FINGERPRINT, (0, 15), 30, stage_index)
    return StageReceiver(tmp_path / "cache", entry, image.size)


def transfer(receiving: StageReceiver, image: StageImage):
    """Run a receiver in a thread against send_stage; (what the sender saw or
    its error, the receiver's path or its error)."""
    sender_end, receiver_end = socket.socketpair()
    outcome = {}

    def receive():
        try:
            outcome["received"] = receiving.receive(receiver_end)
        except ShippingError as error:
            outcome["received"] = error
        finally:
            receiver_end.close()

    thread = threading.Thread(target=receive)
    thread.start()
    try:
        sent = send_stage(sender_end, image)
    except ShippingError as error:
        sent = error
    finally:
        sender_end.close()
    thread.join(timeout=30)
    return sent, outcome["received"]


def test_image_chunks_from_any_offset_are_the_files_tail(image):
    whole = image_bytes(image)
    assert len(whole) == image.size
    for start in (0, 1, 5999, 6000, 6010, 6011, image.size - 51, image.size - 1, image.size):
        assert b"".join(image.chunks(start, chunk_bytes=4096)) == whole[start:], start
    with pytest.raises(ValueError):
        list(image.chunks(image.size + 1))


def test_a_transfer_writes_the_file_whole_and_leaves_no_partial(tmp_path, image):
    receiving = receiver(tmp_path, image)
    sent, path = transfer(receiving, image)
    assert sent.offset == 0 and sent.bytes_sent == image.size
    assert path == receiving.path and path.read_bytes() == image_bytes(image)
    assert not receiving.partial.exists()
    assert receiving.complete()


def test_a_node_that_holds_the_file_receives_nothing(tmp_path, image):
    transfer(receiver(tmp_path, image), image)
    again = receiver(tmp_path, image)
    sent, path = transfer(again, image)
    assert (sent.offset, sent.bytes_sent, again.received) == (image.size, 0, 0)
    assert path.read_bytes() == image_bytes(image)


def interrupted(receiving: StageReceiver, image: StageImage, count: int) -> ShippingError:
    """A sender that says it starts at 0, sends ``count`` bytes and vanishes."""
    return raw_receiver_session(receiving, frame({"offset": 0}) + image_bytes(image)[:count])


def test_an_interrupted_transfer_resumes_where_it_stopped(tmp_path, image):
    first = receiver(tmp_path, image)
    error = interrupted(first, image, 1_000_003)
    assert "closed the connection" in str(error)
    assert not first.path.exists() and first.partial.stat().st_size == 1_000_003
    resumed = receiver(tmp_path, image)
    sent, path = transfer(resumed, image)
    assert (sent.offset, sent.bytes_sent) == (1_000_003, image.size - 1_000_003)
    assert resumed.received == image.size - 1_000_003
    assert path.read_bytes() == image_bytes(image)


HELD = 1_000_003  # bytes an interrupted transfer left on the node


class SlowSource:
    """The image read as from a slow remote source: 0.2 s for each 64 KiB of its first HELD bytes."""

    def __init__(self, image: StageImage):
        self.image, self.size = image, image.size

    def chunks(self, start: int = 0):
        position = start
        for chunk in self.image.chunks(start, chunk_bytes=64 * 1024):
            if position < HELD:
                time.sleep(0.2)
            position += len(chunk)
            yield chunk


class SlowDisk(StageReceiver):
    """A receiver reading back its partial file slowly: 0.2 s for each 64 KiB."""

    def append(self, offset, chunks, on_read_back=lambda count: None):
        return super().append(offset, chunks, lambda count: time.sleep(0.2))


@pytest.fixture
def slow_resume(tmp_path, image, monkeypatch):
    """HELD bytes on the node; a socket may stay idle 2 s, and the first bytes
    of a resume at HELD 2 s + HELD at 0.4 MB/s (4.5 s); the receiver reads back in 64 KiB pieces."""
    monkeypatch.setattr(shipping, "TRANSFER_IDLE_SECONDS", 2.0)
    monkeypatch.setattr(shipping, "SLOWEST_PREFIX_READ", 400_000)
    monkeypatch.setattr(shipping, "CHUNK_BYTES", 64 * 1024)
    monkeypatch.setattr(stage_cache, "CHUNK_BYTES", 64 * 1024)  # the read back (CachedStageFile.append)
    interrupted(receiver(tmp_path, image), image, HELD)


def test_a_resume_waits_for_the_sender_to_read_what_the_node_holds(tmp_path, image, slow_resume):
    """The sender hashes the HELD bytes from its source (3.2 s) before its first byte."""
    sent, path = transfer(receiver(tmp_path, image), SlowSource(image))
    assert (sent.offset, sent.bytes_sent) == (HELD, image.size - HELD)
    assert path.read_bytes() == image_bytes(image)


def test_a_resume_waits_for_the_receiver_to_read_back_what_it_holds(tmp_path, image, slow_resume):
    """The sender's first bytes wait while the node reads back the HELD bytes (3.2 s)."""
    resumed = SlowDisk(tmp_path / "cache", CacheEntry(FINGERPRINT, (0, 15), 30, 0), image.size)
    sent, path = transfer(resumed, image)
    assert (sent.offset, sent.bytes_sent) == (HELD, image.size - HELD)
    assert path.read_bytes() == image_bytes(image)


def test_a_partial_that_differs_from_the_source_is_refused_and_deleted(tmp_path, image):
    first = receiver(tmp_path, image)
    interrupted(first, image, 500_000)
    corrupt = bytearray(first.partial.read_bytes())
    corrupt[1234] ^= 1
    first.partial.write_bytes(bytes(corrupt))
    sent, received = transfer(receiver(tmp_path, image), image)
    assert isinstance(sent, DigestRefused) and DIGEST_REFUSED in str(sent)
    assert isinstance(received, ShippingError) and DIGEST_REFUSED in str(received)
    assert not first.partial.exists() and not first.path.exists()
    sent, path = transfer(receiver(tmp_path, image), image)  # from zero, as ship_stage retries
    assert sent.offset == 0 and path.read_bytes() == image_bytes(image)


def test_a_partial_longer_than_the_file_is_not_resumed(tmp_path, image):
    first = receiver(tmp_path, image)
    first.path.parent.mkdir(parents=True)
    first.partial.write_bytes(b"x" * (image.size + 1))
    assert first.held() == 0
    sent, path = transfer(first, image)
    assert sent.offset == 0 and path.read_bytes() == image_bytes(image)


def raw_receiver_session(receiving: StageReceiver, frames: bytes):
    """Send ``frames`` after reading the held frame; the receiver's error."""
    sender_end, receiver_end = socket.socketpair()
    outcome = {}

    def receive():
        try:
            receiving.receive(receiver_end)
        except ShippingError as error:
            outcome["error"] = error

    thread = threading.Thread(target=receive)
    thread.start()
    sender_end.recv(64)
    sender_end.sendall(frames)
    sender_end.shutdown(socket.SHUT_WR)  # and vanishes
    thread.join(timeout=30)
    sender_end.close()
    receiver_end.close()
    return outcome.get("error")


def frame(value) -> bytes:
    packed = msgpack.packb(value)
    return struct.pack("!I", len(packed)) + packed


@pytest.mark.parametrize("frames, message", [
    (frame({"offset": 17}), "start at byte 17"),
    (frame({"offset": "0"}), "expected a frame"),
    (frame({"offset": True}), "expected a frame"),
    (frame({"offset": 0, "more": 1}), "expected a frame"),
    (frame([0]), "expected a frame"),
    (struct.pack("!I", 1 << 20), "a frame of 1048576 bytes"),
    (struct.pack("!I", 3) + b"\xc1\xc1\xc1", "not msgpack"),
])
def test_a_bad_frame_is_refused_with_its_reason(tmp_path, image, frames, message):
    error = raw_receiver_session(receiver(tmp_path, image), frames)
    assert error is not None and message in str(error)
    assert not receiver(tmp_path, image).path.exists()


def test_a_second_transfer_of_the_same_file_waits_for_nobody(tmp_path, image):
    """Two runs shipping one file to one node: the second is refused at once, the first completes."""
    import fcntl

    first = receiver(tmp_path, image)
    first.path.parent.mkdir(parents=True)
    with open(first.path.with_name(first.path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        sent, received = transfer(receiver(tmp_path, image), image)
    assert isinstance(received, ShippingError) and "another transfer" in str(received)
    assert isinstance(sent, ShippingError)
    sent, path = transfer(first, image)
    assert path.read_bytes() == image_bytes(image)


def test_cache_entries_are_keyed_by_source_and_boundaries(tmp_path):
    entry = CacheEntry(FINGERPRINT, (0, 10, 20), 30, 2)
    assert entry.path(tmp_path) == tmp_path / f"{FINGERPRINT}-blocks-0-10-20-of-30" / "stage-3-of-3.gguf"
    assert CacheEntry(FINGERPRINT, (0, 15), 30, 1).path(tmp_path).parent != entry.path(tmp_path).parent


@pytest.mark.parametrize("fingerprint, starts, blocks, stage", [
    ("../../etc", (0, 15), 30, 0),
    ("AB" * 32, (0, 15), 30, 0),
    (FINGERPRINT, (1, 15), 30, 0),
    (FINGERPRINT, (0, 15, 15), 30, 0),
    (FINGERPRINT, (0, 30), 30, 0),
    (FINGERPRINT, (0, 15), 30, 2),
    (FINGERPRINT, (), 30, 0),
])
def test_a_cache_entry_that_is_not_a_split_is_refused(fingerprint, starts, blocks, stage):
    with pytest.raises(ShippingError):
        CacheEntry(fingerprint, starts, blocks, stage)


def test_the_stage_cache_is_where_the_environment_says(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECPIPE_STAGE_CACHE", str(tmp_path / "here"))
    assert stage_cache_root() == tmp_path / "here"
    monkeypatch.delenv("SPECPIPE_STAGE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert stage_cache_root() == tmp_path / "specpipe" / "stages"
