"""Stage files cut on the driver and streamed to the nodes that run them.

With ``--model WHOLE.gguf`` no node needs a file beforehand. The driver cuts
each stage from the whole model as it sends it (stages.stage_image: the
source is read in chunks, never held whole) to a receiver beside the stage,
which writes it into the node's stage cache::

    $SPECPIPE_STAGE_CACHE (default ~/.cache/specpipe/stages)
        / <source fingerprint>-blocks-<starts>-of-<blocks> / stage-<k+1>-of-<n>.gguf

keyed by the source's fingerprint (a digest of its header: metadata and
tensor table) and the boundaries, so a node that holds the right file
receives nothing, and another split of the same model is another file.

One transfer, on a socket of its own that opens with the data plane's
handshake (orchestrator.transport.handshake; in TLS with ``--tls``), the role naming
the stage; every frame is checked and every read has a deadline::

    receiver -> sender:  {"held": n}         bytes of <file>.partial it holds (0: none)
    sender   -> receiver: {"offset": m}       m is n (resume) or 0 (start again)
    sender   -> receiver: the file's bytes [m, size), raw
    sender   -> receiver: {"sha256": digest}  of the whole file
    receiver -> sender:  {"problem": ""}     or why the file was refused

A frame is ``u32 length | msgpack map``. The receiver appends to
``<file>.partial`` and renames it to ``<file>`` only once the SHA-256 of all
of it (the part held before, read back, and the part received) equals the
sender's (computed over the source as it is read: a resumed transfer's
prefix is read and hashed, not sent). A refused file is deleted and sent
again from zero, once. An interrupted transfer leaves the ``.partial`` to
resume; a lock file keeps two transfers of one file apart. A socket may stay
silent TRANSFER_IDLE_SECONDS, longer before a resumed transfer's first bytes
(both sides read the held prefix first: ``resume_wait_seconds``). Plain
classes (``StageReceiver``, ``send_stage``) do the work; the Ray actor
(``_receiver_actor_class``) and ``ship_whole_model`` are the shell.
"""

from __future__ import annotations

import hashlib
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import msgpack

from orchestrator.cluster.fetching import FetchJob, fetch_stages
from orchestrator.cluster.ray_calls import one_line, ray_get
from orchestrator.cluster.stage_cache import (CachedStageFile, CacheEntry, ShippingError, ShipProgress, draft_entry,
                                              stage_cache_root)
from orchestrator.config import (ACTOR_START_SECONDS, CONNECT_SECONDS, SHIPPING_MAX_FRAME_BYTES, SLOWEST_PREFIX_READ,
                                 TRANSFER_IDLE_SECONDS, TRANSFER_RESULT_MARGIN_SECONDS, cache_dir)
from orchestrator.planning.cluster_split import NodeMemory
from orchestrator.transport import wire
from orchestrator.transport.handshake import accept_peer, connect_peer
from stages.backend import detect
from stages.errors import SpecpipeError
from stages.gguf_file import ModelFile, read_model
from stages.split import plan_split, stage_file_image
from stages.stage_image import CHUNK_BYTES, SourceRange, StageImage, vocabulary_image, write_atomically

if TYPE_CHECKING:
    from orchestrator.transport.tls import ChainCertificate

LOOPBACK = "127.0.0.1"
DIGEST_REFUSED = "its SHA-256 differs from the sender's"
_LENGTH = struct.Struct("!I")

class DigestRefused(ShippingError):
    """The node deleted the file it received: its SHA-256 was not the sender's (ship_stage sends it again)."""


def resume_wait_seconds(offset: int) -> float:
    """How long the first bytes of a transfer resumed at ``offset`` may take.
    Before them the sender reads the ``offset`` bytes the node holds from its
    source to hash them (from a remote source: over the network), while the
    receiver reads them back from its partial file: either side may wait for
    the other's read, longer than an idle socket is allowed."""
    return TRANSFER_IDLE_SECONDS + offset / SLOWEST_PREFIX_READ


def _send_frame(sock: socket.socket, frame: dict) -> None:
    packed = msgpack.packb(frame, use_bin_type=True)
    sock.sendall(_LENGTH.pack(len(packed)) + packed)


