"""One stage of a split model, run with llama.cpp's low-level API.

A stage holds a contiguous slice of blocks (a stage file written by
``stages.split``) or the whole model. It decodes a batch given either token ids
(first stage) or the previous stage's hidden states, at explicit positions and
sequence ids, and returns either hidden states (non-last stage) or logits (last
stage). docs/architecture.md ("Data flow") describes the technique.

* Hidden state out: llama.cpp names each block's output ``l_out-<i>``. The
  context's ``cb_eval`` callback asks for the last block's node, copies it out,
  and returns False, which stops the graph there (no output norm or head).
  llama.cpp calls it for every graph node, so it is C (``stages.capture``).
  Every batch row is marked as an output, or llama.cpp would drop rows before
  the last block.
* Hidden state in: the batch is allocated with an embedding width, and
  ``batch.embd`` carries float32[n_tokens, n_embd] instead of token ids.
* KV cache: each stage keeps its own blocks' cache; ``remove`` drops positions
  so every stage can apply the same rollback before its next batch.
* Several sequences (requests served at once): each gets its own KV stream
  (``kv_unified`` off), so its positions sit in the same cells, in the same
  order, as when it runs alone. In one unified cache a sequence's cells land
  after other sequences' and attention sums them in another order: measured
  here, logits then differ from a lone run by up to 1.04, which would change
  greedy tokens. Each decode carries the rows of one sequence, or of
  consecutive ones (a batched pass).
* Prefixes shared between sequences (``copy``): llama.cpp copies a whole
  stream into another (its sequence copy between streams), and the copy's
  positions from ``keep`` on are dropped. The cells keep their places and
  values, so the copied prefix computes on bit for bit as if the sequence
  had prefilled it itself (tests/model/test_prefix_copies.py).
* Token trees (``speculators.tree``): a stage of one sequence may take a
  batch whose rows form a tree (``parents``). Then the cache is one unified
  stream with ``tree_sequences`` more sequence ids, one per side leaf: each
  row carries the ids of the leaves below it, the committed cells are copied
  to every id before the pass, and the next pass's ``remove`` drops every
  side id, so only the main chain's cells stay, right after the committed
  ones (hole-free; flash attention stays off).

Context settings follow llama-cpp-python's ``Llama`` defaults (flash attention
off, n_batch = n_ubatch = 512), because ``Llama`` on the whole model is the
reference the output must equal token for token.
"""

from __future__ import annotations

import collections
import ctypes
import os

import numpy as np

from stages.llama import llama_cpp, missing
from stages.backend import StageCompute, detect as detect_backend, loaded_library
from stages.capture import AbortFlag, CaptureError, NodeCapture
from stages.errors import SpecpipeError
from stages.gguf_file import KEY_FIRST_BLOCK, KEY_SOURCE_FINGERPRINT, KEY_STAGE_COUNT, KEY_STAGE_INDEX
from stages.settings import StageSettings
from stages.tree_shape import TreeError, branch_sequences, check_preorder, depths

try:
    _ggml_base = loaded_library("libggml-base")
except OSError as failure:
    raise missing(failure) from None

_backend_ready = False


class StageError(SpecpipeError):
    """A stage could not load or decode; the message says why in one line."""


class PassAborted(StageError):
    """The pass was stopped mid-graph by ``StageEngine.abort`` (it was cancelled)."""


def ensure_backend() -> None:
    global _backend_ready
    if not _backend_ready:
        llama_cpp.llama_backend_init()
        _backend_ready = True


def quiet_logs() -> None:
    """Silence llama.cpp's load chatter (errors still come back as return codes)."""

    @llama_cpp.llama_log_callback
    def ignore(level, text, user_data):  # noqa: ARG001
        return None

    llama_cpp.llama_log_set(ignore, ctypes.c_void_p(0))
    quiet_logs.keep = ignore  # type: ignore[attr-defined]


def meta_string(model: llama_cpp.llama_model_p, key: str, capacity: int = 256) -> str | None:
    """A metadata value of a loaded model as text (None when absent)."""
    buffer = ctypes.create_string_buffer(capacity)
    length = llama_cpp.llama_model_meta_val_str(model, key.encode(), buffer, ctypes.sizeof(buffer))
    if length >= capacity:
        return meta_string(model, key, length + 1)
    return buffer.value.decode(errors="replace") if length >= 0 else None


