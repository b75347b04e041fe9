"""What each part of a pipeline costs, for the schedule simulation.

Two sources, one shape (``StageCosts``, a ``simulation.PipelineCosts``):

* a measured profile (``orchestrate profile``): each block's, the head's and a
  pass's fixed time for batches of 1..64 tokens on that machine, the hop's
  fixed cost and its bytes per second, the coordinator's time per pass, and
  the drafter's time per token;
* named hardware (``Machine``): a roofline. A stage of ``b`` blocks reads its
  weights once per pass and does 2 flops per weight per token, so a pass of n
  tokens takes max(weight bytes / bandwidth, 2 * weights * n / flops) plus a
  fixed overhead. Bandwidth and flops are what the machine really achieves:
  peak figures times an efficiency the user states.

Links carry activations (float32, n x width per pass) between stages and, from
the last stage back to the coordinator (on stage 0's machine), the tokens
chosen beside the last stage (orchestrator.transport.messages.TokenChoice): one int32
per row, not its logits. Pure Python; no Ray, no llama.cpp.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stages.cost_curve import BatchCurve, StageCurve

FLOAT_BYTES = 4
TOKEN_BYTES = 4  # a token id chosen beside the last stage, what travels back instead of a logits row


@dataclass(frozen=True)
class Link:
    """A network link: one-way latency (s) and bandwidth (bytes/s); software
    overhead per hop (serialising, sockets, the stage server) comes on top."""

    latency_seconds: float
    bytes_per_second: float

    def seconds(self, payload_bytes: int) -> float:
        return self.latency_seconds + payload_bytes / self.bytes_per_second


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs of a model. block_bytes and head_bytes: weights
    as stored (quantised); block_parameters: weights per block (for flops);
    kv_bytes_per_token: one block's KV cache for one position."""

    name: str
    blocks: int
    width: int
    vocab: int
    block_bytes: tuple[int, ...]
    head_bytes: int
    embedding_bytes: int
    block_parameters: int
    head_parameters: int
    kv_bytes_per_token: int

    def stage_bytes(self, first: int, end: int) -> int:
        """Weights of blocks [first, end), plus the embedding table on the first
        stage and the output head on the last."""
        total = sum(self.block_bytes[first:end])
        if first == 0:
            total += self.embedding_bytes
        if end == self.blocks:
            total += self.head_bytes
        return total

    @classmethod
    def from_parameters(cls, name: str, blocks: int, width: int, vocab: int, parameters: float,
                        bits_per_weight: float, kv_heads_width: int, kv_bytes_per_value: int = 2) -> ModelShape:
        """A transformer given by its size: ``parameters`` in all, of which the
        embedding table and the head are vocab x width each (untied), the rest
        evenly in blocks. kv_heads_width: key (= value) width per position."""
        table = vocab * width
        block_parameters = int((parameters - 2 * table) / blocks)
        if block_parameters <= 0:
            raise ValueError(f"{parameters:g} parameters cannot hold two {vocab} x {width} tables and {blocks} blocks")
        to_bytes = bits_per_weight / 8
        return cls(
            name=name, blocks=blocks, width=width, vocab=vocab,
            block_bytes=(int(block_parameters * to_bytes),) * blocks,
            head_bytes=int(table * to_bytes), embedding_bytes=int(table * to_bytes),
            block_parameters=block_parameters, head_parameters=table,
            kv_bytes_per_token=2 * kv_heads_width * kv_bytes_per_value,
        )


@dataclass(frozen=True)
class Machine:
    """A machine described by what it achieves: memory (bytes), memory bandwidth
    (bytes/s), compute (flops/s), a fixed overhead per pass (s)."""

    name: str
    memory_bytes: float
    bytes_per_second: float
    flops_per_second: float
    pass_overhead_seconds: float = 0.0

    def pass_seconds(self, weight_bytes: float, parameters: float, tokens: int) -> float:
        """A pass of ``tokens`` tokens over weights of that size (the roofline)."""
        return self.pass_overhead_seconds + max(
            weight_bytes / self.bytes_per_second, 2.0 * parameters * tokens / self.flops_per_second
        )

    def stage_seconds(self, model: ModelShape, first: int, end: int, tokens: int) -> float:
        parameters = (end - first) * model.block_parameters + (model.head_parameters if end == model.blocks else 0)
        return self.pass_seconds(model.stage_bytes(first, end), parameters, tokens)


@dataclass(frozen=True)
class MeasuredMachine:
    """A machine measured by ``orchestrate profile``: per-block, head and fixed
    per-pass time for batches of n tokens (``block + head + fixed`` is the last
    stage, ``blocks * block + fixed`` the others). memory_bytes: its RAM."""

    name: str
    memory_bytes: float
    block: BatchCurve
    head: BatchCurve
    fixed: BatchCurve

    def stage_seconds(self, model: ModelShape, first: int, end: int, tokens: int) -> float:
        seconds = self.fixed.at(tokens) + (end - first) * self.block.at(tokens)
        return seconds + (self.head.at(tokens) if end == model.blocks else 0.0)