def _receive_exactly(sock: socket.socket, count: int) -> bytes:
    data = bytearray()
    while len(data) < count:
        chunk = sock.recv(min(count - len(data), CHUNK_BYTES))
        if not chunk:
            raise ShippingError("the peer closed the connection")
        data += chunk
    return bytes(data)


def _receive_frame(sock: socket.socket, key: str, kind: type) -> object:
    """The next frame, which must be a map of exactly ``{key: a kind}``."""
    (length,) = _LENGTH.unpack(_receive_exactly(sock, _LENGTH.size))
    if length > SHIPPING_MAX_FRAME_BYTES:
        raise ShippingError(f"a frame of {length} bytes (at most {SHIPPING_MAX_FRAME_BYTES})")
    try:
        frame = msgpack.unpackb(_receive_exactly(sock, length), raw=False, strict_map_key=True)
    except Exception as error:  # msgpack raises several types for malformed input
        raise ShippingError(f"a frame that is not msgpack ({type(error).__name__})") from None
    if not isinstance(frame, dict) or set(frame) != {key} or not isinstance(frame[key], kind) \
            or isinstance(frame[key], bool) != (kind is bool):
        raise ShippingError(f"expected a frame {{{key!r}: {kind.__name__}}}, got {frame!r:.80}")
    return frame[key]


class StageReceiver(CachedStageFile):
    """One stage file arriving in this node's cache from the driver (plain class; the Ray actor below wraps it)."""

    def __init__(self, root: Path, entry: CacheEntry, size: int):
        super().__init__(root, entry, size)
        self.received = 0  # bytes that came over the socket in the last transfer

    def receive(self, sock: socket.socket) -> Path:
        """Take the file from an authenticated connection; its path once complete
        (ShippingError naming what was wrong otherwise)."""
        with self.locked():
            if self.complete():  # another run finished it while this one waited
                _send_frame(sock, {"held": self.size})
            else:
                self._receive_locked(sock)
            _send_frame(sock, {"problem": ""})
            return self.path

    def _receive_locked(self, sock: socket.socket) -> None:
        sock.settimeout(TRANSFER_IDLE_SECONDS)
        held = self.held()
        _send_frame(sock, {"held": held})
        offset = _receive_frame(sock, "offset", int)
        if offset not in (0, held):
            raise ShippingError(f"the sender asked to start at byte {offset}; this node holds {held}")
        sock.settimeout(resume_wait_seconds(offset))  # the sender reads what this node holds first
        digest = self.append(offset, self._from_socket(sock, self.size - offset))
        expected = _receive_frame(sock, "sha256", bytes)
        if expected != digest.digest():
            self.partial.unlink(missing_ok=True)
            _send_frame(sock, {"problem": f"{DIGEST_REFUSED}; deleted"})
            raise ShippingError(f"{self.path.name}: {DIGEST_REFUSED}")
        self.keep()

    def _from_socket(self, sock: socket.socket, remaining: int):
        buffer = bytearray(min(CHUNK_BYTES, max(remaining, 1)))
        while remaining:
            view = memoryview(buffer)[:min(len(buffer), remaining)]
            count = sock.recv_into(view)
            if count == 0:
                raise ShippingError(f"the sender closed the connection with {remaining} bytes to go")
            sock.settimeout(TRANSFER_IDLE_SECONDS)
            yield view[:count]
            remaining -= count
            self.received += count


@dataclass(frozen=True)
class Sent:
    """One transfer as the sender saw it: it started at byte ``offset`` (what
    the node held already) and sent ``bytes_sent`` more."""

    offset: int
    bytes_sent: int


