"""Per-prompt records and the summaries `poss bench` reports: speed, speed-up, acceptance, equality, memory."""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass

from .methods import MethodResult, Prompt


ACCEPTANCE_CONVENTION = ("mean_acceptance_length counts tokens gained per target forward pass, the target's own "
                         "bonus token included (+1 convention): plain decoding scores exactly 1.0")


@dataclass
class PromptRecord:
    """One method's run on one prompt."""

    prompt: Prompt
    result: MethodResult
    seconds: float
    peak_memory_mb: float | None = None
    memory_delta_mb: float | None = None
    identical: bool | None = None
    first_mismatch: int | None = None
    speedup: float | None = None

    @property
    def new_tokens(self) -> int:
        return len(self.result.tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def accepted_lengths(self) -> list[int]:
        """Tokens per round; plain decoding (no statistics) is one token per round."""
        if self.result.accepted_lengths is not None:
            return list(self.result.accepted_lengths)
        return [1] * self.new_tokens

    def as_dict(self) -> dict:
        """JSON-ready view of the record (tokens themselves are left out)."""
        lengths = self.accepted_lengths()
        return {
            "question_id": self.prompt.question_id, "file": self.prompt.file, "category": self.prompt.category,
            "prompt_tokens": int(self.prompt.input_ids.shape[1]), "new_tokens": self.new_tokens,
            "seconds": round(self.seconds, 6), "tokens_per_s": round(self.tokens_per_s, 4),
            "speedup": None if self.speedup is None else round(self.speedup, 4),
            "identical_to_baseline": self.identical, "first_mismatch": self.first_mismatch,
            "rounds": len(lengths), "mean_acceptance_length": _mean(lengths),
            "accepted_lengths": lengths if self.result.accepted_lengths is not None else None,
            "time_split": self.result.time_split, "plain_tokens": self.result.plain_tokens,
            "plain_decoding_seconds": _rounded(self.result.plain_seconds), "peak_memory_mb": self.peak_memory_mb,
            "memory_delta_mb": self.memory_delta_mb,
        }


def _mean(values) -> float | None:
    values = list(values)
    return round(sum(values) / len(values), 4) if values else None


def _rounded(value, digits: int = 6) -> float | None:
    return None if value is None else round(value, digits)


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 4) if values else None


def first_mismatch(tokens: list[int], reference: list[int]) -> int | None:
    """Index of the first position where `tokens` and `reference` differ (a length difference counts); None if equal."""
    for index, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return index
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def compare_with_baseline(record: PromptRecord, baseline: PromptRecord) -> None:
    """Fill in the equality and per-prompt speed-up of `record` against the baseline run of the same prompt."""
    record.first_mismatch = first_mismatch(record.result.tokens, baseline.result.tokens)
    record.identical = record.first_mismatch is None
    if baseline.tokens_per_s > 0:
        record.speedup = record.tokens_per_s / baseline.tokens_per_s


# a position-wise rate from fewer rounds than this is not shown (None): 0.0 or 1.0 from three rounds says nothing
MIN_POSITION_ROUNDS = 10


def _pooled_counts(records: list[PromptRecord]) -> tuple[list[int], list[int]] | None:
    """Per-position (accepted, proposed) counts summed over prompts."""
    accepted, proposed = [], []
    for record in records:
        if record.result.position_counts is None:
            continue
        for totals, values in zip((accepted, proposed), record.result.position_counts):
            totals.extend([0] * (len(values) - len(totals)))
            for i, value in enumerate(values):
                totals[i] += value
    if not proposed:
        return None
    return accepted, proposed


def _pooled_rounds(records: list[PromptRecord]) -> tuple[list[int], list[int]] | None:
    """Per-position (accepted, reached) counts from rounds of (positions offered, tokens accepted)."""
    rounds = []
    for record in records:
        accepted, drafted = record.result.accepted_lengths, record.result.drafted_lengths
        if accepted is not None and drafted is not None:
            rounds.extend((d, a - 1) for a, d in zip(accepted, drafted))
    if not rounds:
        return None
    accepted, reached = [], []
    for i in range(1, max(d for d, _ in rounds) + 1):
        count = sum(1 for d, a in rounds if d >= i and a >= i - 1)
        if count == 0:
            break
        reached.append(count)
        accepted.append(sum(1 for d, a in rounds if d >= i and a >= i))
    return accepted, reached


def _position_counts(records: list[PromptRecord]) -> tuple[list[int], list[int]] | None:
    """Per-position (accepted, reached) counts: exact ones where the method reports them, else from its rounds."""
    return _pooled_counts(records) or _pooled_rounds(records)


