"""Structured output on the real model: a response_format's grammar (stages.grammar)
and tokens chosen and verified under it (speculators.grammar).

Plain decoding under a grammar gives JSON that parses and matches its schema;
verifying drafts under the grammar commits exactly what plain decoding commits,
greedy and sampled, chains and trees, whatever the drafts; the greedy fast path
is the masked row's argmax; a bad response_format is refused in one line that
names its part. The model is SmolLM2 through llama-cpp-python's Llama (logits
for every position), loaded once for the file."""

from __future__ import annotations

import json

import numpy as np
import pytest

import llama_cpp
from llama_cpp.llama_grammar import JSON_GBNF
from speculators.grammar import choose_constrained, masked_row, verify_constrained
from stages.errors import GrammarError
from speculators.model import common_prefix_length
from speculators.sampling import SamplingSettings, choose_token
from stages.grammar import GrammarConstraint, Vocabulary, grammar_of
from stages.settings import MAX_GRAMMAR_BYTES

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 2},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
PROMPT = ("<|im_start|>user\nDescribe Ada Lovelace as JSON: her name, her age at death and a few tags.<|im_end|>\n"
          "<|im_start|>assistant\n")
GREEDY = SamplingSettings()
SAMPLED = SamplingSettings(temperature=0.7, top_p=0.95, seed=5)
LIMIT = 80  # tokens; the model closes the object well before
DRAFTS = 6  # per verified pass
PROSE = 3  # unconstrained drafts


