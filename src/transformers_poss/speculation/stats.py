"""Acceptance statistics of a tree-speculative generation (one entry per verification round)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .trie import SOURCE_NAMES


@dataclass
class AcceptanceStats:
    """Acceptance of a tree-speculative generation, one entry per verification round.

    Attributes:
        accepted_lengths (`list[int]`): tokens produced per round, i.e. accepted draft tokens + 1 (the bonus token).
        position_accepted (`list[int]`): at index ``i``, rounds whose draft token at position ``i + 1`` was accepted.
        position_proposed (`list[int]`): at index ``i``, rounds that proposed a draft token at position ``i + 1``
            after accepting positions ``1..i``.
        timings (`dict[str, float]`): seconds spent per phase (drafting, verification, acceptance, cache_update;
            plain_decoding for rounds the budget paused speculation and after a fallback).
        rounds (`list`): per-round trees and accepted paths (`budget.RoundRecord`), when recording was asked for.
        fell_back_to_plain (`bool`): the automatic budget found that speculation does not pay on this machine and
            finished the call with plain decoding steps.
        plain_steps (`int`): plain decoding steps (single-row loop): those of transformers' own loop after such a
            fallback, and the loop's own root-only rounds while the budget paused speculation. Each is one target
            forward producing one token, so each is also counted as a round of length 1 in ``accepted_lengths``
            (``mean_acceptance_length`` stays tokens per target forward).
        tree_depths (`list[int]`): single-row loop only, aligned with ``accepted_lengths``: the depth of the tree
            verified in that round (with ``tree_total_tokens="auto"`` the depth the budget chose; 0 for a root-only
            round or a plain step after a fallback).
        source_tokens (`dict[str, int]`): with context candidates (``tree_context_candidates``), accepted draft
            tokens per source (``"draft"``, ``"context"``); a token both sources proposed counts for both.
        source_rounds (`dict[str, int]`): rounds (per row in a batch) in which a source proposed at least one
            accepted token; ``source_rounds[s] / source_round_total`` is the share of rounds it contributed to.
        source_round_total (`int`): rounds (per row) recorded with sources.
    """

    accepted_lengths: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)
    position_proposed: list[int] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    rounds: list = field(default_factory=list)
    fell_back_to_plain: bool = False
    plain_steps: int = 0
    tree_depths: list[int] = field(default_factory=list)
    source_tokens: dict[str, int] = field(default_factory=dict)
    source_rounds: dict[str, int] = field(default_factory=dict)
    source_round_total: int = 0

    def record(self, num_accepted: int, proposed_next: bool, depth: int | None = None) -> None:
        """Add one round that accepted ``num_accepted`` draft tokens (from a tree of ``depth``, when given)."""
        self.accepted_lengths.append(num_accepted + 1)
        if depth is not None:
            self.tree_depths.append(depth)
        reached = num_accepted + (1 if proposed_next else 0)
        while len(self.position_proposed) < reached:
            self.position_proposed.append(0)
            self.position_accepted.append(0)
        for i in range(reached):
            self.position_proposed[i] += 1
        for i in range(num_accepted):
            self.position_accepted[i] += 1

    def record_sources(self, accepted_sources: list[int]) -> None:
        """Add one round's (one row's) accepted draft tokens by source: ``accepted_sources`` holds the source bit
        mask of each accepted node (root excluded)."""
        self.source_round_total += 1
        for bit, name in SOURCE_NAMES.items():
            count = sum(1 for sources in accepted_sources if sources & bit)
            self.source_tokens[name] = self.source_tokens.get(name, 0) + count
            self.source_rounds[name] = self.source_rounds.get(name, 0) + (1 if count else 0)

    @property
    def source_round_share(self) -> dict[str, float]:
        """Per source, the share of rounds with sources recorded in which it proposed an accepted token."""
        total = max(self.source_round_total, 1)
        return {name: rounds / total for name, rounds in self.source_rounds.items()}

    def record_plain_steps(self, count: int) -> None:
        """Add ``count`` steps of plain decoding (one token per target forward, nothing drafted)."""
        self.plain_steps += count
        self.accepted_lengths += [1] * count
        self.tree_depths += [0] * count

    def record_paused_step(self) -> None:
        """Count the round just recorded (a root-only round while the budget paused speculation) as a plain step."""
        self.plain_steps += 1

    def add_time(self, phase: str, seconds: float) -> None:
        self.timings[phase] = self.timings.get(phase, 0.0) + seconds

    @property
    def plain_decoding_seconds(self) -> float:
        """Seconds of plain decoding the budget decided: paused rounds and transformers' own loop after a fallback."""
        return self.timings.get("plain_decoding", 0.0)

    @property
    def num_rounds(self) -> int:
        return len(self.accepted_lengths)

    @property
    def accepted_draft_tokens(self) -> list[int]:
        """Accepted draft tokens per round (``accepted_lengths`` without the +1)."""
        return [n - 1 for n in self.accepted_lengths]

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per target verification forward, bonus token included (+1 convention); 0.0 before any round."""
        if not self.accepted_lengths:
            return 0.0
        return sum(self.accepted_lengths) / len(self.accepted_lengths)

    @property
    def position_acceptance(self) -> list[float]:
        """Rate at draft position ``i + 1`` given positions ``1..i`` accepted (index 0 = position 1)."""
        return [a / p if p else 0.0 for a, p in zip(self.position_accepted, self.position_proposed)]

    def merge(self, other: "AcceptanceStats") -> "AcceptanceStats":
        """Combine two runs (e.g. over many prompts) into a new object."""
        out = AcceptanceStats(accepted_lengths=self.accepted_lengths + other.accepted_lengths)
        size = max(len(self.position_proposed), len(other.position_proposed))
        for name in ("position_accepted", "position_proposed"):
            a, b = getattr(self, name), getattr(other, name)
            setattr(out, name, [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(size)])
        for phase in set(self.timings) | set(other.timings):
            out.timings[phase] = self.timings.get(phase, 0.0) + other.timings.get(phase, 0.0)
        out.rounds = self.rounds + other.rounds
        out.fell_back_to_plain = self.fell_back_to_plain or other.fell_back_to_plain
        out.plain_steps = self.plain_steps + other.plain_steps
        out.tree_depths = self.tree_depths + other.tree_depths
        for name in ("source_tokens", "source_rounds"):
            mine, theirs = getattr(self, name), getattr(other, name)
            setattr(out, name, {k: mine.get(k, 0) + theirs.get(k, 0) for k in set(mine) | set(theirs)})
        out.source_round_total = self.source_round_total + other.source_round_total
        return out
