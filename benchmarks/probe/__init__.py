"""The probes: focused measurements beside the suite (``orchestrate bench``),
each a mode of one harness, ``python -m benchmarks.probe MODE [options]``.
Every mode runs its variants side by side in one run (benchmarks.side_by_side:
the order rotating each repetition) and reports each figure's median and
range over the repetitions; ``--repetitions N`` and ``--json PATH`` are
common to all (benchmarks.probe.harness). The modes:

    where-time-goes  a plain pipeline's per-token time: whole model, stages in one process, actors unpinned and pinned
    restart-cost     the pause a killed stage costs, by the context held, beside its prefill
    sequence-batch   one pass of several sequences' tokens against a pass each
    transport-hop    one hop of the chain per transport: plain sockets, TLS, zmq, zmq CURVE
    serve-overhead   what Ray Serve's proxy and streaming cost per streamed token
    delayed-link     a pipeline across a link with delay against `orchestrate plan` (root: namespace hosts)
    prefill          time to the first token of a long prompt: its chunks pipelined through the stages, or not, or whole
    prefix-reuse     a prefix prefilled once: a chat's second turn, 8 requests sharing a system prompt, n = 4 choices
    drafter-host     a draft model on a host without a stage, beside the stages, or none (root: namespace hosts)
    draft-coupling   how often a draft's draw is the target's: top choice, cumulative sum, shared Gumbel noise, a tree
    across-rejections  async with windows ahead only after a fully accepted window, or also after rejections (emulated)
    lost-stage-node  serve loses a stage's machine under load, on a cluster with a CPU'd head and several-CPU workers
"""