def send_stage(sock: socket.socket, image: StageImage, progress: Callable[[int], None] = lambda done: None) -> Sent:
    """Send ``image`` over an authenticated connection to a StageReceiver;
    progress(bytes of the file the node holds). ShippingError if refused."""
    sock.settimeout(TRANSFER_IDLE_SECONDS)
    size = image.size
    held = _receive_frame(sock, "held", int)
    if held == size:  # completed by another run meanwhile
        if _receive_frame(sock, "problem", str):
            raise ShippingError("the node refused the file")
        return Sent(size, 0)
    offset = held if 0 <= held <= size else 0
    _send_frame(sock, {"offset": offset})
    sock.settimeout(resume_wait_seconds(offset))  # the receiver reads back what it holds first
    digest = hashlib.sha256()
    position = 0
    for chunk in image.chunks(0):
        end = position + len(chunk)
        digest.update(chunk)
        if end > offset:
            sock.sendall(memoryview(chunk)[max(0, offset - position):])
            sock.settimeout(TRANSFER_IDLE_SECONDS)
            progress(end)
        position = end
    _send_frame(sock, {"sha256": digest.digest()})
    problem = _receive_frame(sock, "problem", str)
    if problem:
        refused = DigestRefused if problem.startswith(DIGEST_REFUSED) else ShippingError
        raise refused(f"the node refused the file: {problem}")
    return Sent(offset, size - offset)


@dataclass(frozen=True)
class Shipment:
    """Stage ``stage_index``'s file on its node: its path there, the node, the
    bytes the node held before (a resumed transfer) and those sent now, in
    ``seconds`` (0 bytes sent: it was there already). source: where the bytes
    came from, "driver" or "source" (the node fetched them itself,
    orchestrator.cluster.fetching); note: why the driver sent a stage whose
    node was to fetch it; sha256: of the file a node assembled; what: "stage",
    or "draft" (a draft model's whole file, ship_draft)."""

    stage_index: int
    path: str
    node_address: str
    node_id: str
    size: int
    resumed_from: int
    bytes_sent: int
    seconds: float
    source: str = "driver"
    note: str = ""
    sha256: str = ""
    what: str = "stage"


def _receiver_actor_class():
    import ray

    @ray.remote(num_cpus=0, max_restarts=0)
    class StageReceiverActor:
        """Thin Ray shell over a StageReceiver, on the stage's node."""

        def __init__(self, entry: CacheEntry, size: int, secret: bytes, loopback: bool, certificate):
            self.receiver = StageReceiver(stage_cache_root(), entry, size)
            self.role = entry.role
            self.secret, self.loopback, self.certificate = secret, loopback, certificate
            self.outcome: Path | BaseException | None = None
            self.done = threading.Event()

        def open(self) -> tuple[str, str, int, int]:
            """(path, listening host, its port, bytes held): port 0 when the file is here whole."""
            if self.receiver.complete():
                return str(self.receiver.path), "", 0, self.receiver.size
            listener = wire.listen(LOOPBACK if self.loopback else ray.util.get_node_ip_address())
            threading.Thread(target=self._serve, args=(listener,), daemon=True).start()
            host, port = listener.getsockname()[:2]
            return str(self.receiver.path), host, port, self.receiver.held()

        def _serve(self, listener: socket.socket) -> None:
            try:
                with listener:
                    connection = accept_peer(listener, self.secret, self.role, CONNECT_SECONDS, self.certificate)
                with connection:
                    self.outcome = self.receiver.receive(connection)
            except (OSError, SpecpipeError) as error:
                self.outcome = error
            finally:
                self.done.set()

        def result(self, wait_seconds: float) -> str:
            if not self.done.wait(wait_seconds):
                raise ShippingError(f"the transfer did not end within {wait_seconds:.0f} s")
            if isinstance(self.outcome, BaseException):
                raise ShippingError(f"{type(self.outcome).__name__}: {self.outcome}")
            return str(self.outcome)

    return StageReceiverActor


def probe_nodes(reservation, stage_count: int, devices: bool = False) -> list[NodeMemory]:
    """Each stage's node (as the reservation places it): its address, id and
    the memory it has available; with ``devices``, also its GPUs' free memory
    (stages.backend: asking loads llama.cpp in the probe)."""
    import ray


    @ray.remote(num_cpus=0, max_retries=0)
    def node_memory() -> NodeMemory:
        import psutil

        offload_free = 0
        if devices:
            offload_free = detect().offload_memory()[0]
        return NodeMemory(ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id(),
                          psutil.virtual_memory().available, offload_free)

    probes = [node_memory.options(scheduling_strategy=reservation.scheduling_strategy(index)).remote()
              for index in range(stage_count)]
    return ray_get(probes, ACTOR_START_SECONDS, ShippingError, "the stages' nodes did not answer",
                   "could not ask the stages' nodes for their memory")


