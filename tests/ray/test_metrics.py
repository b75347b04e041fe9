"""Live metrics reach the cluster's Prometheus endpoints while a pipeline runs."""

import re
import time
import urllib.request

from orchestrator.cluster.drafters import DrafterSettings, start_drafters, stop_drafters
from orchestrator.decoding.drafting import Drafting
from orchestrator.decoding.loop import generate
from orchestrator.decoding.schedule import Schedule
from orchestrator.cluster.metrics import GenerationMetrics
from orchestrator.cluster.pipeline import Pipeline
from speculators.sampling import SamplingSettings
from stages.tokenizer import Tokenizer
from speculators.prompt_lookup import PromptLookupSpeculator
from stages.settings import StageSettings


def scrape(ports) -> str:
    texts = []
    for port in ports:
        try:
            texts.append(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode())
        except OSError:
            pass
    return "\n".join(texts)


def value(text: str, name: str, **tags) -> float | None:
    """The largest sample of a metric whose tags include the given ones."""
    found = None
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{key}="{wanted}"' in line for key, wanted in tags.items()):
                sample = float(line.rsplit(" ", 1)[1])
                found = sample if found is None else max(found, sample)
    return found


def new_series(text: str, before: str, name: str, **tags) -> set[str]:
    """The series of a metric (its name and tags) in text but not in before, with the given tags among theirs."""
    def series(scraped: str) -> set[str]:
        return {line.rsplit(" ", 1)[0] for line in scraped.splitlines()
                if (line.startswith(name + "{") or line.startswith(name + " "))
                and all(f'{key}="{wanted}"' in line for key, wanted in tags.items())}

    return series(text) - series(before)


