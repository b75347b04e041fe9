"""A real pipeline's last stage choosing exactly the tokens that verifying its logits here gives."""

import numpy as np
import pytest

from speculators.sampling import SamplingSettings
from speculators.verify import verify


@pytest.mark.parametrize("sampling", [SamplingSettings(), SamplingSettings(temperature=0.9, top_p=0.95, seed=11)])
def test_the_last_stage_chooses_what_verifying_its_logits_here_gives(ray_cluster, splits, sampling):
    from orchestrator.cluster.pipeline import Pipeline
    from orchestrator.decoding.windows import TargetPass, Window
    from stages.tokenizer import Tokenizer
    from stages.settings import StageSettings

    tokens = Tokenizer(splits[2][0]).tokenize("The capital of France is Paris. The capital of Italy is")
    with Pipeline(splits[2], StageSettings(n_ctx=128)) as pipeline:
        rows = np.arange(len(tokens), dtype=np.int32)
        logits = pipeline.forward(np.arange(len(tokens), dtype=np.int32), np.asarray(tokens, np.int32), 0, rows).logits
        # every input after the first is a "draft": the pass verifies the sentence itself
        expected = verify(tokens[1:], logits, 1, sampling)
        pipeline.submit(TargetPass((Window(0, 0, tuple(tokens), sampling=sampling),)))
        reply = pipeline.receive()
    assert reply.logits is None  # only the ids came back
    assert reply.tokens.tolist() == expected
    assert 1 <= len(expected) < len(tokens)