def ship_stage(image: StageImage, entry: CacheEntry, node: NodeMemory, scheduling_strategy, secret: bytes,
               loopback: bool, certificate: ChainCertificate | None, progress: ShipProgress) -> Shipment:
    """Stage ``entry.stage_index``'s file onto ``node``, where
    ``scheduling_strategy`` puts the stage (nothing sent if it is there whole;
    the rest of a partial one). A file refused for its digest is sent again
    from zero, once. loopback: the node is this machine."""
    import ray


    started = time.monotonic()
    where = entry.on_node(node)
    for attempt in range(2):
        actor = _receiver_actor_class().options(scheduling_strategy=scheduling_strategy).remote(
            entry, image.size, secret, loopback, certificate)
        try:
            path, host, port, held = ray.get(actor.open.remote(), timeout=ACTOR_START_SECONDS)
            if port == 0:
                return Shipment(entry.stage_index, path, node.address, node.node_id, image.size, image.size, 0, 0.0)
            sent = _send_to(image, host, port, entry, secret, certificate, progress)
            ray.get(actor.result.remote(CONNECT_SECONDS), timeout=CONNECT_SECONDS + TRANSFER_RESULT_MARGIN_SECONDS)
            return Shipment(entry.stage_index, path, node.address, node.node_id, image.size, sent.offset,
                            sent.bytes_sent, time.monotonic() - started)
        except ray.exceptions.GetTimeoutError:
            raise ShippingError(f"{where}: the receiver did not answer within {ACTOR_START_SECONDS:.0f} s") from None
        except ray.exceptions.RayError as error:
            raise ShippingError(f"{where}: its file could not be shipped: {one_line(error)}") from None
        except DigestRefused as error:
            if attempt == 0:
                continue
            raise ShippingError(f"{where}: its file could not be shipped: {error}") from None
        except SpecpipeError as error:  # ShippingError, HandshakeError, a source read for it (--model hf:...)
            raise ShippingError(f"{where}: its file could not be shipped: {error}") from None
        except OSError as error:
            raise ShippingError(f"{where}: the transfer failed: {error.strerror or error}") from None
        finally:
            ray.kill(actor)
    raise AssertionError("unreachable")


def _send_to(image: StageImage, host: str, port: int, entry: CacheEntry, secret: bytes,
             certificate: ChainCertificate | None, progress: ShipProgress) -> Sent:
    with connect_peer(host, port, secret, entry.role, CONNECT_SECONDS, certificate) as sock:
        return send_stage(sock, image, lambda done: progress(entry.stage_index, done, image.size, "shipping"))