def position_rounds(records: list[PromptRecord]) -> list[int] | None:
    """At each draft position i, the rounds that reached it (the count behind each position-wise rate)."""
    counts = _position_counts(records)
    return list(counts[1]) if counts else None


def position_acceptance(records: list[PromptRecord]) -> list[float | None] | None:
    """Pooled position-wise acceptance: at position i, rounds that accepted i drafts over rounds that reached i;
    None where fewer than `MIN_POSITION_ROUNDS` rounds reached i (`position_rounds` gives the counts).

    A round "reaches" position i when positions 1..i-1 were accepted and the draft offered a token at position i.
    Uses exact per-position counts when the method reports them, else per-round offered/accepted lengths, else the
    mean of per-prompt rates.
    """
    counts = _position_counts(records)
    if counts is not None:
        return [round(a / p, 4) if p >= MIN_POSITION_ROUNDS else None for a, p in zip(*counts)]
    lists = [r.result.position_acceptance for r in records if r.result.position_acceptance]
    if not lists:
        return None
    depth = max(len(values) for values in lists)
    return [_mean(values[i] for values in lists if len(values) > i) for i in range(depth)]


def position_reach(records: list[PromptRecord]) -> list[float] | None:
    """Pooled share of rounds that accepted at least i draft tokens, at each draft position i.

    Unlike `position_acceptance`, every position is over the same rounds (all that offered position 1), so drafts can
    be compared position by position even when their earlier positions differ; the shares sum to the mean number of
    accepted draft tokens per round (the mean acceptance length minus the target's own token).
    """
    counts = _position_counts(records)
    if counts is None or not counts[1] or counts[1][0] == 0:
        return None
    rounds = counts[1][0]
    return [round(a / rounds, 4) for a in counts[0]]


def time_split(records: list[PromptRecord]) -> dict | None:
    """Seconds and shares per reported phase plus ``other`` (the rest), summed over prompts; None if not reported."""
    splits = [(r.result.time_split, r.seconds) for r in records if r.result.time_split]
    if not splits:
        return None
    total = sum(seconds for _, seconds in splits)
    seconds = defaultdict(float)
    for split, _ in splits:
        for phase, value in split.items():
            seconds[phase] += value
    seconds["other"] = max(total - sum(seconds.values()), 0.0)
    return {"seconds": {k: round(v, 4) for k, v in seconds.items()},
            "share": {k: round(v / total, 4) if total > 0 else None for k, v in seconds.items()}}


def plain_decoding(records: list[PromptRecord]) -> dict:
    """How much of a method's run was plain decoding after a fallback of the automatic budget (summed over prompts).

    ``seconds`` / ``tokens`` of that plain decoding, ``share`` of the method's wall-clock seconds, ``token_share`` of
    its new tokens, ``prompts`` that fell back. All 0 for methods that never fall back (no automatic budget).
    """
    seconds = sum(r.result.plain_seconds or 0.0 for r in records)
    tokens = sum(r.result.plain_tokens or 0 for r in records)
    total_seconds, total_tokens = sum(r.seconds for r in records), sum(r.new_tokens for r in records)
    return {"seconds": round(seconds, 4), "share": round(seconds / total_seconds, 4) if total_seconds > 0 else 0.0,
            "tokens": tokens, "token_share": round(tokens / total_tokens, 4) if total_tokens else 0.0,
            "prompts": sum(1 for r in records if r.result.plain_tokens)}


def sources(records: list[PromptRecord]) -> dict | None:
    """With context candidates: per source (``draft``, ``context``), the accepted draft tokens it proposed
    (``accepted_tokens``; a token both proposed counts for both) and the share of rounds in which it proposed at
    least one accepted token (``round_share``). None for methods without sources."""
    counted = [r.result for r in records if r.result.source_round_total]
    if not counted:
        return None
    total = sum(r.source_round_total for r in counted)
    names = sorted({name for r in counted for name in r.source_tokens})
    return {name: {"accepted_tokens": sum(r.source_tokens.get(name, 0) for r in counted),
                   "round_share": round(sum(r.source_rounds.get(name, 0) for r in counted) / total, 4)}
            for name in names}


def summarize(records: list[PromptRecord], baseline: list[PromptRecord]) -> dict:
    """Speed, speed-up, acceptance and equality over a set of prompts (baseline = the same prompts' baseline runs)."""
    tokens = sum(r.new_tokens for r in records)
    seconds = sum(r.seconds for r in records)
    base_rate = sum(r.new_tokens for r in baseline) / max(sum(r.seconds for r in baseline), 1e-12)
    aggregate = tokens / seconds if seconds > 0 else 0.0
    lengths = [n for r in records for n in r.accepted_lengths()]
    return {
        "prompts": len(records),
        "new_tokens": tokens,
        "seconds": round(seconds, 4),
        "tokens_per_s": {"median": _median(r.tokens_per_s for r in records), "aggregate": round(aggregate, 4)},
        "speedup": {"median": _median(r.speedup for r in records),
                    "aggregate": round(aggregate / base_rate, 4) if base_rate > 0 else None},
        "mean_acceptance_length": _mean(lengths),
        "mean_draft_depth": _mean(d for r in records for d in (r.result.drafted_lengths or ()) if d > 0),
        "identical_to_baseline": sum(1 for r in records if r.identical),
        "plain_decoding": plain_decoding(records),
        "sources": sources(records),
    }


