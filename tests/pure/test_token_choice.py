"""Tokens chosen beside the last stage: the records on the wire and the checks on a result (a real pipeline
choosing exactly what verifying its logits gives: tests/ray/test_last_stage_choice.py)."""

import numpy as np
import pytest

from orchestrator.transport.chain import result_problem
from orchestrator.transport.fields import ProtocolError
from orchestrator.transport.messages import PassResult, StageBatch, TokenChoice
from orchestrator.transport.ledger import PassRecord
from speculators.sampling import SamplingSettings

SAMPLING = SamplingSettings(temperature=0.7, top_p=0.9, seed=2**63 + 5)


def _round_trip(message):
    header, array = message.to_wire()
    return type(message).from_wire(header, array)


def _batch(choice, rows=3):
    return StageBatch(pass_id=4, keep=2, positions=np.arange(2, 5, dtype=np.int32),
                      logit_rows=np.arange(rows, dtype=np.int32), hidden=np.ones((3, 8), np.float32), choice=choice)


def test_a_choice_and_chosen_tokens_cross_the_wire_unchanged():
    choice = TokenChoice(np.array([7, 9], np.int32), 3, SAMPLING)
    back = _round_trip(_batch(choice))
    assert back.choice.drafts.tolist() == [7, 9] and back.choice.first_position == 3
    assert back.choice.sampling == SAMPLING
    assert _round_trip(_batch(None)).choice is None
    result = _round_trip(PassResult(4, None, (0.5, 0.25), tokens=np.array([7, 1], np.int32)))
    assert result.logits is None and result.tokens.tolist() == [7, 1] and result.stage_seconds == (0.5, 0.25)


@pytest.mark.parametrize("field, value, message", [
    ("drafts", np.array([7], np.int32).tobytes(), "1 drafts for 3 logit rows"),
    ("top_p", 0.0, "top_p"),
    ("temperature", -1.0, "temperature"),
    ("seed", 2**64, "seed"),
    ("first", -1, "first"),
])
def test_a_bad_choice_is_refused_naming_its_field(field, value, message):
    header, array = _batch(TokenChoice(np.array([7, 9], np.int32), 3, SAMPLING)).to_wire()
    header["choice"][field] = value
    with pytest.raises(ProtocolError, match=message):
        StageBatch.from_wire(header, array)


def test_a_result_carries_exactly_one_of_logits_and_tokens():
    header, _ = PassResult(1, None, (0.0,), tokens=np.array([3], np.int32)).to_wire()
    with pytest.raises(ProtocolError, match="exactly one"):
        PassResult.from_wire(header, np.zeros((1, 4), np.float32))
    header["tokens"] = None
    with pytest.raises(ProtocolError, match="exactly one"):
        PassResult.from_wire(header, None)


def _record(drafts):
    rows = len(drafts) + 1
    return PassRecord(0, 5, np.arange(5, 5 + rows, dtype=np.int32), np.arange(rows, dtype=np.int32),
                      np.arange(rows, dtype=np.int32), TokenChoice(np.array(drafts, np.int32), 6, SamplingSettings()))


@pytest.mark.parametrize("tokens, problem", [
    ([11, 12, 4], ""),  # both drafts accepted, then the target's own token
    ([11, 4], ""),  # the second draft rejected
    ([5], ""),
    ([], "0 tokens"),
    ([11, 12, 4, 4], "4 tokens"),  # more than the rows
    ([11, 100], "ids below 100"),
    ([12, 4], "do not begin with the accepted drafts"),
])
def test_chosen_tokens_are_checked_before_use(tokens, problem):
    reply = PassResult(1, None, (0.0, 0.0), tokens=np.array(tokens, np.int32))
    found = result_problem(_record([11, 12]), reply, n_vocab=100, stage_count=2)
    assert (problem in found and found) if problem else found == ""


def test_logits_where_tokens_were_asked_and_the_reverse_are_refused():
    logits = PassResult(1, np.zeros((3, 100), np.float32), (0.0, 0.0))
    assert "expected the tokens" in result_problem(_record([11, 12]), logits, 100, 2)
    plain = PassRecord(0, 5, np.arange(3, dtype=np.int32), np.arange(3, dtype=np.int32), np.arange(3, dtype=np.int32))
    assert result_problem(plain, logits, 100, 2) == ""
    assert "expected logits" in result_problem(plain, PassResult(1, None, (0.0, 0.0), tokens=np.array([1], np.int32)),
                                               100, 2)
    assert "stage times" in result_problem(plain, logits, 100, 3)