def ship_draft(path: str, nodes: list[NodeMemory], secret: bytes, certificate: ChainCertificate | None,
               progress: ShipProgress) -> dict[str, Shipment | ShippingError]:
    """The draft model ``path`` (a file here) onto each of ``nodes`` but this
    one, whole, as a stage file goes (hashed, resumed, kept in the node's
    cache: a second run sends nothing). Returns the other nodes' Shipments by
    node id, or why a node's failed (its drafter does not start; the others do)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


    model = read_model(path)
    size = os.path.getsize(path)
    image = StageImage(b"", (SourceRange(Path(path), 0, size),))
    entry = draft_entry(model)
    here = ray.get_runtime_context().get_node_id()
    shipped = {}
    for node in nodes:
        if node.node_id in shipped or node.node_id == here:
            continue
        try:
            shipment = ship_stage(image, entry, node, NodeAffinitySchedulingStrategy(node.node_id, soft=False),
                                  secret, False, certificate, progress)
        except ShippingError as error:  # the node lost meanwhile, say
            shipped[node.node_id] = error
            continue
        shipped[node.node_id] = replace(shipment, what="draft")
    return shipped


@dataclass(frozen=True)
class ModelToShip:
    """``--model``: the whole model (its header read: a file on this machine,
    or RemoteFiles of an hf: source), cut into ``stage_count`` stages, each
    shipped to its node or, from a remote source, fetched by it.
    choose_starts(nodes): each stage's first block, for the stages' nodes in
    order (orchestrator.planning.cluster_split, or the user's boundaries).
    progress(stage, bytes done, bytes in all, verb). offloaded: --n-gpu-layers
    all, so the nodes' GPU memory is probed too. vocabulary_path: a file on
    this machine with the model's vocabulary."""

    model: ModelFile
    stage_count: int
    choose_starts: Callable[[list[NodeMemory]], tuple[int, ...]]
    vocabulary_path: str
    progress: ShipProgress = lambda stage_index, done, total, verb: None
    offloaded: bool = False  # the stages go whole onto GPUs where a node has them: probe their memory

    @property
    def remote(self) -> bool:
        """The model is elsewhere: each node fetches its own stage from there."""
        return not isinstance(self.model.paths[0], Path)


def ship_whole_model(model: ModelToShip, reservation, indices, secret: bytes, certificate: ChainCertificate | None,
                     split=None):
    """Put stages ``indices`` of ``model`` on the nodes ``reservation`` puts
    them on: fetched there from a remote source, else (or where a node
    cannot reach it) sent from here. split: the SplitPlan already chosen (a
    restart), else chosen now for those nodes. Returns (the SplitPlan, a
    Shipment per index, in order)."""
    import ray


    nodes = probe_nodes(reservation, model.stage_count, devices=model.offloaded and split is None)
    if split is None:
        split = plan_split(model.model, model.stage_count, list(model.choose_starts(nodes)[1:]))
    driver = ray.util.get_node_ip_address()
    entries = {index: CacheEntry(split.model.fingerprint, tuple(split.starts), split.model.block_count, index)
               for index in indices}
    images = {index: stage_file_image(split, index) for index in indices}
    shipments: dict[int, Shipment] = {}
    unreachable: dict[int, str] = {}
    if model.remote:
        shipments, unreachable = _fetch_on_nodes(entries, images, nodes, reservation, model.progress)
    for index in indices:
        if index not in shipments:
            shipment = ship_stage(images[index], entries[index], nodes[index], reservation.scheduling_strategy(index),
                                  secret, nodes[index].address == driver, certificate, model.progress)
            shipments[index] = replace(shipment, note=unreachable.get(index, ""))
    return split, [shipments[index] for index in indices]


def _fetch_on_nodes(entries: dict, images: dict, nodes: list[NodeMemory], reservation, progress: ShipProgress):
    """Each stage fetched by its node: (stage -> Shipment, stage -> why its node could not reach the source)."""
    started = time.monotonic()
    jobs = [FetchJob(entry, images[index], reservation.scheduling_strategy(index),
                     entry.on_node(nodes[index]))
            for index, entry in entries.items()]
    fetched, unreachable = fetch_stages(jobs, progress)
    seconds = time.monotonic() - started
    shipments = {index: Shipment(index, item.path, nodes[index].address, nodes[index].node_id, images[index].size,
                                 item.resumed_from, item.bytes_fetched, seconds if item.bytes_fetched else 0.0,
                                 source="source", sha256=item.sha256)
                 for index, item in fetched.items()}
    return shipments, unreachable


def write_vocabulary_file(header: bytes) -> str:
    """A model's metadata (stages.stage_image.vocabulary_image) as a file in
    this machine's cache, named by its digest: what the coordinator's
    tokenizer loads."""
    path = cache_dir() / "vocabularies" / f"{hashlib.sha256(header).hexdigest()[:32]}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(StageImage(header, ()), path)
    return str(path)


def fetch_vocabulary(stage_path: str, scheduling_strategy) -> str:
    """A file on this machine with the vocabulary of the stage file at
    ``stage_path`` on the node ``scheduling_strategy`` picks: the file's
    metadata and no tensors (stages.stage_image.vocabulary_image, a few MiB),
    read there and kept in this machine's cache under its digest."""
    import ray


    @ray.remote(num_cpus=0, max_retries=0)
    def vocabulary_on_node(path: str) -> bytes:
        return vocabulary_image(read_model(path)).header

    header = ray_get(vocabulary_on_node.options(scheduling_strategy=scheduling_strategy).remote(stage_path),
                     ACTOR_START_SECONDS, ShippingError, "stage 0's node did not send the vocabulary",
                     f"could not read the vocabulary of {stage_path} on stage 0's node")
    return write_vocabulary_file(header)