@dataclass(frozen=True)
class CurveMachine:
    """A stage held to an emulated cost curve (stages.cost_curve), as
    ``--cost-curve`` holds the real stages: a pass takes the curve's time for
    its width, whatever blocks the stage holds, at ``context`` positions (the
    simulation does not follow the context). memory_bytes: of the machine it
    stands for."""

    name: str
    memory_bytes: float
    curve: StageCurve
    context: int = 0

    def stage_seconds(self, model: ModelShape, first: int, end: int, tokens: int) -> float:
        return self.curve.seconds(tokens, self.context)


@dataclass(frozen=True)
class Software:
    """Costs of this project's own code, measured by ``orchestrate profile``:
    hop_seconds per hop (serialising and the socket round of a small
    activation on one machine), coordinator seconds per pass (verifying one
    row) and per further logits row,
    the bytes per second of a socket within one machine, and the round trip of
    one request to a drafter (speculate, then collect)."""

    hop_seconds: float
    coordinator_pass_seconds: float
    coordinator_row_seconds: float
    local_bytes_per_second: float = 2e9
    draft_call_seconds: float = 0.0


@dataclass(frozen=True)
class StageCosts:
    """A pipeline of stages [starts[i], starts[i+1]) on machines[i], joined by
    links[i] (stage i to i+1; the last link carries the chosen tokens back to stage
    0's machine, where the coordinator runs). None for a link between stages on
    the same machine: only the software hop cost is paid."""

    model: ModelShape
    machines: Sequence[Machine | MeasuredMachine | CurveMachine]
    starts: tuple[int, ...]
    links: Sequence[Link | None]
    software: Software
    draft_seconds_per_token: Sequence[float]
    hosts: tuple[int, ...] | None = None  # stage i runs on host hosts[i]; None: each on its own
    host_parallel_stages: int | None = None  # stages one host computes at once (cores / threads); None: all

    @property
    def stage_count(self) -> int:
        return len(self.starts)

    def stage_range(self, stage: int) -> tuple[int, int]:
        end = self.starts[stage + 1] if stage + 1 < len(self.starts) else self.model.blocks
        return self.starts[stage], end

    def stage_seconds(self, stage: int, tokens: int) -> float:
        first, end = self.stage_range(stage)
        return self.machines[stage].stage_seconds(self.model, first, end, tokens)

    def hop_seconds(self, hop: int, tokens: int) -> float:
        if hop == 0:  # coordinator to stage 0: same machine, token ids only
            return self.software.hop_seconds
        link = self.links[hop - 1] if hop - 1 < len(self.links) else None
        row_bytes = TOKEN_BYTES if hop == self.stage_count else self.model.width * FLOAT_BYTES
        payload = tokens * row_bytes
        if link is not None:
            return self.software.hop_seconds + link.seconds(payload)
        # on one machine the measured hop time already carried one token's row
        return self.software.hop_seconds + (tokens - 1) * row_bytes / self.software.local_bytes_per_second

    def coordinator_seconds(self, tokens: int) -> float:
        # the measured time per pass already verified one row
        return self.software.coordinator_pass_seconds + (tokens - 1) * self.software.coordinator_row_seconds

    def draft_seconds(self, machine: int) -> float:
        return self.draft_seconds_per_token[machine]

    def draft_call_seconds(self) -> float:
        return self.software.draft_call_seconds

    def host(self, stage: int) -> int:
        return self.hosts[stage] if self.hosts is not None else stage

    def parallel_stages(self, host: int) -> int | None:
        return self.host_parallel_stages

    def memory_needed(self, stage: int, context: int, draft_bytes: int) -> int:
        """Weights, KV cache for ``context`` positions, and the draft model."""
        first, end = self.stage_range(stage)
        return self.model.stage_bytes(first, end) + (end - first) * context * self.model.kv_bytes_per_token + draft_bytes


def split_costs(stages: list[dict], whole: dict) -> dict[str, list[float]]:
    """Per batch size: a block's time, the head's, and a pass's fixed time.

    Non-last stage i: fixed + blocks_i * block; last: fixed + blocks * block +
    head; whole: fixed + all blocks * block + head. With k >= 2 stages the sum
    of the stages holds k fixed costs and the whole model one, which gives the
    fixed cost; the non-last stages then give the block, the last the head.
    Noise can push a derived time below zero; it is clamped at zero."""
    if len(stages) < 2:
        raise ValueError("profiling the costs of a split needs at least two stage files")
    sizes = len(whole["seconds"])
    fixed, block, head = [], [], []
    for column in range(sizes):
        stage_sum = sum(stage["seconds"][column] for stage in stages)
        fixed_time = max(0.0, (stage_sum - whole["seconds"][column]) / (len(stages) - 1))
        inner = stages[:-1]
        inner_blocks = sum(stage["end_block"] - stage["first_block"] for stage in inner)
        block_time = max(0.0, sum(stage["seconds"][column] - fixed_time for stage in inner) / inner_blocks)
        last = stages[-1]
        head_time = last["seconds"][column] - fixed_time - (last["end_block"] - last["first_block"]) * block_time
        fixed.append(fixed_time)
        block.append(block_time)
        head.append(max(0.0, head_time))
    return {"fixed_seconds": fixed, "block_seconds": block, "head_seconds": head}
