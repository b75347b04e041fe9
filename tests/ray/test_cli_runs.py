"""`orchestrate` end to end, as a user runs it: as a driver of the session's cluster
(``--address``), and with a local Ray of its own where that start is the point."""

import json
from pathlib import Path

from conftest import PROMPTS, orchestrate

SETUPS = Path(__file__).parents[2] / "benchmarks" / "setups"


def test_split_then_run_json_equals_llama(smollm2, reference, tmp_path, orchestrate_on_cluster):
    outputs = [tmp_path / "a.gguf", tmp_path / "b.gguf"]
    result = orchestrate("split", smollm2, *outputs, "--boundaries", "12")
    assert result.returncode == 0, result.stderr
    assert "blocks [0, 12)" in result.stdout and "blocks [12, 30)" in result.stdout
    assert not list(tmp_path.glob("*.partial*"))

    verified = orchestrate("verify-split", smollm2, *outputs)
    assert verified.returncode == 0 and "largest logit difference 0" in verified.stdout

    result = orchestrate_on_cluster("run", "--model-split", *outputs, "--raw", "--prompt", PROMPTS[0], "--max-tokens", "24",
                                    "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    expected = reference.greedy(reference.tokenize(PROMPTS[0]), 24).tokens
    assert report["tokens"] == expected
    assert report["text"] == reference.llama.detokenize(expected).decode()
    assert report["prompt_tokens"] == len(reference.tokenize(PROMPTS[0]))
    assert report["tokens_per_second"] > 0 and report["seconds"] > 0
    assert [stage["layers"] for stage in report["stages"]] == [[0, 12], [12, 30]]
    assert all(stage["busy_seconds"] > 0 and stage["node"] for stage in report["stages"])
    assert all(0 < stage["busy_fraction"] < 1 and stage["busy_discarded_share"] == 0 for stage in report["stages"])
    # a plain run starts nothing ahead, so nothing is cancelled
    assert [(stage["passes_dropped"], stage["passes_stopped"]) for stage in report["stages"]] == [(0, 0), (0, 0)]
    # where it computed: this build's backend (the CPU), as each stage's llama.cpp found it
    assert report["backend"] == "cpu"
    assert [(stage["backend"], stage["offloaded_layers"], stage["offloadable_layers"]) for stage in report["stages"]] \
        == [("cpu", 0, 13), ("cpu", 0, 19)]
    assert all(stage["devices"] and stage["devices"][0].startswith("CPU") for stage in report["stages"])


def test_temperature_and_seed_change_the_text_and_the_same_seed_reproduces_it(smollm2, splits, reference,
                                                                              orchestrate_on_cluster):
    """At temperature 1.5 sixteen tokens drawn with seed 5 are the same from
    the whole model as one stage (a local run: on the cluster's three nodes
    one --model-split file is cut in three) and through two stages (on the
    cluster), and differ from seed 6's and from greedy decoding's:
    --temperature and --seed both reach the sampler (greedy with them ignored
    would give the same text every time)."""
    common = ["--raw", "--prompt", PROMPTS[2], "--max-tokens", "16", "--json", "--temperature", "1.5"]
    whole = orchestrate("run", "--model-split", smollm2, *common, "--seed", "5")
    runs = [whole] + [orchestrate_on_cluster("run", "--model-split", *splits[2], *common, "--seed", seed)
                      for seed in ("5", "6")]
    assert all(result.returncode == 0 for result in runs), [result.stderr for result in runs]
    first, again, other_seed = (json.loads(result.stdout)["tokens"] for result in runs)
    greedy = reference.greedy(reference.tokenize(PROMPTS[2]), 16).tokens
    assert first == again
    assert first != other_seed
    assert first != greedy and other_seed != greedy
    assert [stage["layers"] for stage in json.loads(whole.stdout)["stages"]] == [[0, 30]]
    assert [stage["layers"] for stage in json.loads(runs[1].stdout)["stages"]] == [[0, 15], [15, 30]]


def test_run_with_token_trees_gives_the_whole_models_tokens(reference, orchestrate_on_cluster):
    prompt = "the cat sat on the mat. the cat ate the fish. the cat sat on the mat. the cat ate the"
    result = orchestrate_on_cluster("run", "--raw", "--prompt", prompt, "--max-tokens", "24", "--speculator", "ngram",
                         "--tree-leaves", "4", "--schedule", "sync", "--json")
    assert result.returncode == 0, result.stderr
    output = json.loads(result.stdout)
    assert output["tokens"] == reference.greedy(reference.tokenize(prompt), 24).tokens
    # how many trees pay is the rule's choice at this machine's measured batch cost; the run reports them
    assert {"tree_passes", "tree_side_rows", "tree_side_accepted", "refed_tokens"} <= output.keys()
    assert output["committed_tokens_per_pass"] >= 1.0


def test_a_question_is_answered_in_the_chat_template_by_default_and_a_run_without_a_token_says_why(
        orchestrate_on_cluster):
    """The default model has a chat template: a question is answered through
    it (a run that starts its own Ray, as a user's first does), streamed with
    a summary; as raw text (--raw, on the session's cluster) the model ends
    at once, and the run says so instead of printing nothing."""
    result = orchestrate("run", "--prompt", "Why is the sky blue?", "--max-tokens", "32")
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.split()) >= 10
    summary = result.stderr.strip().splitlines()[-1]
    assert "32 tokens" in summary and "tokens/s" in summary and "2 stages" in summary
    raw = orchestrate_on_cluster("run", "--raw", "--prompt", "Why is the sky blue?", "--max-tokens", "32")
    assert raw.returncode == 0, raw.stderr
    assert raw.stderr.strip().splitlines()[-1] == ("no token was generated: the model's first token ended its "
                                                   "text (drop --raw to use its chat template)")


