"""Hardware-aware speculation budget.

The best tree is a property of the hardware: on a GPU a 60-node verification costs about as much as one token, on a
CPU the cost grows with the number of nodes. This module

1. reads the machine's cost profile: the target's forward time ``t(n)`` for ``n`` tree nodes and the draft's step
   times, measured once and cached (`cost_profile`: [`CostProfile`], [`load_or_measure_profile`], re-exported here);
2. picks, every round, which of the drafted nodes to verify and how deep to draft ([`TreeBudget`]): the draft's
   cumulative probabilities, calibrated by the acceptance actually observed, give the expected accepted tokens of the
   best ``n - 1`` nodes no deeper than ``d``, and ``(d, n)`` maximises expected tokens per second (drafting time
   grows with ``d``, verification time with ``n``); the next round drafts one level deeper than the chosen ``d``.
   When no tree is predicted to beat plain decoding the call falls back to plain decoding;
3. replays recorded rounds under other shapes ([`simulate_shape`]) so ``poss tune`` can choose depth and size.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from .cost_profile import (DEFAULT_SIZES, CostProfile, cache_dir, load_or_measure_profile, measure_draft_seconds,
                           measure_verify_seconds, profile_key, usable_profile)


# ---------------------------------------------------------------------------------------------------- per round
def ranked_nodes(scores: torch.Tensor) -> torch.LongTensor:
    """Non-root node indices by descending cumulative score; ties keep node order (parents before children)."""
    return torch.sort(scores[1:], descending=True, stable=True).indices + 1


class TreeBudget:
    """Chooses, each round, how deep to draft and which drafted nodes to verify; decides when speculation does not pay.

    Args:
        profile: the machine's [`CostProfile`].
        depth: the deepest drafting depth allowed (the configured ``tree_depth``).
        max_nodes: upper bound on verified nodes (root included).
        warmup_rounds: rounds observed before a fallback to plain decoding may be decided.
        min_speedup: predicted speed-up under which speculation stops for the rest of the call.
        calibrate: correct the node probabilities by the observed acceptance (off when the scores are already
            calibrated estimates, as with context candidates: `hybrid.SourceEstimates`).
        allow_no_draft: depth 0 is a choice too (nodes of depth 0 then cost no drafting time: copied from the
            context). When it wins with copied nodes, the next rounds draft nothing, probing depth 1 every
            ``probe_every`` rounds; a round that keeps the root alone drafts again at depth 1 next round.
    """

    def __init__(self, profile: CostProfile, depth: int, max_nodes: int, warmup_rounds: int = 2,
                 min_speedup: float = 1.0, prior_weight: float = 2.0, calibrate: bool = True,
                 allow_no_draft: bool = False, probe_every: int = 4, plain_probes: tuple[int, ...] = (1, 3),
                 plain_probe_every: int = 32):
        self.profile = profile
        self.depth = depth
        self.max_nodes = max_nodes
        self.warmup_rounds = warmup_rounds
        self.min_speedup = min_speedup
        self.calibrate = calibrate
        self.allow_no_draft, self.probe_every = allow_no_draft, probe_every
        self._undrafted = 0  # consecutive rounds in which depth 0 won
        self.observed = prior_weight  # calibration prior: the draft's probabilities are taken at face value
        self.predicted = prior_weight
        self.rounds = 0
        self.tokens = 0  # tokens produced by the observed rounds (accepted draft tokens + 1 each)
        self.predicted_seconds = 0.0  # their time under this machine's profile
        self.measured_seconds = 0.0  # wall time of the observed rounds (drafting to cache update), when given
        self.measured_tokens = 0
        self.timed_rounds: list[tuple[int, float, int]] = []  # (round index, seconds, tokens) of speculative rounds
        self.plain_rounds: list[tuple[int, float]] = []  # (round index, seconds) of plain rounds: a decoding step now
        self.plain_verify_ratios: list[float] = []  # measured / profiled t(1) of those rounds' target forwards
        self.verify_ratios: list[float] = []  # measured / profiled t(n) of the speculative rounds' verifications
        self.plain_probes, self.plain_probe_every = tuple(plain_probes), plain_probe_every
        self.round_index = 0  # every round of the call, plain probes included
        self.pauses = 0  # plain stretches started after speculation was found not to pay (see `start_pause`)
        self.pause_until = 0  # round index at which the current plain stretch ends
        self.resume_rounds = 0  # speculative rounds to observe again before the next fall-back decision
        self.chosen_depth = 0  # depth of the last round's kept nodes (0: root only)
        self.next_depth = depth  # depth to draft next round
        sizes = torch.arange(1, max_nodes + 1)
        self._verify = torch.tensor([profile.verify(int(n)) for n in sizes], dtype=torch.float64)
        self.plain_rate = 1.0 / profile.verify(1)

    @property
    def calibration(self) -> float:
        return self.observed / self.predicted if self.calibrate else 1.0

    def choose(self, scores: torch.Tensor, depths: torch.LongTensor | None = None,
               drafted_depth: int | None = None) -> tuple[torch.LongTensor, float]:
        """Nodes to keep (root first, then the best nodes in tree order) and the predicted tokens per second.

        With ``depths`` the depth is chosen too: for every ``d`` up to the drafted depth, the best nodes no deeper than
        ``d`` are costed with the drafting time of a depth-``d`` tree, and the (depth, nodes) pair with the highest
        expected tokens per second wins. ``chosen_depth`` is then the depth of the kept nodes (0: root only) and
        ``next_depth`` the depth to draft next round: one more than chosen, so that deeper trees are still probed,
        at most ``self.depth``. A prefix of the score ranking restricted to depth ``<= d`` is still a tree (a child's
        cumulative score never exceeds its parent's).

        Args:
            scores (`torch.Tensor` of shape `[n]`): cumulative draft log-probabilities, root first.
            depths (`torch.LongTensor` of shape `[n]`, *optional*): node depths; without them every node is eligible
                and drafting is costed at ``drafted_depth``.
            drafted_depth: depth this round was drafted at (default ``self.depth``), for the time actually spent.
        """
        drafted = self.depth if drafted_depth is None else int(drafted_depth)
        scores = scores.double().cpu()
        order = ranked_nodes(scores)
        probs = scores[order].exp()
        if depths is None:
            node_depths = torch.full_like(order, drafted)
            candidates = torch.tensor([drafted])
        else:
            node_depths = depths.cpu()[order]
            candidates = torch.arange(0 if self.allow_no_draft else 1, max(drafted, 1) + 1)
        eligible = node_depths[None, :] <= candidates[:, None]  # [D, M]: node j of the ranking allowed at depth d
        zero = torch.zeros(candidates.shape[0], 1, dtype=torch.long)
        counts = torch.cat([zero, eligible.long().cumsum(1)], dim=1)  # [D, M + 1] nodes kept from a ranking prefix
        raw = torch.cat([zero.double(), (probs[None, :] * eligible).cumsum(1)], dim=1)
        gain = 1.0 + raw * self.calibration
        draft_seconds = torch.tensor([self._draft_seconds(int(d)) for d in candidates], dtype=torch.float64)  # [D]
        rate = gain / (draft_seconds[:, None] + self._verify[counts.clamp(max=self.max_nodes - 1)])
        rate = rate.masked_fill(counts > self.max_nodes - 1, float("-inf"))
        best = int(torch.argmax(rate))  # ties: the shallower depth, then the shorter prefix
        row, prefix = divmod(best, rate.shape[1])
        kept = eligible[row, :prefix]
        keep = torch.sort(order[:prefix][kept]).values
        self.chosen_depth = int(node_depths[:prefix][kept].max()) if keep.numel() else 0
        self.next_depth = max(1, min(self.depth, self.chosen_depth + 1))
        if self.allow_no_draft:  # copies won: draft nothing next round, except a depth-1 probe now and then
            # (depth 0 with the root alone is no such win: nothing was worth verifying, and the next round drafts)
            self._undrafted = self._undrafted + 1 if int(candidates[row]) == 0 and keep.numel() else 0
            if self._undrafted and self._undrafted % self.probe_every:
                self.next_depth = 0
        self._last = float(raw[row, prefix]), self._draft_seconds(drafted) + float(self._verify[keep.shape[0]])
        return torch.cat([torch.zeros(1, dtype=torch.long), keep]), float(rate[row, prefix])

    def _draft_seconds(self, depth: int) -> float:
        return self.profile.draft(depth) if depth > 0 else 0.0

    def observe(self, accepted_draft_tokens: int) -> None:
        """Update the calibration and the speed record with the round just verified (after `choose`)."""
        raw, predicted = self._last
        self.observed += accepted_draft_tokens
        self.predicted += raw
        self.rounds += 1
        self.round_index += 1
        self.tokens += accepted_draft_tokens + 1
        self.predicted_seconds += predicted
        self._last_tokens = accepted_draft_tokens + 1

    def observe_seconds(self, seconds: float, verify_seconds: float | None = None, nodes: int | None = None) -> None:
        """The measured wall time of the round just observed (drafting to cache update), and of its verification of
        ``nodes`` nodes (compared with the profile's t(n) by `profile_error`)."""
        if verify_seconds is not None and nodes:
            self.verify_ratios.append(verify_seconds / self.profile.verify(nodes))
        if self.rounds <= 1:  # the first round also feeds the whole prompt to the draft: not a typical round
            return
        tokens = getattr(self, "_last_tokens", 1)
        self.measured_seconds += seconds
        self.measured_tokens += tokens
        self.timed_rounds.append((self.round_index - 1, seconds, tokens))

    PAIR_WINDOW = 4  # a plain probe is compared with the speculative rounds at most this many rounds away
    FIRST_PAUSE = 16  # plain rounds after speculation is first found not to pay; doubled at every later pause
    RESUME_WARMUP = 4  # speculative rounds observed after a pause before the next decision

    def next_pause(self) -> int:
        """Plain rounds the next pause would last (0: pauses are off, a fall-back hands over at once)."""
        return self.FIRST_PAUSE * 2**self.pauses

    def start_pause(self) -> None:
        """Speculation does not pay now: decode plainly for `next_pause` rounds, then speculate again and decide
        afresh (the rounds before the pause no longer count). Load that came and went, or a part of the answer the
        draft predicts badly, then costs a stretch of plain steps instead of the rest of the call."""
        self.pause_until = self.round_index + self.next_pause()
        self.pauses += 1
        self.timed_rounds.clear()
        self.resume_rounds = self.rounds + self.RESUME_WARMUP

    def paused(self) -> bool:
        """Whether this round falls in a plain stretch started by `start_pause`."""
        return self.round_index < self.pause_until

    def plain_probe_due(self) -> bool:
        """Whether this round should be one plain decoding step (a root-only tree, nothing drafted): it measures what a
        decode step costs on this machine now, under its present load and kernels, for `measured_speedup`. Besides the
        schedule (``plain_probes``, then every ``plain_probe_every`` rounds), a fall-back is only decided on a fresh
        probe: while the measurements say speculation loses, a probe is due once the last one is older than
        ``PAIR_WINDOW`` rounds."""
        index = self.round_index
        scheduled = index in self.plain_probes or (index > max(self.plain_probes, default=0)
                                                   and index % self.plain_probe_every == 0)
        return scheduled or (self._losing() and not self._fresh_probe())

    def observe_plain(self, seconds: float, verify_seconds: float | None = None) -> None:
        """Record a plain probe round (one token in ``seconds``, its target forward in ``verify_seconds``)."""
        self.plain_rounds.append((self.round_index, seconds))
        if verify_seconds is not None:
            self.plain_verify_ratios.append(verify_seconds / self.profile.verify(1))
        self.round_index += 1

    def measured_speedup(self) -> float | None:
        """Tokens per second of the speculative rounds over plain probe rounds measured beside them in this call
        (None until both exist). Unlike `predicted_speedup` it needs no cost profile, so a stale or mis-measured
        profile (another machine, load while it was measured, a new kernel) cannot mislead the fall-back decision.

        Each probe is paired with the speculative rounds at most ``PAIR_WINDOW`` rounds away (their tokens per second
        times the probe's step time) and the median over probes is returned: load that comes and goes during the
        call slows both sides of a pair alike instead of tipping the comparison."""
        if not self.plain_rounds or not self.timed_rounds:
            return None
        paired = []
        for index, plain in self.plain_rounds:
            near = [(seconds, tokens) for i, seconds, tokens in self.timed_rounds if abs(i - index) <= self.PAIR_WINDOW]
            if len(near) >= 2:
                paired.append(sum(t for _, t in near) / sum(s for s, _ in near) * plain)
        if not paired:  # no probe has rounds beside it yet: the call's totals
            plain = sorted(seconds for _, seconds in self.plain_rounds)[len(self.plain_rounds) // 2]
            return (self.measured_tokens / self.measured_seconds) * plain
        return statistics.median(paired)

    def _losing(self) -> bool:
        if self.rounds < max(self.warmup_rounds, self.resume_rounds):
            return False
        measured = self.measured_speedup()
        return measured is not None and measured < self.min_speedup

    def _fresh_probe(self) -> bool:
        return bool(self.plain_rounds) and self.round_index - self.plain_rounds[-1][0] <= self.PAIR_WINDOW

    def profile_error(self) -> float | None:
        """How far the profile's cost SHAPE is from this call's measurements (>= 1; None until measured): the
        measured / profiled time of one-node forwards (plain probes) against that of the rounds' verifications.
        Load that slows everything alike leaves it at 1 (the profile's ratios still hold); a profile measured under
        load that came and went, on another machine or with another kernel moves it."""
        if len(self.plain_verify_ratios) < 3 or len(self.verify_ratios) < 8:
            return None
        one = sorted(self.plain_verify_ratios)[len(self.plain_verify_ratios) // 2]
        many = sorted(self.verify_ratios)[len(self.verify_ratios) // 2]
        return max(one / many, many / one)

    def plain_cost_error(self) -> float | None:
        """How far the profile's ``t(1)`` is from the plain rounds of this call (>= 1; None before 3 of them): a
        profile measured under load that has gone, or on another machine, is off by a factor even where its shape is
        not, and a budget that trusts a far too high cost never drafts the trees that would show it."""
        if len(self.plain_verify_ratios) < 3:
            return None
        ratio = sorted(self.plain_verify_ratios)[len(self.plain_verify_ratios) // 2]
        return max(ratio, 1.0 / ratio)

    def predicted_speedup(self) -> float:
        """Speed of the rounds so far over plain decoding on this machine: the tokens they actually produced per
        second of their profiled time (drafting at the drafted depth + verifying the kept nodes), over ``1 / t(1)``.
        Acceptance is what the target really accepted, not the draft's estimate, so a draft that is over-confident
        in the first rounds does not delay the fallback (the same measure `simulate_shape` replays)."""
        if self.predicted_seconds == 0:
            return float("inf")
        return (self.tokens / self.predicted_seconds) / self.plain_rate

    def should_fall_back(self) -> bool:
        """After the warm-up rounds: is speculation slower than plain decoding? Measured in this call where plain
        probe rounds exist (`measured_speedup`, and only once a probe at most ``PAIR_WINDOW`` rounds old confirms
        it), else predicted from the profile (`predicted_speedup`)."""
        if self.rounds < max(self.warmup_rounds, self.resume_rounds):
            return False
        measured = self.measured_speedup()
        if measured is None:
            return self.predicted_speedup() < self.min_speedup
        return measured < self.min_speedup and self._fresh_probe()


# ---------------------------------------------------------------------------------------------------- replay
@dataclass
class RoundRecord:
    """One verified round of a recording run: the drafted tree and the accepted path (node indices, root first).

    ``parents`` (the tree's parent vector) is needed to replay the round as a chain (top-k 1).
    """

    depths: torch.LongTensor
    scores: torch.Tensor
    path: torch.LongTensor
    parents: torch.LongTensor | None = None


def best_children(parents: torch.LongTensor, scores: torch.Tensor) -> torch.LongTensor:
    """`[n]`: each node's child with the highest score (ties: the first in node order), ``n`` where it has none.

    Children of one node share its cumulative score, so the best child by cumulative score is the draft's top-1 token
    after that node: what a top-k 1 proposer drafts there.
    """
    n = parents.shape[0]
    children = torch.arange(1, n)
    child_parents = parents[1:].long()
    child_scores = scores[1:].double()
    best = torch.full((n,), float("-inf"), dtype=torch.float64)
    best = best.scatter_reduce(0, child_parents, child_scores, reduce="amax")
    is_best = child_scores == best[child_parents]
    candidates = torch.where(is_best, children, torch.full_like(children, n))
    first = torch.full((n,), n, dtype=torch.long)
    return first.scatter_reduce(0, child_parents, candidates, reduce="amin")


def chain_nodes(record: RoundRecord, length: int) -> torch.LongTensor:
    """Node indices of the top-1 path of a recorded tree (root excluded), at most ``length`` long: node ``i + 1`` is
    the best child of node ``i``. It stops early where the recorded tree did not keep that child."""
    if record.parents is None:
        raise ValueError("this round was recorded without the tree's parents: it cannot be replayed as a chain")
    best = best_children(record.parents, record.scores)
    n = best.shape[0]
    nodes, node = [], 0
    for _ in range(length):  # a walk down one path: at most `length` steps
        node = int(best[node])
        if node >= n:
            break
        nodes.append(node)
    return torch.tensor(nodes, dtype=torch.long)


def _chain_length(depth: int, total_tokens: int) -> int:
    return max(0, min(depth, total_tokens - 1))


def truncated_accepted(record: RoundRecord, depth: int, total_tokens: int, top_k: int | None = None) -> int:
    """Accepted draft tokens had the tree been cut to ``depth`` and the best ``total_tokens - 1`` nodes (greedy).

    With ``top_k == 1`` the round is replayed as a chain of ``min(depth, total_tokens - 1)`` tokens: the top-1 path
    (the best child at each depth); it accepts the leading nodes it shares with the accepted path.
    """
    if top_k == 1:
        chain = chain_nodes(record, _chain_length(depth, total_tokens))
        path = record.path[1:].long()
        common = min(chain.shape[0], path.shape[0])
        agree = (chain[:common] == path[:common]).long()
        return int(agree.cumprod(0).sum())
    eligible = torch.nonzero(record.depths[1:] <= depth).flatten() + 1
    order = eligible[torch.sort(record.scores[eligible], descending=True, stable=True).indices]
    kept = torch.zeros(record.depths.shape[0], dtype=torch.bool)
    kept[order[: total_tokens - 1]] = True
    accepted = 0
    for node in record.path[1:].tolist():
        if not kept[node]:
            break
        accepted += 1
    return accepted


def simulate_shape(records: list[RoundRecord], profile: CostProfile, depth: int, total_tokens: int,
                   top_k: int | None = None) -> dict:
    """Predicted acceptance length and speed-up over plain decoding of a shape, replaying ``records``.

    ``top_k == 1`` replays a chain of ``min(depth, total_tokens - 1)`` tokens (its ``total_tokens`` is reported as
    that plus the root); ``profile`` should then carry the drafting times of top-k 1.
    """
    if not records:
        raise ValueError("no recorded rounds to replay")
    if top_k == 1:
        depth = _chain_length(depth, total_tokens)
        total_tokens = depth + 1
    tokens = sum(truncated_accepted(r, depth, total_tokens, top_k) + 1 for r in records)
    seconds = len(records) * (profile.draft(depth) + profile.verify(total_tokens))
    tau = tokens / len(records)
    return {"depth": depth, "top_k": top_k, "kind": "chain" if top_k == 1 else "tree", "total_tokens": total_tokens,
            "mean_acceptance_length": tau, "predicted_speedup": (tokens / seconds) * profile.verify(1)}


__all__ = ["DEFAULT_SIZES", "CostProfile", "RoundRecord", "TreeBudget", "best_children", "cache_dir", "chain_nodes",
           "load_or_measure_profile", "measure_draft_seconds", "measure_verify_seconds", "profile_key",
           "ranked_nodes", "simulate_shape", "truncated_accepted", "usable_profile"]
