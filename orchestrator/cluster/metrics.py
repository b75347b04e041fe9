"""Live figures of a run, exported with ``ray.util.metrics``.

Ray serves them at ``http://<node>:<metrics-export-port>/metrics`` with a
``ray_`` prefix (e.g. ``ray_specpipe_generated_tokens_total``); the dashboard's
Metrics page shows them through Prometheus and Grafana (docs/usage.md, "Watching a
run"). The coordinator records the generation's figures after every pass;
each stage actor records its own pass latency and KV cells in use.
"""

from __future__ import annotations

ACCEPTED_LENGTH_BOUNDARIES = [1.5, 2.5, 3.5, 4.5, 6.5, 8.5, 12.5, 16.5]
PASS_SECONDS_BOUNDARIES = [0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0]


class StageMetrics:
    """Recorded inside a stage actor after each pass."""

    def __init__(self, stage_index: int):
        from ray.util.metrics import Gauge, Histogram

        self.tags = {"stage": str(stage_index)}
        self.pass_seconds = Histogram(
            "specpipe_stage_pass_seconds", description="Target pass latency of one stage (compute only).",
            boundaries=PASS_SECONDS_BOUNDARIES, tag_keys=("stage",),
        )
        self.kv_cells = Gauge("specpipe_kv_cells_used", description="KV cache positions held by a stage.", tag_keys=("stage",))
        self.sequences = Gauge("specpipe_stage_sequences_held", description="KV sequences (requests) a stage holds.",
                               tag_keys=("stage",))
        self.pass_sequences = Gauge("specpipe_stage_sequences_per_pass",
                                    description="Sequences (requests) a stage's last pass carried (batched: over 1).",
                                    tag_keys=("stage",))
        self.busy = Gauge("specpipe_stage_busy_fraction",
                          description="A stage's compute over the last BUSY_WINDOW_SECONDS, as of its last pass.",
                          tag_keys=("stage",))

    def record(self, seconds: float, kv_cells: int, sequences: int, pass_sequences: int, busy: float) -> None:
        self.pass_seconds.observe(seconds, tags=self.tags)
        self.kv_cells.set(kv_cells, tags=self.tags)
        self.sequences.set(sequences, tags=self.tags)
        self.pass_sequences.set(pass_sequences, tags=self.tags)
        self.busy.set(busy, tags=self.tags)


class GenerationMetrics:
    """Recorded by the coordinator after each pass of a generation."""

    def __init__(self):
        from ray.util.metrics import Counter, Gauge, Histogram

        self.tokens = Counter("specpipe_generated_tokens", description="Tokens generated.")
        self.rate = Gauge("specpipe_tokens_per_second", description="Generation-phase tokens/s of the current request.")
        self.acceptance = Gauge("specpipe_acceptance_rate", description="Accepted / verified draft tokens, current request.")
        self.accepted_length = Histogram(
            "specpipe_accepted_length", description="Tokens committed per target pass.",
            boundaries=ACCEPTED_LENGTH_BOUNDARIES,
        )
        self.hop = Gauge("specpipe_hop_seconds", description="Mean transport time of one hop between processes.")
        self.drafter_busy = Gauge(
            "specpipe_drafter_busy_fraction", description="Drafting time / generation time, per drafter.",
            tag_keys=("drafter",),
        )
        self._counted = 0

    def record(self, generation, committed: int, hop_seconds: float, drafters) -> None:
        """generation: the running Generation; committed: tokens the last pass committed."""
        new = len(generation.tokens) - self._counted
        if new > 0:
            self.tokens.inc(new)
            self._counted += new
        self.rate.set(generation.tokens_per_second)
        self.acceptance.set(generation.speculation.acceptance_rate)
        self.accepted_length.observe(committed)
        self.hop.set(hop_seconds)
        if generation.seconds > 0:
            for drafter in drafters:
                self.drafter_busy.set(drafter.busy_seconds / generation.seconds, tags={"drafter": str(drafter.index)})


TOKEN_SECONDS_BOUNDARIES = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0]


class ServiceMetrics:
    """Recorded by the service (orchestrator.decoding.service.ServiceObserver) in the Serve replica."""

    def __init__(self):
        from ray.util.metrics import Counter, Gauge, Histogram

        self.decoding = Gauge("specpipe_requests_decoding", description="Requests holding a KV sequence.")
        self.queued = Gauge("specpipe_requests_queued", description="Requests waiting for a free KV sequence.")
        self.first_token_seconds = Histogram(
            "specpipe_time_to_first_token_seconds", description="From a request's arrival to its first token.",
            boundaries=TOKEN_SECONDS_BOUNDARIES,
        )
        self.inter_token_seconds = Histogram(
            "specpipe_inter_token_seconds", description="Between a request's successive tokens (a window's "
            "tokens arrive together: each counts the window's time over its tokens).",
            boundaries=TOKEN_SECONDS_BOUNDARIES,
        )
        self.prefix_queries = Counter("specpipe_prefix_cache_queries",
                                      description="Sequences begun: each looks for a prefix to copy.")
        self.prefix_hits = Counter("specpipe_prefix_cache_hits",
                                   description="Sequences that copied a prefix (the cache's, or a running one's).")
        self.prefix_reused = Counter("specpipe_prefix_cache_reused_tokens",
                                     description="Prompt tokens copied rather than prefilled.")

    def first_token(self, seconds: float) -> None:
        self.first_token_seconds.observe(seconds)

    def tokens(self, seconds: float, count: int) -> None:
        for _ in range(count):
            self.inter_token_seconds.observe(seconds / count)

    def load(self, active: int, queued: int) -> None:
        self.decoding.set(active)
        self.queued.set(queued)

    def prefix_query(self, prompt_tokens: int, reused: int) -> None:
        self.prefix_queries.inc()
        if reused:
            self.prefix_hits.inc()
            self.prefix_reused.inc(reused)


class RestartMetrics:
    """Recorded by the coordinator each time it restarts a lost stage or drafter."""

    def __init__(self):
        from ray.util.metrics import Counter

        self.restarts = Counter("specpipe_restarts", description="Stage and drafter actors restarted after a loss.",
                                tag_keys=("role", "index"))

    def record(self, role: str, index: int) -> None:
        """role: "stage" or "drafter"; index: its stage's index."""
        self.restarts.inc(tags={"role": role, "index": str(index)})
