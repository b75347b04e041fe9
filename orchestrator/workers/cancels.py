"""Which passes of a stage's chain are cancelled (PipeInfer's early
cancellation), kept beside the stage's serving loop.

The coordinator sends ``Cancel`` on a connection of its own, read by a
thread (``read``) while the serving thread takes passes (``take``); the
same thread answers the coordinator's ``Ping`` with ``Alive`` at once, also
while llama.cpp computes (orchestrator.transport.liveness). A pass
cancelled before it reaches the stage is dropped; one the stage is running
stops once every pass it decodes with is cancelled (``abort`` is set: the
engine stops after its current graph node). State shared by the two threads
is held under one lock; a new chain (``new_chain``) starts the pass ids again,
and a reader of an older chain changes nothing.
"""

from __future__ import annotations

import socket
import threading
import time

from orchestrator.transport import wire
from orchestrator.transport.messages import Alive, Cancel, Cancelled, Ping, StageBatch


class PassCancels:
    """abort: the engine's stop flag (StageEngine.abort); stage: its stage's index (its Alive says it)."""

    def __init__(self, abort: threading.Event, stage: int):
        self.abort = abort
        self.stage = stage
        self.lock = threading.Lock()
        self.wanted: set[int] = set()  # passes of this chain cancelled before they arrived here
        self.latest = 0  # the last pass of this chain taken by the serving thread (ids increase)
        self.running: set[int] = set()  # the passes llama.cpp is computing now (several: a batched pass)
        self.running_cancelled: set[int] = set()  # those of them cancelled: all of them stops the computation
        self.generation = 0
        self.problem = ""  # a bad frame on the cancel connection, reported with the next pass

    def new_chain(self) -> int:
        """Pass ids start again; returns the new chain's generation (for its reader)."""
        with self.lock:
            self.generation += 1
            self.wanted.clear()
            self.latest = 0
            self.problem = ""
            return self.generation

    def read(self, connection: socket.socket, generation: int) -> None:
        """Take cancels from ``connection`` until it closes (a thread's loop)."""
        while True:
            try:
                message = wire.receive_message(connection)
            except (wire.ConnectionClosed, OSError):
                return  # the chain ended
            except wire.ProtocolError as error:
                message = f"a bad frame on the cancel connection: {error}"
            if isinstance(message, Ping):
                try:
                    wire.send_message(connection, Alive(message.number, self.stage))
                except OSError:
                    return  # the chain ended
                continue
            if not isinstance(message, Cancel):
                with self.lock:
                    if generation == self.generation:
                        self.problem = message if isinstance(message, str) else \
                            f"the cancel connection sent {type(message).__name__}, not a cancel"
                return
            with self.lock:
                if generation != self.generation:
                    return
                if message.pass_id in self.running:
                    self.running_cancelled.add(message.pass_id)
                    if self.running_cancelled >= self.running:  # a batched pass stops only when all of it is unwanted
                        self.abort.set()
                elif message.pass_id > self.latest:  # not here yet (a pass already gone is ignored)
                    self.wanted.add(message.pass_id)

    def took(self, pass_id: int) -> None:
        """The serving thread takes pass ``pass_id`` (under the lock)."""
        self.latest = pass_id
        self.wanted = {wanted for wanted in self.wanted if wanted > pass_id}

    def take(self, received: list[StageBatch | Cancelled], stage: int) -> tuple[list[StageBatch], dict[int, object]]:
        """The serving thread takes one pass's batches: (those to run, the
        outcomes of those dropped, cancelled before they arrived); the runs are
        marked running until ``finished``."""
        outcomes: dict[int, object] = {}
        with self.lock:
            for message in received:
                dropped = isinstance(message, StageBatch) and message.pass_id in self.wanted
                self.took(message.pass_id)
                if dropped:
                    outcomes[message.pass_id] = Cancelled(message.pass_id, stage, message.stage_seconds + (0.0,),
                                                          message.stage_started + (time.time(),))
            running = [message for message in received
                       if isinstance(message, StageBatch) and message.pass_id not in outcomes]
            self.running, self.running_cancelled = {batch.pass_id for batch in running}, set()
        return running, outcomes

    def finished(self) -> None:
        """The running passes are done (or stopped): clear the stop flag for the next."""
        with self.lock:
            self.running = set()
            self.abort.clear()