def schema_format(schema, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": strict}}


@pytest.fixture(scope="module")
def llama(smollm2):
    return llama_cpp.Llama(smollm2, n_ctx=512, verbose=False, logits_all=True)


@pytest.fixture(scope="module")
def vocabulary(llama):
    return Vocabulary.of_model(llama.model)


@pytest.fixture(scope="module")
def prompt(llama):
    return llama.tokenize(PROMPT.encode(), add_bos=False, special=True)


@pytest.fixture(scope="module")
def person(vocabulary):
    return GrammarConstraint(vocabulary, grammar_of(schema_format(PERSON)))


def plain(llama, prompt, constraint, sampling, vocabulary) -> list[int]:
    """Plain decoding under the grammar: one token a pass, from its row's grammar state."""
    llama.reset()
    llama.eval(prompt)
    generated: list[int] = []
    while len(generated) < LIMIT:
        with constraint.state_after(generated) as state:
            token = choose_constrained(llama.scores[llama.n_tokens - 1], len(prompt) + len(generated), sampling, state)
        generated.append(token)
        if vocabulary.is_end(token):
            break
        llama.eval([token])
    return generated


def feed(llama, tokens: list[int], keep_at_most: int) -> None:
    """Make the model's cache hold tokens: what it holds of them is kept (at
    most keep_at_most), the rest is fed in one batch."""
    keep = min(common_prefix_length(llama.input_ids[: llama.n_tokens].tolist(), tokens), keep_at_most)
    llama.n_tokens = keep
    llama.eval(tokens[keep:])


def pass_rows(llama, context: list[int], drafts: list[int]) -> np.ndarray:
    """A verification pass's logits: the last committed token and the drafts fed in one batch."""
    feed(llama, context + drafts, len(context) - 1)
    return llama.scores[len(context) - 1 : len(context) + len(drafts)].copy()


def unconstrained(llama, context: list[int], count: int) -> tuple[list[int], np.ndarray]:
    """The model's own greedy continuation without the grammar (drafts the grammar
    mostly refuses) and the logits of its pass (here one token at a time)."""
    feed(llama, context, len(context) - 1)
    drafts: list[int] = []
    for _ in range(count):
        drafts.append(int(np.argmax(llama.scores[llama.n_tokens - 1])))
        llama.eval([drafts[-1]])
    return drafts, llama.scores[len(context) - 1 : len(context) + count].copy()


@pytest.fixture(scope="module")
def decoded(llama, prompt, person, vocabulary):
    """Plain decoding's tokens under the person grammar, greedy and sampled."""
    return {sampling: plain(llama, prompt, person, sampling, vocabulary) for sampling in (GREEDY, SAMPLED)}


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_decoding_under_a_schema_gives_json_that_matches_it(llama, vocabulary, decoded, sampling):
    tokens = decoded[sampling]
    assert vocabulary.is_end(tokens[-1]) and not any(map(vocabulary.is_end, tokens[:-1]))  # the grammar completed
    value = json.loads(llama.detokenize(tokens[:-1]).decode())
    assert set(value) <= {"name", "age", "tags"} and {"name", "age"} <= set(value)
    assert isinstance(value["name"], str) and len(value["name"]) <= 20
    assert isinstance(value["age"], int) and not isinstance(value["age"], bool)
    tags = value.get("tags", [])
    assert isinstance(tags, list) and len(tags) <= 2 and all(isinstance(tag, str) and len(tag) <= 12 for tag in tags)


@pytest.mark.parametrize("sampling, step", [(GREEDY, 6), (SAMPLED, 10)], ids=["greedy", "sampled"])
def test_verifying_drafts_under_the_grammar_commits_what_plain_decoding_commits(llama, prompt, person, decoded,
                                                                                sampling, step):
    """At cuts along plain decoding's output: drafts that are its own continuation
    are all accepted, the model's unconstrained continuation (prose the grammar
    forbids) is cut short, a tree of both commits the same; the committed
    tokens are always plain decoding's next ones."""
    expected = decoded[sampling]
    refused = 0
    for cut in range(0, len(expected) - 1, step):  # sampled rows are all masked (about 30 ms each): fewer
        context = prompt + expected[:cut]
        with person.state_after(expected[:cut]) as state:
            own = expected[cut : min(cut + DRAFTS, len(expected) - 1)]  # never past the end token
            own_rows = pass_rows(llama, context, own)
            committed = verify_constrained(own, None, own_rows, len(context), sampling, state)
            assert committed == expected[cut : cut + len(own) + 1], cut
            prose, prose_rows = unconstrained(llama, context, PROSE)
            committed = verify_constrained(prose, None, prose_rows, len(context), sampling, state)
            assert committed == expected[cut : cut + len(committed)], cut
            refused += len(committed) <= len(prose)
            tree = [*prose, *own]
            parents = [-1, *range(len(prose)), 0, *range(len(prose) + 1, len(tree))]
            rows = np.vstack([prose_rows, own_rows[1:]])
            committed = verify_constrained(tree, parents, rows, len(context), sampling, state)
            assert committed == expected[cut : cut + len(committed)], cut
            if prose[0] != expected[cut]:  # the walk takes the own branch
                assert committed == expected[cut : cut + len(own) + 1], cut
    assert refused > 0  # some unconstrained drafts were cut short by the grammar


def test_the_greedy_fast_path_is_the_masked_rows_argmax(llama, prompt, person, decoded, vocabulary):
    """Rows of plain decoding, each under its own grammar state (mostly the fast
    path: the model's argmax is allowed), and random rows (their argmax mostly
    forbidden): choose_constrained gives the masked row's argmax."""
    tokens = decoded[GREEDY]
    feed(llama, prompt + tokens[:-1], 0)
    rows = llama.scores[len(prompt) - 1 : len(prompt) + len(tokens) - 1].copy()
    noise = np.random.default_rng(1).standard_normal((4, vocabulary.n_vocab)).astype(np.float32)
    pairs = [(rows[depth], [depth]) for depth in range(0, len(tokens), 2)]
    pairs += [(row, range(0, len(tokens), 16)) for row in noise]
    paths = {"fast": 0, "masked": 0}
    for row, depths in pairs:
        for depth in depths:
            with person.state_after(tokens[:depth]) as state:
                assert choose_constrained(row, 0, GREEDY, state) == int(np.argmax(masked_row(row, state)))
                paths["fast" if state.allows(int(np.argmax(row))) else "masked"] += 1
    assert paths["fast"] > 10 and paths["masked"] > 5, paths
    with person.state_after(tokens[:5]) as state:
        for position, row in enumerate(rows[:6]):
            assert choose_constrained(row, position, SAMPLED, state) == choose_token(state.mask(row), position, SAMPLED)


def test_mask_and_allows_agree_and_mask_only_lowers(person, vocabulary, decoded):
    row = np.random.default_rng(2).standard_normal(vocabulary.n_vocab).astype(np.float32)
    with person.state_after(decoded[GREEDY][:3]) as state:
        masked = state.mask(row)
        allowed = np.isfinite(masked)
        assert masked.dtype == np.float32 and np.array_equal(masked[allowed], row[allowed])
        assert 0 < allowed.sum() < vocabulary.n_vocab
        sample = np.random.default_rng(3).choice(vocabulary.n_vocab, 400, replace=False)
        assert [state.allows(int(token)) for token in sample] == list(allowed[sample])
    assert np.isfinite(row).all()  # the caller's row is untouched


def test_a_complete_grammar_allows_only_the_end_tokens(llama, vocabulary):
    constraint = GrammarConstraint(vocabulary, 'root ::= "yes"')
    ends = {token for token in range(vocabulary.n_vocab) if vocabulary.is_end(token)}
    row = np.zeros(vocabulary.n_vocab, dtype=np.float32)
    with constraint.state_after([]) as start:
        assert not any(start.allows(token) for token in ends)
    with constraint.state_after(llama.tokenize(b"yes", add_bos=False)) as done:
        assert set(np.flatnonzero(np.isfinite(done.mask(row))).tolist()) == ends


def test_a_forbidden_token_is_refused_not_accepted(llama, person):
    """llama.cpp ends the process when its sampler accepts a forbidden token or
    meets one outside the vocabulary: the state refuses first; a freed one refuses all."""
    comma = llama.tokenize(b",", add_bos=False)[0]
    row = np.random.default_rng(4).standard_normal(person.vocabulary.n_vocab).astype(np.float32)
    with person.state_after([]) as state:
        before = state.mask(row)
        with pytest.raises(GrammarError, match=f"token {comma} is not allowed"):
            state.after(comma)
        assert np.array_equal(state.mask(row), before)
    with pytest.raises(GrammarError):
        person.state_after([comma])
    state = person.state_after([])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        state.allows(person.vocabulary.n_vocab)
    state.free()
    with pytest.raises(ValueError, match="freed"):
        state.mask(row)


def test_states_after_extended_or_other_tokens_equal_fresh_ones(vocabulary, decoded):
    """The constraint's cached state: extending the last tokens, going back, or
    switching to other tokens gives the state a fresh constraint gives."""
    grammar = grammar_of(schema_format(PERSON))
    cached, tokens = GrammarConstraint(vocabulary, grammar), decoded[GREEDY]
    row = np.random.default_rng(5).standard_normal(vocabulary.n_vocab).astype(np.float32)
    for length in (4, 9, 10, 3, 12):
        with cached.state_after(tokens[:length]) as state, GrammarConstraint(vocabulary, grammar).state_after(
                tokens[:length]) as fresh:
            assert np.array_equal(state.mask(row), fresh.mask(row)), length


def test_a_vocabulary_read_from_the_file_alone_is_the_models(smollm2, vocabulary, decoded):
    read = Vocabulary.load(smollm2)
    assert read.n_vocab == vocabulary.n_vocab
    grammar = grammar_of(schema_format(PERSON))
    row = np.random.default_rng(6).standard_normal(read.n_vocab).astype(np.float32)
    with GrammarConstraint(read, grammar).state_after(decoded[GREEDY][:7]) as state, \
            GrammarConstraint(vocabulary, grammar).state_after(decoded[GREEDY][:7]) as model_state:
        assert np.array_equal(state.mask(row), model_state.mask(row))


def test_strings_admit_no_raw_control_character(llama, vocabulary):
    """The converter's string rule admits a raw newline, which no JSON parser takes: replaced."""
    quote, newline, letter = (llama.tokenize(text, add_bos=False)[0] for text in (b'"', b"\n", b"a"))
    for response_format in (schema_format({"type": "string"}), schema_format({"type": "string", "maxLength": 5}),
                            schema_format({"type": "string", "pattern": "^a.b$"}), {"type": "json_object"}):
        constraint = GrammarConstraint(vocabulary, grammar_of(response_format))
        opening = [quote] if response_format["type"] == "json_schema" else llama.tokenize(b'{"', add_bos=False)
        with constraint.state_after(opening) as inside:
            assert inside.allows(letter) and not inside.allows(newline), response_format


def test_text_json_object_and_loose_schemas_give_grammars():
    assert grammar_of({"type": "text"}) is None
    assert grammar_of({"type": "json_object"}) == JSON_GBNF
    assert "root ::=" in grammar_of(schema_format({"type": "integer", "minimum": 0}, strict=False))  # not enforced
    referring = {"$defs": {"tag": {"type": "string"}}, "type": "object",
                 "properties": {"tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}}}}
    assert "tags-kv ::=" in grammar_of(schema_format(referring))


@pytest.mark.parametrize("response_format, message", [
    ([], "response_format: must be an object, not a list"),
    ({"type": "xml"}, 'response_format.type: unsupported "xml" (text, json_object or json_schema)'),
    ({"type": "json_object", "schema": {}}, "response_format.schema: unknown field"),
    ({"type": "json_schema"}, "response_format.json_schema: must be an object, not null"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name: required"),
    (schema_format(PERSON, strict="yes"), "response_format.json_schema.strict: must be true or false, not a string"),
    (schema_format({"type": "object", "properties": {"age": {"type": "foo"}}}),
     'response_format.json_schema.schema.properties.age.type: unsupported type "foo"'),
    (schema_format({"type": "object", "properties": {"age": 5}}),
     "response_format.json_schema.schema.properties.age: a schema must be an object, not a number"),
    (schema_format({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]}),
     'response_format.json_schema.schema.required[0]: "b" is not among the properties'),
    # the converter's refusals, each named where it is
    (schema_format({"type": "array", "items": {"$ref": "https://example.com/tag.json"}}),
     'response_format.json_schema.schema.items.$ref: unsupported reference "https://example.com/tag.json"'),
    (schema_format({"anyOf": [{"$ref": "#/$defs/missing"}]}),
     'response_format.json_schema.schema.anyOf[0].$ref: "#/$defs/missing" refers to nothing in this schema'),
    (schema_format({"type": "object", "properties": {"zip": {"type": "string", "pattern": "[0-9]{5}"}}}),
     "response_format.json_schema.schema.properties.zip.pattern: the grammar converter needs a string anchored "
     'with ^ and $, not "[0-9]{5}"'),
    (schema_format({"type": "string", "pattern": "^(?:ab)+$"}),
     "response_format.json_schema.schema.pattern: the grammar converter cannot translate it: Unsupported pattern "
     'syntax "?"'),
    (schema_format({"type": "string", "pattern": "^\\d+$"}),
     "response_format.json_schema.schema.pattern: the grammar converter cannot translate it (it keeps escapes"),
    (schema_format({"type": "array", "items": {}}),
     "response_format.json_schema.schema.items: the grammar converter fails on an empty schema here"),
    # what the grammar cannot enforce, under strict
    (schema_format({"type": "object", "properties": {"age": {"type": "integer", "minimum": 0}}}),
     "response_format.json_schema.schema.properties.age.minimum: the grammar cannot enforce it"),
    (schema_format({"type": "string", "format": "email"}),
     'response_format.json_schema.schema.format: the grammar cannot enforce "email"'),
])
def test_a_wrong_response_format_is_refused_in_one_line_naming_its_part(response_format, message):
    with pytest.raises(GrammarError) as refused:
        grammar_of(response_format)
    text = str(refused.value)
    assert text.startswith(message) and "\n" not in text, text


def test_a_grammar_over_the_size_limit_is_refused():
    wide = {"type": "object", "properties": {f"field{index}": {"enum": [f"{'x' * 40}{value}" for value in range(40)]}
                                             for index in range(50)}}
    with pytest.raises(GrammarError, match=rf"^response_format\.json_schema\.schema: its grammar is \d+ bytes, "
                                           rf"over the limit of {MAX_GRAMMAR_BYTES}$"):
        grammar_of(schema_format(wide))
