"""How a sequence makes its windows (orchestrator.decoding.schedule tells the
rules): the first window of a pass, the prompt's chunks, a window started
ahead, a branch window, the token tree a window carries and what its rows
cost, and what the drafters draft for it meanwhile (``forks``,
``tree_ask``). ``WindowMaking`` is a part of ``SequenceState`` and works on
its fields: a sequence's state and how a result changes it are in
schedule.py, the windows it sends next here."""

from __future__ import annotations

import functools

from orchestrator.config import BRANCHES_AHEAD_STEP
from orchestrator.decoding.branches import branch_tree, fed_agreement, follow
from orchestrator.decoding.windows import Window
from speculators.corrections import Forks
from speculators.draft_length import DRAFT_STEP_TOKENS
from speculators.sampling import SamplingSettings
from speculators.tree import (MAX_TREE_ROWS, DraftTree, PassCost, TreeAsk, choose_rows, curve_cost, linear_cost,
                              offered_rows)


class WindowMaking:
    """The windows of a SequenceState (its fields: schedule.py)."""

    @property
    def forks(self) -> Forks | None:
        """Where corrections may be drafted while the head window is verified
        (speculators.corrections): at its drafts, within the rounds its pass
        lasts (its cost on the policy's line, in awaited draft steps: 0 where
        the draft's price is not measured); None unless the head window is a
        chain of drafts starting at the last committed token."""
        head = self.in_flight[0] if self.in_flight else None
        if head is not None and not head.prompt and self.branching:  # the speculation's tokens the head verifies
            drafts = len(follow(head, self.text[head.first + head.refed + 1:])) - (len(self.committed) - 1
                                                                                 - head.first - head.refed)
        elif (head is None or head.prompt or head.parents is not None or head.refed
                or head.first != len(self.committed) - 1 or not head.main_drafts):
            return None
        else:
            drafts = len(head.main_drafts)
        if drafts < 1:
            return None
        price = self.draft_prices.awaited
        rounds = self.policy.cost(drafts, awaited=False) / price if price > 0 else 0.0
        return Forks(len(self.committed), drafts, rounds)

    def _prompt_window(self) -> Window:
        """The prompt's next chunk."""
        end = min(self.prompt_from + self.prompt_chunk, self.prompt_length) if self.prompt_chunk else None
        last = end is None or end >= self.prompt_length  # only the last chunk gives a token: the others choose none
        window = Window(self.sequence, self.prompt_from, tuple(self.committed[self.prompt_from:end]), prompt=True,
                        sampling=self.sampling, logprobs=self.logprobs if last else None,
                        **(self._constrained(self.prompt_length) if last else {}))
        self.prompt_from = end if end is not None and end < self.prompt_length else None
        return window

    def first_window(self, shared: int | None = None) -> Window:
        """The window of its next pass (it must be ``ready``); shared: exactly
        this many drafts (Scheduler.shared_drafts): its speculation's, then
        filler (Window.filler); None: as its policy says."""
        if self.prompt_from is not None:
            window = self._prompt_window()
        else:
            shared = shared if self.tree_leaves == 1 else None  # a tree goes in a pass of its own
            limit = self.drafts_wanted if self.schedule.speculative else 0
            limit = limit if shared is None else min(shared, max(self.room, 0))
            if self.branching:  # fed again from where the cells leave the text, no wider than a flat pass
                self.refeed = len(self.committed) - 1 - min(fed_agreement(self.fed, self.committed),
                                                            len(self.committed) - 1)
                limit = max(0, min(limit, self._flat_rows - 1 - self.refeed))
            first = len(self.committed) - 1 - self.refeed
            drafts = self.speculation.tokens[:limit]
            filler = 0 if shared is None else limit - len(drafts)
            tree = DraftTree.chain(self.committed[-1], drafts + [(drafts or self.committed)[-1]] * filler)
            candidates = self.speculation.take_candidates()
            if candidates is not None and limit > 0:
                tree = choose_rows(candidates, self.policy.acceptances(), self.speculation.ranks, self._row_cost(),
                                   forced=min(limit, len(self.speculation.tokens)))
            window = Window(self.sequence, first, (*self.committed[first:-1], *tree.tokens), sampling=self.sampling,
                            logprobs=self.logprobs, refed=self.refeed, **self._constrained(len(self.committed)),
                            parents=None if tree.is_chain else tuple(tree.parents),
                            ranks=None if tree.is_chain else tuple(tree.ranks), filler=filler)
        self._submit(window)
        return window

    def _submit(self, window: Window) -> None:
        """A window goes in flight: it drops the sequence's cells from its first position, leaves its main chain's."""
        self.in_flight.append(window)
        self.fed[window.first:] = window.inputs[:window.main_rows]

    @functools.cached_property
    def _flat_rows(self) -> int:
        """The widest pass known to cost about a one-token one: on the measured
        curve, the widest within BRANCHES_AHEAD_STEP of it a row; without one,
        the width the step was measured at (a curve flat that far may grow
        beyond). Read once: the curve is measured before the run."""
        if self.pass_curve is None:
            return DRAFT_STEP_TOKENS + 1
        one = self.pass_curve.at(1)
        flat = [rows for rows in range(2, MAX_TREE_ROWS + 1)
                if self.pass_curve.at(rows) <= one * (1 + BRANCHES_AHEAD_STEP * (rows - 1))]
        return max([DRAFT_STEP_TOKENS + 1, *flat])

    def _row_cost(self) -> PassCost:
        """What the tree rule prices a pass of n rows at: side_row_step if
        set (the bench's tree-all mode), else the measured curve at every
        width, else the policy's line through two widths."""
        if self.side_row_step is not None:
            return linear_cost(self.side_row_step)
        if self.pass_curve is not None:
            return curve_cost(self.pass_curve, self.refeed)
        return linear_cost(self.policy.step)

    @property
    def draft_sampling(self) -> SamplingSettings | None:
        """What its drafters sample with: its own sampling when coupled and
        not greedy (speculators.model_tree), else None (their top choices)."""
        return self.sampling if self.coupled and self.sampling is not None and not self.sampling.greedy else None

    @property
    def tree_ask(self) -> TreeAsk | None:
        """The tree its drafter grows before its next window: as many rows as
        a pass twice a one-token one's can verify on its curve, each row's
        growth priced as an awaited draft token (speculators.tree.offered_rows),
        within one batch beside the tokens fed again; tree_leaves leaves (no
        more than its rows); the draft policy's acceptance along a chain, mean
        over its positions. None: a chain, also where side rows do not pay
        for their growth (_side_rows_pay)."""
        if self.tree_leaves == 1:
            return None
        cost, grow = self._row_cost(), self.draft_prices.awaited
        acceptances = self.policy.acceptances()
        if self.side_row_step is None and not self._side_rows_pay(acceptances, grow):
            return None
        rows = offered_rows(lambda rows: cost(rows) + grow * rows, max(1, self.drafts_wanted),
                            MAX_TREE_ROWS - self.refeed)
        return TreeAsk(rows, min(self.tree_leaves, rows), sum(acceptances) / len(acceptances))

    def _side_rows_pay(self, acceptances: list[float], grow: float) -> bool:
        """Whether a tree's best side row (the root's second choice, taken
        when the target declines the first: its rank's measured share) brings
        more tokens than its growth costs while the pass waits for it: grow
        passes at the tokens a pass of the chain is expected to commit."""
        best_side = (1.0 - acceptances[0]) * self.speculation.ranks.share(2)
        return best_side > grow * self.policy.expected_committed(max(1, self.drafts_wanted))

    def windows_ahead(self, speculative: bool = True) -> list[Window]:
        """Windows to start while one of it is in flight: the prompt's next
        chunks, up to prompt_depth in flight; or (speculative) the next window of the speculation."""
        if self.prompt_from is None:
            window = self.window_ahead() if speculative else None
            return [] if window is None else [window]
        chunks = []
        while self.prompt_from is not None and self.in_flight and len(self.in_flight) < self.prompt_depth \
                and not self.finished:
            chunks.append(self._prompt_window())
            self._submit(chunks[-1])
        return chunks

    def window_ahead(self) -> Window | None:
        """The next window of the speculation, started while one is in flight,
        or None. Only after a window that accepted all its drafts (accepted_whole):
        the window in flight is then the only one, valid, and drafted on by
        the drafter during the last pass; after a rejection the speculation
        is gone and its next window waits for the drafter. A branching
        sequence's is a branch window instead (branch_window)."""
        if self.branching:
            return self.branch_window()
        if not (self.schedule.asynchronous and self.accepted_whole and len(self.in_flight) == 1
                and not self.finished):
            return None
        head = self.in_flight[0]
        first = head.first + head.main_rows
        ahead = first - (len(self.committed) - 1)  # tokens the head must commit first
        limit = min(self.draft_limit, self.room - ahead)
        text = self.text
        if len(text) <= first or limit < 0:
            return None
        window = Window(self.sequence, first, tuple(text[first : first + 1 + limit]), sampling=self.sampling,
                        logprobs=self.logprobs, **self._constrained(first + 1))
        self._submit(window)
        return window

    def branch_window(self) -> Window | None:
        """A branch window (orchestrator.decoding.branches) while fewer than
        ``stages`` windows are in flight: rooted at the last committed token,
        its main chain the speculation up to the policy's draft_limit beyond
        what the windows in flight feed, no wider than a pass known to cost
        about a one-token one (_flat_rows, with the rows fed again), and,
        where the stages hold token trees (tree_leaves > 1), the corrections
        at its drafts as side branches that pay on the curve
        (speculators.tree.choose_rows). None
        while the speculation reaches no further than the windows in flight,
        and for a chain unless the last window accepted all its drafts (a
        chain is right only if the windows before it accept all theirs, and
        a wrong one costs the next window its cells: it feeds them again)."""
        if (self.finished or self.prompt_from is not None or not self.in_flight or len(self.in_flight) >= self.stages
                or any(window.prompt for window in self.in_flight)):
            return None
        covered = max(window.first + window.main_rows for window in self.in_flight)  # positions fed, and speculated
        first = min(fed_agreement(self.fed, self.committed), len(self.committed) - 1)
        refeed = len(self.committed) - 1 - first
        drafts = min(covered - len(self.committed) + self.draft_limit, len(self.speculation.tokens), self.room,
                     self._flat_rows - 1 - refeed)
        if len(self.committed) + drafts <= covered:
            return None
        self.refeed = refeed
        chain = self.speculation.tokens[:drafts]
        tree = DraftTree.chain(self.committed[-1], chain)
        if self.tree_leaves > 1 and self.speculation.corrections:
            cost, room = self._row_cost(), self._flat_rows - 1 - refeed  # side rows too within the flat pass

            def flat_cost(rows: int) -> float:
                return cost(rows) if rows <= room else float("inf")

            tree = choose_rows(branch_tree(self.committed[-1], chain, self.speculation.corrections,
                                           len(self.committed), self.tree_leaves - 1),
                               self.policy.acceptances(), self.speculation.ranks, flat_cost, forced=drafts)
        if tree.is_chain and not self.accepted_whole:  # a chain stays valid only if the windows before accept all
            return None
        window = Window(self.sequence, first, (*self.committed[first:-1], *tree.tokens), sampling=self.sampling,
                        refed=self.refeed, parents=None if tree.is_chain else tuple(tree.parents),
                        ranks=None if tree.is_chain else tuple(tree.ranks), **self._constrained(len(self.committed)))
        self._submit(window)
        return window

    def _constrained(self, through: int) -> dict:
        """A window's grammar fields: its grammar and the text generated before
        position ``through`` (row 0's input the last of it); none without a grammar."""
        if self.grammar is None:
            return {}
        return {"grammar": self.grammar, "generated": tuple(self.text[self.prompt_length:through])}