def _grouped(records: list[PromptRecord], baseline: list[PromptRecord], key) -> dict:
    groups, base_groups = defaultdict(list), defaultdict(list)
    for record in records:
        groups[key(record)].append(record)
    for record in baseline:
        base_groups[key(record)].append(record)
    return {name: summarize(group, base_groups[name]) for name, group in groups.items()}


def method_report(records: list[PromptRecord], baseline: list[PromptRecord], info: dict | None = None) -> dict:
    """The report entry of one method: overall summary, breakdowns per file and category, per-prompt records."""
    entry = summarize(records, baseline)
    memory = [r.peak_memory_mb for r in records if r.peak_memory_mb is not None]
    deltas = [r.memory_delta_mb for r in records if r.memory_delta_mb is not None]
    entry.update({
        "position_acceptance": position_acceptance(records),
        "position_rounds": position_rounds(records),
        "position_reach": position_reach(records),
        "mismatches": [{"question_id": r.prompt.question_id, "file": r.prompt.file, "first_mismatch": r.first_mismatch}
                       for r in records if r.identical is False],
        "time_split": time_split(records),
        "peak_memory_mb": round(max(memory), 1) if memory else None,
        "peak_memory_delta_mb": round(max(deltas), 1) if deltas else None,
        "by_file": _grouped(records, baseline, lambda r: r.prompt.file),
        "by_category": _grouped(records, baseline, lambda r: r.prompt.category),
        "info": dict(info or {}),
        "per_prompt": [r.as_dict() for r in records],
    })
    return entry


def _fmt(value, pattern="{:.2f}") -> str:
    return "-" if value is None else pattern.format(value)


def plain_percent(share: float | None) -> str:
    """The "plain %" cell: share of a method's wall-clock time in plain decoding after a fallback, "-" for none."""
    return "-" if not share or share <= 0 else f"{share:.0%}"


def markdown_table(methods: dict) -> str:
    """Markdown summary of a report's ``methods`` section, one row per method."""
    lines = ["| method | tok/s median | tok/s aggregate | speed-up median | speed-up aggregate | mean acc. length "
             "| plain % | identical | peak MB (+ per call) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, m in methods.items():
        plain = plain_percent((m.get("plain_decoding") or {}).get("share"))
        lines.append(
            f"| {name} | {_fmt(m['tokens_per_s']['median'])} | {_fmt(m['tokens_per_s']['aggregate'])} "
            f"| {_fmt(m['speedup']['median'], '{:.2f}x')} | {_fmt(m['speedup']['aggregate'], '{:.2f}x')} "
            f"| {_fmt(m['mean_acceptance_length'])} | {plain} | {m['identical_to_baseline']}/{m['prompts']} "
            f"| {_fmt(m.get('peak_memory_mb'), '{:.0f}')} (+{_fmt(m.get('peak_memory_delta_mb'), '{:.0f}')}) |")
    return "\n".join(lines)


def source_table(methods: dict) -> str:
    """Markdown table of the accepted tokens and the share of rounds per source ("" when no method has sources)."""
    rows = [(name, m["sources"]) for name, m in methods.items() if m.get("sources")]
    if not rows:
        return ""
    lines = ["| method | draft tokens | draft rounds | context tokens | context rounds |", "|---|---:|---:|---:|---:|"]
    for name, entry in rows:
        cells = []
        for source in ("draft", "context"):
            value = entry.get(source, {"accepted_tokens": 0, "round_share": 0.0})
            cells += [str(value["accepted_tokens"]), f"{value['round_share']:.0%}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def category_table(methods: dict, group: str = "by_category") -> str:
    """Markdown table of aggregate speed-up per category (or file) and method."""
    names = list(methods)
    groups = sorted({g for m in methods.values() for g in m[group]})
    lines = ["| " + group.removeprefix("by_") + " | " + " | ".join(names) + " |",
             "|---|" + "---:|" * len(names)]
    for g in groups:
        cells = [_fmt(methods[n][group].get(g, {}).get("speedup", {}).get("aggregate"), "{:.2f}x") for n in names]
        lines.append(f"| {g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