class StageEngine:
    """A loaded stage: decode batches, return hidden states or logits.

    is_first: takes token ids. is_last: returns logits (and holds the head).
    first_block, end_block: the blocks [first_block, end_block) of the whole model it holds.
    compute: its backend, devices and offloaded layers (stages.backend).
    n_embd: width of hidden states; n_vocab: width of logits.
    """

    def __init__(self, path: str, settings: StageSettings = StageSettings(), *, verbose: bool = False):
        """Load the stage file and make its llama.cpp context: one straight
        sequence of llama.cpp's model and context parameters, each commented
        with why it is set so (it reads best in one piece)."""
        ensure_backend()
        if not verbose:
            quiet_logs()
        if not os.path.isfile(path):
            raise StageError(f"{path}: no such file")
        self.path = path
        self.settings = settings
        model_params = llama_cpp.llama_model_default_params()
        model_params.n_gpu_layers = settings.n_gpu_layers
        self._model = llama_cpp.llama_model_load_from_file(path.encode(), model_params)
        if not self._model:
            raise StageError(f"{path}: llama.cpp could not load this model")
        # A file without specpipe metadata is the whole model: one stage.
        self.stage_index = int(meta_string(self._model, KEY_STAGE_INDEX) or 0)
        self.stage_count = int(meta_string(self._model, KEY_STAGE_COUNT) or 1)
        self.first_block = int(meta_string(self._model, KEY_FIRST_BLOCK) or 0)
        self.source_fingerprint = meta_string(self._model, KEY_SOURCE_FINGERPRINT) or ""  # the whole model's
        self.is_first = self.stage_index == 0
        self.is_last = self.stage_index == self.stage_count - 1
        self.block_count = llama_cpp.llama_model_n_layer(self._model)
        self.end_block = self.first_block + self.block_count
        self.compute = StageCompute.of(detect_backend(), settings.n_gpu_layers, self.block_count)
        self.n_embd = llama_cpp.llama_model_n_embd(self._model)
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.vocabulary_pointer = self._vocab  # for choosing under a grammar (stages.grammar.Vocabulary)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self._vocab)

        if settings.tree_sequences and settings.sequences != 1:
            raise StageError(f"token trees need a stage of one sequence, not {settings.sequences}")
        context_params = llama_cpp.llama_context_default_params()
        streams = settings.sequences + settings.prefix_sequences
        context_params.n_ctx = settings.n_ctx * streams  # n_ctx cells for each sequence's stream
        context_params.n_batch = settings.n_batch
        context_params.n_ubatch = settings.n_batch
        context_params.n_threads = settings.threads
        context_params.n_threads_batch = settings.threads
        context_params.n_seq_max = streams + settings.tree_sequences
        # a stream per sequence: exact beside others; a tree's ids share their sequence's one (module docstring)
        context_params.kv_unified = settings.tree_sequences > 0
        context_params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        context_params.no_perf = True
        self._capture: NodeCapture | None = None
        try:
            # set from another thread, it stops the running pass after its current graph node
            self.abort = AbortFlag()
            if not self.is_last:
                # kept as long as the context: llama.cpp writes into its buffer
                self._capture = NodeCapture(_ggml_base, f"l_out-{self.block_count - 1}", settings.n_batch, self.n_embd)
        except CaptureError as error:
            self.close()
            raise StageError(f"{path}: {error}") from None
        context_params.abort_callback = llama_cpp.ggml_abort_callback(self.abort.callback)
        context_params.abort_callback_data = self.abort.user_data
        if self._capture is not None:
            context_params.cb_eval = llama_cpp.ggml_backend_sched_eval_callback(self._capture.callback)
            context_params.cb_eval_user_data = self._capture.user_data
        self._context = llama_cpp.llama_init_from_model(self._model, context_params)
        if not self._context:
            self.close()  # frees the model once (__del__ calls close again: it must find nothing left)
            raise StageError(f"{path}: llama.cpp could not create a context (n_ctx {settings.n_ctx})")
        self.sequences = settings.sequences
        self.prefix_sequences = settings.prefix_sequences
        self.n_ctx = llama_cpp.llama_n_ctx_seq(self._context)  # positions per sequence
        self._memory = llama_cpp.llama_get_memory(self._context)
        self.tree_sequences = settings.tree_sequences
        self._token_batch = llama_cpp.llama_batch_init(settings.n_batch, 0, 1 + self.tree_sequences)
        self._embd_batch = llama_cpp.llama_batch_init(settings.n_batch, self.n_embd, 1 + self.tree_sequences)

    # -- decoding ---------------------------------------------------------
    def decode(
        self,
        positions: np.ndarray,
        *,
        tokens: np.ndarray | None = None,
        hidden: np.ndarray | None = None,
        sequence: int | np.ndarray = 0,
        logit_rows: np.ndarray | None = None,
        parents: np.ndarray | None = None,
    ) -> np.ndarray:
        """Decode one batch of one sequence, or of several (a batched pass).

        positions: int32[n_tokens]; tokens: int32[n_tokens] (first stage) or
        hidden: float32[n_tokens, n_embd] (later stages); sequence: its KV
        sequence (0 .. sequences - 1), or int32[n_tokens], each row's (a
        chain of rows for each of consecutive sequence ids, every one as
        many rows: llama.cpp then decodes them in one graph, which a non-last
        stage's capture needs; each sequence's rows compute bit for bit as
        they would alone, in its own KV stream); logit_rows: batch rows whose logits the
        last stage returns (default: the last row); parents: int32[n_tokens],
        the rows form a token tree in preorder (speculators.tree), each row at
        positions[0] + its depth (None: a chain, row i after row i - 1).

        Returns float32[n_tokens, n_embd] hidden states from a non-last stage,
        or float32[len(logit_rows), n_vocab] logits from the last stage.
        Raises PassAborted when ``abort`` was set before or during the pass:
        the sequence's cache from its first position on is then undefined
        (the next pass's ``remove`` drops it).
        """
        self._check(positions, tokens, hidden)
        if parents is not None:
            self._check_sequence(sequence)
            row_sequences = self._tree_sequences(positions, parents)
            for branch in range(1, max(max(ids) for ids in row_sequences) + 1):
                llama_cpp.llama_memory_seq_cp(self._memory, 0, branch, -1, -1)  # the committed cells
        else:
            row_sequences = self._row_sequences(sequence, len(positions))
        if logit_rows is None:
            logit_rows = np.array([len(positions) - 1], dtype=np.int32)
        batch = self._filled_batch(positions, tokens, hidden, logit_rows, row_sequences)
        if self._capture is not None:
            self._capture.start()
        status = llama_cpp.llama_decode(self._context, batch)
        if self.abort.is_set:
            raise PassAborted(f"stage {self.stage_index}: the pass was cancelled (llama_decode returned {status})")
        if self._capture is not None:
            return self._captured_hidden(status, len(positions))
        if status != 0:
            raise StageError(f"stage {self.stage_index}: llama_decode returned {status}")
        logits = np.empty((len(logit_rows), self.n_vocab), dtype=np.float32)
        for out_row, batch_row in enumerate(logit_rows):
            pointer = llama_cpp.llama_get_logits_ith(self._context, int(batch_row))
            if not pointer:
                raise StageError(f"stage {self.stage_index}: no logits for row {int(batch_row)}")
            ctypes.memmove(logits[out_row].ctypes.data, pointer, 4 * self.n_vocab)
        return logits

    def decode_branches(self, positions: np.ndarray, tokens: np.ndarray, branches: np.ndarray) -> np.ndarray:
        """A draft model growing a token tree (speculators.model.ModelSpeculator.grow_tree):
        each row in its own branch, a KV id (0, or 1 .. tree_sequences)
        holding the row's ancestors (``fork`` made it); logits for every row,
        float32[n_tokens, n_vocab]. Whole models only; the next ``remove``
        drops every branch but 0."""
        if not (self.is_first and self.is_last) or not self.tree_sequences:
            raise StageError(f"{self.path}: growing a tree needs a whole model set up for token trees")
        self._check(positions, tokens, None)
        if len(branches) != len(positions) or int(np.min(branches)) < 0 or int(np.max(branches)) > self.tree_sequences:
            raise StageError(f"tree branches outside 0..{self.tree_sequences}, or not one per row")
        rows = np.arange(len(positions), dtype=np.int32)
        batch = self._filled_batch(positions, tokens, None, rows, [[int(branch)] for branch in branches])
        status = llama_cpp.llama_decode(self._context, batch)
        if status != 0:
            raise StageError(f"{self.path}: llama_decode returned {status} growing a tree")
        logits = np.empty((len(rows), self.n_vocab), dtype=np.float32)
        for row in rows:
            ctypes.memmove(logits[row].ctypes.data, llama_cpp.llama_get_logits_ith(self._context, int(row)),
                           4 * self.n_vocab)
        return logits

    def fork(self, source: int, destination: int, end: int) -> None:
        """Make branch ``destination`` (a tree's KV id) hold ``source``'s cells
        below position ``end``: a new branch of a tree being grown, after a row
        whose own branch already goes on (one unified stream: the cells are
        shared, not copied)."""
        if not 0 < destination <= self.tree_sequences or not 0 <= source <= self.tree_sequences:
            raise StageError(f"tree branches {source} -> {destination} outside 0..{self.tree_sequences}")
        llama_cpp.llama_memory_seq_rm(self._memory, destination, -1, -1)
        llama_cpp.llama_memory_seq_cp(self._memory, source, destination, -1, end)

    def _check(self, positions: np.ndarray, tokens: np.ndarray | None, hidden: np.ndarray | None) -> None:
        """A batch llama.cpp can take safely, or a StageError naming what is wrong."""
        n_tokens = len(positions)
        if n_tokens == 0 or n_tokens > self.settings.n_batch:
            raise StageError(f"batch of {n_tokens} tokens (allowed 1..{self.settings.n_batch})")
        if (tokens is None) == (hidden is None):
            raise StageError("give exactly one of tokens or hidden")
        if tokens is not None and not self.is_first:
            raise StageError(f"stage {self.stage_index} takes hidden states, not tokens")
        if hidden is not None and self.is_first:
            raise StageError("the first stage takes token ids, not hidden states")
        if hidden is not None and hidden.shape != (n_tokens, self.n_embd):
            raise StageError(f"hidden states of shape {hidden.shape}, expected {(n_tokens, self.n_embd)}")
        if tokens is not None and (int(np.min(tokens)) < 0 or int(np.max(tokens)) >= self.n_vocab):
            raise StageError(f"a token id outside the vocabulary of {self.n_vocab}")
        if int(np.min(positions)) < 0:
            raise StageError("a negative position")
        if int(np.max(positions)) >= self.n_ctx:
            raise StageError(f"position {int(np.max(positions))} is beyond the context of {self.n_ctx} tokens")

    def _check_sequence(self, sequence: int) -> None:
        if not 0 <= sequence < self.sequences + self.prefix_sequences:
            raise StageError(f"sequence {sequence} is not one of the stage's {self.sequences + self.prefix_sequences}")

    def _row_sequences(self, sequence: int | np.ndarray, n_tokens: int) -> list[list[int]]:
        """Each row's KV sequence id, checked: one sequence, or several with as many rows each."""
        if isinstance(sequence, (int, np.integer)):
            self._check_sequence(int(sequence))
            return [[int(sequence)]] * n_tokens
        if len(sequence) != n_tokens:
            raise StageError(f"{len(sequence)} row sequences for {n_tokens} rows")
        counts = collections.Counter(int(value) for value in sequence)
        for value in counts:
            self._check_sequence(value)
        # llama.cpp decodes the rows in one graph only for equal counts of consecutive sequence ids (its KV
        # streams in one range); a non-last stage hands on one graph's rows (measured on 0.3.36: [0, 2] splits)
        if len(set(counts.values())) > 1:
            raise StageError(f"a batched pass of unequal windows {sorted(counts.values())}")
        if max(counts) - min(counts) + 1 != len(counts):
            raise StageError(f"a batched pass of sequences {sorted(counts)}, not consecutive")
        return [[int(value)] for value in sequence]

    def _filled_batch(self, positions: np.ndarray, tokens: np.ndarray | None, hidden: np.ndarray | None,
                      logit_rows: np.ndarray, row_sequences: list[list[int]]):
        """The llama_batch of this pass: inputs, positions, the rows whose
        output is wanted, and each row's KV sequence ids."""
        n_tokens = len(positions)
        batch = self._token_batch if tokens is not None else self._embd_batch
        batch.n_tokens = n_tokens
        if tokens is not None:
            ctypes.memmove(batch.token, np.ascontiguousarray(tokens, dtype=np.int32).ctypes.data, 4 * n_tokens)
        else:
            source = np.ascontiguousarray(hidden, dtype=np.float32)
            ctypes.memmove(batch.embd, source.ctypes.data, source.nbytes)
        ctypes.memmove(batch.pos, np.ascontiguousarray(positions, dtype=np.int32).ctypes.data, 4 * n_tokens)
        wants_output = np.zeros(n_tokens, dtype=np.int8)
        if self.is_last:
            wants_output[logit_rows] = 1
        else:
            wants_output[:] = 1  # every row must reach the last block
        ctypes.memmove(batch.logits, wants_output.ctypes.data, n_tokens)
        for row, ids in enumerate(row_sequences):
            batch.n_seq_id[row] = len(ids)
            for slot, branch in enumerate(ids):
                batch.seq_id[row][slot] = branch
        return batch

    def _captured_hidden(self, status: int, n_tokens: int) -> np.ndarray:
        """A non-last stage's hidden states float32[n_tokens, n_embd], as the
        graph callback copied them. Stopping the graph early makes llama_decode
        report an abort (2); the captured hidden state is what counts."""
        try:
            hidden = self._capture.captured()
        except CaptureError as error:
            raise StageError(f"stage {self.stage_index}: {error}") from None
        if hidden is None:
            raise StageError(f"stage {self.stage_index}: decode returned {status} without a hidden state")
        if hidden.shape[0] != n_tokens:
            raise StageError(f"stage {self.stage_index}: captured {hidden.shape[0]} rows, expected {n_tokens}")
        return hidden

    def _tree_sequences(self, positions: np.ndarray, parents: np.ndarray) -> list[list[int]]:
        """Each row's KV sequence ids for a tree batch (checked first)."""
        if not self.tree_sequences:
            raise StageError(f"stage {self.stage_index} was not set up for token trees")
        if len(parents) != len(positions):
            raise StageError(f"{len(parents)} parents for {len(positions)} rows")
        try:
            check_preorder(parents)
        except TreeError as error:
            raise StageError(f"stage {self.stage_index}: {error}") from None
        if not np.array_equal(positions, positions[0] + depths(parents)):
            raise StageError(f"stage {self.stage_index}: a tree row's position is not its root's plus its depth")
        row_sequences = branch_sequences(parents)
        if max(row_sequences[0]) > self.tree_sequences:
            raise StageError(f"a tree of {max(row_sequences[0]) + 1} leaves (this stage holds "
                             f"{self.tree_sequences + 1})")
        return row_sequences

    # -- KV cache ---------------------------------------------------------
    def remove(self, first_position: int, sequence: int = -1) -> None:
        """Drop cached positions >= first_position (of one sequence; -1: of all),
        and every token tree's side branches."""
        if sequence != -1:
            self._check_sequence(sequence)
        for branch in range(1, self.tree_sequences + 1):
            llama_cpp.llama_memory_seq_rm(self._memory, branch, -1, -1)
        llama_cpp.llama_memory_seq_rm(self._memory, sequence, first_position, -1)

    def copy(self, source: int, destination: int, keep: int) -> None:
        """Make sequence ``destination`` hold ``source``'s cached positions below
        ``keep`` (module docstring: a whole-stream copy, then its tail dropped;
        llama.cpp copies the cells' values at the start of the next decode,
        before that decode writes any)."""
        self._check_sequence(source)
        self._check_sequence(destination)
        if self.tree_sequences:
            raise StageError("a stage set up for token trees does not copy prefixes")
        if source != destination:
            llama_cpp.llama_memory_seq_cp(self._memory, source, destination, -1, -1)
        llama_cpp.llama_memory_seq_rm(self._memory, destination, keep, -1)

    def cached_positions(self, sequence: int = 0) -> int:
        """Number of positions cached for a sequence (largest position + 1)."""
        return int(llama_cpp.llama_memory_seq_pos_max(self._memory, sequence)) + 1

    def sequences_held(self) -> int:
        """Sequences with at least one cached position."""
        return sum(self.cached_positions(sequence) > 0 for sequence in range(self.sequences))

    def cells_held(self) -> int:
        """Cached positions over every sequence."""
        return sum(self.cached_positions(sequence) for sequence in range(self.sequences))

    def prefix_cells(self) -> int:
        """Cached positions over the sequences that keep prefixes."""
        return sum(self.cached_positions(sequence)
                   for sequence in range(self.sequences, self.sequences + self.prefix_sequences))

    def close(self) -> None:
        if getattr(self, "_context", None):
            llama_cpp.llama_batch_free(self._token_batch)
            llama_cpp.llama_batch_free(self._embd_batch)
            llama_cpp.llama_free(self._context)
            self._context = None
        if getattr(self, "_model", None):
            llama_cpp.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        self.close()