def test_run_with_speculation_under_an_emulated_curve_reports_its_figures_and_lasts_the_curve(
        splits, reference, orchestrate_on_cluster, tmp_path):
    """Under a flat emulated curve (--cost-curve, a curve file: 40 ms a pass
    whatever its width), where drafts pay on any CPU (on an AVX2 host slower
    than usual, 2026-12-04, this CPU's own cost had the policy draft nothing,
    and the passes were the plain run's): prompt lookup in async through 2
    stages gives the whole model's tokens, the report names the curve, and
    every pass each stage ran lasted it."""
    from stages.tokenizer import Tokenizer

    curve = tmp_path / "flat.json"
    curve.write_text(json.dumps({"name": "flat 40 ms", "stages": [{"tokens": [1], "ms": [40]}]}))
    prompt = "Repeat exactly: one two three four five six seven eight."
    common = ["run", "--model-split", *splits[2], "--prompt", prompt, "--chat", "--max-tokens", "24", "--json",
              "--cost-curve", str(curve)]
    plain = orchestrate_on_cluster(*common)
    speculative = orchestrate_on_cluster(*common, "--speculator", "ngram", "--schedule", "async", "--draft-max", "6")
    assert plain.returncode == 0 and speculative.returncode == 0, speculative.stderr
    plain, speculative = json.loads(plain.stdout), json.loads(speculative.stdout)
    chat_tokens = Tokenizer(splits[2][0]).chat_tokens([{"role": "user", "content": prompt}])
    assert speculative["tokens"] == plain["tokens"] == reference.greedy(chat_tokens, 24).tokens
    assert speculative["cost_curve"] == "flat 40 ms"
    for stage in speculative["stages"]:  # passes dropped unread never ran; stopped ones were cut short
        completed = speculative["target_passes"] - stage["passes_dropped"] - stage["passes_stopped"]
        assert stage["busy_seconds"] >= 0.040 * completed
    assert speculative["target_passes"] < plain["target_passes"]
    assert speculative["accepted_tokens"] > 0 and 0 < speculative["acceptance_rate"] <= 1
    histogram = speculative["accepted_length_histogram"]
    verified = sum(int(length) * count for length, count in histogram.items())
    # every generated token after the first was verified by a pass (the last pass may also
    # verify the end token and tokens past it)
    assert len(speculative["tokens"]) - 1 <= verified <= len(speculative["tokens"]) - 1 + 7
    # every pass the target ran was verified or (started ahead on a failed speculation) discarded
    verified_passes = sum(speculative["target_input_length_histogram"].values())
    assert verified_passes + speculative["target_passes_discarded"] == speculative["target_passes"]
    assert speculative["draft_tokens_wasted"] >= 0
    assert [entry["index"] for entry in speculative["speculators"]] == [0, 1]
    assert all(entry["lost"] == "" for entry in speculative["speculators"])


def test_a_draft_model_on_the_cpu_with_its_own_threads_beside_every_stage_keeps_the_whole_models_tokens(
        splits, reference, realistic_draft, orchestrate_on_cluster):
    """--draft-device cpu --draft-threads 1 (the seed's setup: the draft on the CPU cores beside
    a stage), a drafter beside each of 2 stages; each says where it computed (--json)."""
    prompt = PROMPTS[1]
    result = orchestrate_on_cluster("run", "--model-split", *splits[2], "--raw", "--prompt", prompt, "--max-tokens", "24",
                                    "--json", "--speculator", "model", "--draft", realistic_draft,
                                    "--draft-device", "cpu", "--draft-threads", "1", "--threads", "2")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["tokens"] == reference.greedy(reference.tokenize(prompt), 24).tokens
    assert report["accepted_tokens"] > 0  # the first window always drafts (the policy's probe), and this one is right
    computes = [entry["compute"] for entry in report["speculators"]]
    assert len(computes) == 2 and all(entry["lost"] == "" for entry in report["speculators"])
    assert all(compute["threads"] == 1 and compute["offloaded_layers"] == 0 for compute in computes), computes


def test_a_cost_curve_of_another_number_of_stages_is_refused(splits, orchestrate_on_cluster):
    three = orchestrate_on_cluster("run", "--model-split", *splits[3], "--max-tokens", "2", "--cost-curve",
                                   f"{SETUPS / 'llama-405b-two-machines.toml'}@40")
    assert three.returncode == 1 and three.stderr.strip().splitlines() == [
        "error: the cost curve 'llama-405b-two-machines at 40 ms' has 2 stages, the pipeline 3"]


def test_a_model_that_fits_no_node_is_refused_with_the_numbers(smollm2, orchestrate_on_cluster):
    """A context whose KV cache cannot fit this machine's memory, split or not."""
    result = orchestrate_on_cluster("run", "--model", smollm2, "--stages", "2", "--n-ctx", str(1 << 24),
                                    "--max-tokens", "1")
    assert result.returncode == 1, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and "fits no split over " in line and " node(s)" in line
    assert "MiB in all" in line and "Traceback" not in result.stderr
