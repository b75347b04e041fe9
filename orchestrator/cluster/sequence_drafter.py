"""One request's view of a drafter actor that a service's requests share
(orchestrator.cluster.drafters.DrafterClient): the loop's Drafter for it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from speculators.corrections import Corrections, Forks
from speculators.sampling import SamplingSettings
from speculators.tree import DraftTree, TreeAsk

if TYPE_CHECKING:
    from orchestrator.cluster.drafters import DrafterClient


class SequenceDrafter:
    """One request's view of a drafter shared by a service's requests: its
    speculate and collect name the request's KV sequence (the loop's Drafter)."""

    def __init__(self, client: DrafterClient, sequence: int):
        self.client = client
        self.sequence = sequence

    def speculate(self, context: list[int], most: int | None = None, sampling: SamplingSettings | None = None,
                  tree: TreeAsk | None = None, forks: Forks | None = None) -> None:
        self.client.speculate(context, most, self.sequence, sampling=sampling, tree=tree, forks=forks)

    def corrections(self) -> Corrections:
        return self.client.corrections(self.sequence)

    def collect_tree(self, leaves: int) -> DraftTree:
        return self.client.collect_tree(leaves, self.sequence)

    def ask(self) -> None:
        self.client.ask(self.sequence)

    def collect(self, wait: bool = False) -> list[int]:
        return self.client.collect(wait, self.sequence)

    def peek(self) -> list[int]:
        return self.client.peek(self.sequence)