def total(text: str, name: str) -> float:
    """The sum of a counter's samples over all its series (a run may add a series of its own)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def test_custom_metrics_of_a_run_reach_the_metrics_endpoint_while_the_pipeline_is_up(ray_cluster, splits):
    """Scraped after the run, the pipeline and drafters still up (exports come every second)."""
    tokenizer = Tokenizer(splits[2][0])
    prompt = tokenizer.chat_prompt("Repeat exactly: the quick brown fox jumps over the lazy dog, twice.")
    with Pipeline(splits[2], StageSettings(n_ctx=1024)) as pipeline:
        drafters = start_drafters(pipeline, PromptLookupSpeculator, DrafterSettings(draft_max=6))
        live = GenerationMetrics()
        # other tests' runs on this cluster export the same series: count only this run's
        counted_before = total(scrape(ray_cluster.metrics_ports), "ray_specpipe_generated_tokens_total")
        try:
            result = generate(
                pipeline, prompt, 40, SamplingSettings(), tokenizer.is_end,
                drafting=Drafting(drafters, Schedule.ASYNC, 6),
                on_pass=lambda running, committed: live.record(running, committed, pipeline.hop_seconds, drafters),
            )
            deadline = time.monotonic() + 60
            wanted = {
                "generated tokens": ("ray_specpipe_generated_tokens_total", {}),
                "tokens/s": ("ray_specpipe_tokens_per_second", {}),
                "acceptance": ("ray_specpipe_acceptance_rate", {}),
                "accepted length": ("ray_specpipe_accepted_length_count", {}),
                "hop latency": ("ray_specpipe_hop_seconds", {}),
                "drafter busy": ("ray_specpipe_drafter_busy_fraction", {"drafter": "1"}),
                "stage 0 pass latency": ("ray_specpipe_stage_pass_seconds_count", {"stage": "0"}),
                "stage 1 pass latency": ("ray_specpipe_stage_pass_seconds_count", {"stage": "1"}),
                "stage 1 KV cells": ("ray_specpipe_kv_cells_used", {"stage": "1"}),
                "stage 0 busy": ("ray_specpipe_stage_busy_fraction", {"stage": "0"}),
            }
            while True:
                text = scrape(ray_cluster.metrics_ports)
                missing = [label for label, (name, tags) in wanted.items() if value(text, name, **tags) is None]
                # the run has ended, but its last samples reach the endpoint at the next export
                counted = total(text, "ray_specpipe_generated_tokens_total") - counted_before
                cells = value(text, "ray_specpipe_kv_cells_used", stage="1") or 0
                if (not missing and counted >= len(result.tokens) and cells >= len(prompt)) or time.monotonic() > deadline:
                    break
                time.sleep(1)
            assert not missing, f"never exported: {missing}"
        finally:
            stop_drafters(drafters)
    assert total(text, "ray_specpipe_generated_tokens_total") - counted_before >= len(result.tokens)
    assert value(text, "ray_specpipe_tokens_per_second") > 0
    assert value(text, "ray_specpipe_kv_cells_used", stage="1") >= len(prompt)
    assert 0 < value(text, "ray_specpipe_stage_busy_fraction", stage="0") <= 1
    assert re.search(r'ray_specpipe_stage_pass_seconds_bucket\{[^}]*stage="0"', text)


def test_service_metrics_appear_while_requests_are_served(ray_cluster, splits):
    """What `orchestrate serve` records (requests decoding and queued, time to
    first token, inter-token latency, sequences each stage holds) reaches the
    endpoint: series of this process's, counted from before (a server that ran
    on this cluster earlier, the serve bench's, may have left series of its own)."""
    import threading

    from orchestrator.cluster.metrics import ServiceMetrics
    from orchestrator.decoding.service import Service, ServiceRequest, ServiceSettings

    tokenizer = Tokenizer(splits[2][0])
    ended = threading.Semaphore(0)
    before = scrape(ray_cluster.metrics_ports)
    first_tokens, gaps = "ray_specpipe_time_to_first_token_seconds_count", "ray_specpipe_inter_token_seconds_count"
    with Pipeline(splits[2], StageSettings(n_ctx=256, sequences=2)) as pipeline:
        service = Service(pipeline, tokenizer.is_end, ServiceSettings(max_sequences=2, queue_limit=4, context=256),
                          observer=ServiceMetrics())
        for prompt in ("One, two,", "Red, green,", "Monday, Tuesday,"):
            service.submit(ServiceRequest(tokenizer.tokenize(prompt), 12, SamplingSettings()),
                           lambda progress: progress.finished and ended.release())
        for _ in range(3):
            assert ended.acquire(timeout=120)
        wanted = {
            "requests decoding": ("ray_specpipe_requests_decoding", {}),
            "requests queued": ("ray_specpipe_requests_queued", {}),
            "time to first token": (first_tokens, {}),
            "inter-token latency": (gaps, {}),
            "stage 0 sequences": ("ray_specpipe_stage_sequences_held", {"stage": "0"}),
        }
        deadline = time.monotonic() + 60
        while True:
            text = scrape(ray_cluster.metrics_ports)
            missing = [label for label, (name, tags) in wanted.items() if not new_series(text, before, name, **tags)]
            counted = total(text, first_tokens) - total(before, first_tokens), total(text, gaps) - total(before, gaps)
            if (not missing and counted[0] >= 3 and counted[1] >= 3 * 11) \
                    or time.monotonic() > deadline:  # every sample of the run reaches the endpoint by an export
                break
            time.sleep(1)
        service.close(drain_seconds=5)
    assert not missing, f"never exported: {missing}"
    assert counted[0] >= 3 and counted[1] >= 3 * 11, counted


def test_a_stage_restart_is_counted_at_the_metrics_endpoint(ray_cluster, splits):
    """ray_specpipe_restarts_total{role="stage", index} counts restarts (as
    orchestrate run and serve record them through Pipeline's on_restart)."""
    import os
    import signal

    import numpy as np

    from orchestrator.cluster.metrics import RestartMetrics

    metrics = RestartMetrics()
    with Pipeline(splits[2], StageSettings(n_ctx=64),
                  on_restart=lambda restart: metrics.record("stage", restart.stage_index)) as pipeline:
        tokens, positions = np.array([1, 2, 3], np.int32), np.arange(3, dtype=np.int32)
        pipeline.forward(positions, tokens, 0)
        os.kill(pipeline.stages[1].process_id, signal.SIGKILL)
        pipeline.forward(positions, tokens, 0)
        assert len(pipeline.restarts) == 1
    deadline = time.monotonic() + 60
    while (found := value(scrape(ray_cluster.metrics_ports), "ray_specpipe_restarts_total", role="stage",
                          index="1")) is None and time.monotonic() < deadline:
        time.sleep(1)
    assert found is not None and found >= 1
