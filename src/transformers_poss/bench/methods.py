"""Decoding methods compared by `poss bench`.

A method is a name plus a callable ``run(prompt, settings) -> MethodResult``: it produces the new tokens for one
prompt and, where it can, acceptance statistics. The bench times the call and compares the tokens with the baseline,
so any callable fits (the tests plug in a deliberately broken one).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .._transformers_compat import unwrap_candidate_generator, wrap_candidate_generator


@dataclass
class Prompt:
    """One benchmark prompt, tokenized for the target."""

    question_id: Any
    file: str
    category: str
    text: str
    input_ids: torch.LongTensor  # [1, n]
    attention_mask: torch.LongTensor | None = None


@dataclass
class GenerationSettings:
    """Decoding settings shared by every method of a run (temperature 0 = greedy)."""

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def generate_kwargs(self) -> dict:
        """Keyword arguments for ``generate`` that pin down the decoding rule."""
        if self.greedy:
            return {"max_new_tokens": self.max_new_tokens, "do_sample": False}
        kwargs = {"max_new_tokens": self.max_new_tokens, "do_sample": True, "temperature": self.temperature,
                  "top_k": self.top_k or 0}
        if self.top_p is not None and self.top_p < 1.0:
            kwargs["top_p"] = self.top_p
        return kwargs


@dataclass
class MethodResult:
    """What a method produced for one prompt.

    Attributes:
        tokens: the new tokens (prompt excluded).
        accepted_lengths: tokens gained per target forward ("round"), bonus token included (+1 convention).
        drafted_lengths: per round, how many draft positions were on offer (chain length or tree depth), if known.
        position_acceptance: rate at draft position i given positions 1..i-1 accepted (index 0 = position 1).
        time_split: seconds per phase as the method reports them (``drafting``, ``verification``, ...); time not
            covered is reported as ``other``.
        position_counts: ``(accepted, proposed)`` per draft position, pooled exactly across prompts when given.
        plain_tokens: tokens produced by plain decoding after a fallback of the automatic budget (0: none; None:
            the method has no fallback).
        plain_seconds: seconds of that plain decoding.
        source_tokens: with context candidates, accepted draft tokens per source (``draft``, ``context``; a token
            both proposed counts for both).
        source_rounds: rounds in which each source proposed an accepted token; source_round_total: rounds counted.
    """

    tokens: list[int]
    accepted_lengths: list[int] | None = None
    drafted_lengths: list[int] | None = None
    position_acceptance: list[float] | None = None
    time_split: dict[str, float] | None = None
    position_counts: tuple[list[int], list[int]] | None = None
    plain_tokens: int | None = None
    plain_seconds: float | None = None
    source_tokens: dict[str, int] | None = None
    source_rounds: dict[str, int] | None = None
    source_round_total: int | None = None


@dataclass
class Method:
    """A named decoding method: ``run(prompt, settings) -> MethodResult``; ``info`` lands in the report."""

    name: str
    run: Callable[[Prompt, GenerationSettings], MethodResult]
    info: dict = field(default_factory=dict)


@contextlib.contextmanager
def record_candidate_rounds(model):
    """Record (candidates offered, candidates accepted) per round of transformers' stock assisted decoding.

    Wraps the candidate generator that ``generate`` builds for this model instance, so prompt lookup and chain
    assistants report acceptance without changes to transformers. Yields the list of rounds.
    """
    rounds: list[tuple[int, int]] = []

    def wrapped_build(build, *args, **kwargs):
        generator = build(*args, **kwargs)
        update = generator.update_candidate_strategy

        def recording_update(input_ids, scores, num_matches):
            rounds.append((int(scores.shape[1]) - 1, int(num_matches)))
            return update(input_ids, scores, num_matches)

        generator.update_candidate_strategy = recording_update
        return generator

    wrap_candidate_generator(model, wrapped_build)
    try:
        yield rounds
    finally:
        unwrap_candidate_generator(model)


def _as_list(value) -> list | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return list(value)


def _time_split(acceptance) -> dict[str, float] | None:
    """Seconds per phase (drafting, verification, ...) from a generate result's acceptance record, if it has them."""
    for name in ("timings", "time_split"):
        split = getattr(acceptance, name, None)
        if isinstance(split, dict) and split:
            return {str(key): float(value) for key, value in split.items() if value is not None}
    found = {}
    for key in ("drafting", "verification"):
        for name in (f"{key}_time", f"{key}_s", f"{key}_seconds"):
            if getattr(acceptance, name, None) is not None:
                found[key] = float(getattr(acceptance, name))
                break
    return found or None


def result_from_generate(output, prompt_length: int, rounds: list[tuple[int, int]] | None = None) -> MethodResult:
    """Turn a ``generate(..., return_dict_in_generate=True)`` output into a `MethodResult`.

    Acceptance comes from ``output.acceptance`` (tree speculation) when present, else from recorded stock
    assisted-decoding rounds, else (plain decoding) every round yields exactly one token.
    """
    sequences = output.sequences if hasattr(output, "sequences") else output
    tokens = sequences[0, prompt_length:].tolist()
    acceptance = getattr(output, "acceptance", None)
    if acceptance is not None:
        accepted = _as_list(getattr(acceptance, "accepted_lengths", None))
        positions = _as_list(getattr(acceptance, "position_acceptance", None))
        counts = None
        if getattr(acceptance, "position_proposed", None) is not None:
            counts = (_as_list(acceptance.position_accepted), _as_list(acceptance.position_proposed))
        depths = _as_list(getattr(acceptance, "tree_depths", None))  # per round, 0 for plain steps
        depths = depths if depths and accepted and len(depths) == len(accepted) else None
        split = _time_split(acceptance)
        plain_tokens = getattr(acceptance, "plain_steps", None)
        plain_seconds = (split or {}).get("plain_decoding", 0.0) if plain_tokens is not None else None
        sources = {}
        if getattr(acceptance, "source_round_total", 0):
            sources = {"source_tokens": dict(acceptance.source_tokens), "source_rounds": dict(acceptance.source_rounds),
                       "source_round_total": int(acceptance.source_round_total)}
        return MethodResult(tokens, accepted, depths, positions, split, counts, plain_tokens, plain_seconds, **sources)
    if rounds:
        return MethodResult(tokens, [m + 1 for _, m in rounds], [c for c, _ in rounds])
    return MethodResult(tokens)


@contextlib.contextmanager
def tree_shape(draft, depth: int | None = None, top_k: int | None = None, total_tokens: int | None = None,
               context: bool | int | None = None, sampling: str | None = None):
    """Temporarily set the tree shape (and ``tree_context_candidates``: ``context``, ``tree_sampling``:
    ``sampling``) on ``draft.generation_config`` (None keeps the draft's own value)."""
    from ..checks import tree_value

    config = draft.generation_config
    wanted = {"tree_depth": depth, "tree_top_k": top_k, "tree_total_tokens": total_tokens}
    wanted = {key: None if value is None else tree_value(key, value) for key, value in wanted.items()}
    wanted["tree_context_candidates"] = context
    wanted["tree_sampling"] = sampling
    saved = {key: getattr(config, key, None) for key in wanted}
    for key, value in wanted.items():
        if value is not None:
            setattr(config, key, value)
    try:
        yield
    finally:
        for key, value in saved.items():
            setattr(config, key, value)


def generate_method(name: str, model, extra: dict | None = None, draft=None, shape: dict | None = None,
                    record_rounds: bool = False, info: dict | None = None) -> Method:
    """A method that calls ``model.generate`` with `extra` keyword arguments.

    Args:
        name: report name of the method.
        model: the target model.
        extra: additional ``generate`` arguments (e.g. ``prompt_lookup_num_tokens``, ``assistant_model``).
        draft: a PosS draft passed as ``assistant_model``; `shape` (depth / top_k / total_tokens) is set on it.
        record_rounds: record stock assisted-decoding rounds (prompt lookup, chain assistants).
    """
    extra = dict(extra or {})
    if draft is not None:
        extra["assistant_model"] = draft

    def run(prompt: Prompt, settings: GenerationSettings) -> MethodResult:
        kwargs = {"input_ids": prompt.input_ids, "return_dict_in_generate": True, **settings.generate_kwargs(),
                  **extra}
        if prompt.attention_mask is not None:
            kwargs["attention_mask"] = prompt.attention_mask
        shaping = tree_shape(draft, **(shape or {})) if draft is not None else contextlib.nullcontext()
        recording = record_candidate_rounds(model) if record_rounds else contextlib.nullcontext([])
        with shaping, recording as rounds:
            output = model.generate(**kwargs)
        return result_from_generate(output, prompt.input_ids.shape[1], rounds)

    return Method(name, run, dict(info or {}))


def baseline_method(model) -> Method:
    """Plain ``target.generate``: the reference every other method is compared with."""
    return generate_method("baseline", model, info={"kind": "baseline"})


def prompt_lookup_method(model, num_tokens: int = 10, max_ngram: int = 2) -> Method:
    """transformers' built-in prompt lookup decoding (``prompt_lookup_num_tokens``)."""
    extra = {"prompt_lookup_num_tokens": num_tokens, "max_matching_ngram_size": max_ngram}
    info = {"kind": "prompt_lookup", "prompt_lookup_num_tokens": num_tokens, "max_matching_ngram_size": max_ngram}
    return generate_method("prompt_lookup", model, extra, record_rounds=True, info=info)


def assistant_method(name: str, model, assistant, source: str) -> Method:
    """Chain speculation with a small causal LM sharing the target's tokenizer (``assistant_model=``)."""
    return generate_method(name, model, {"assistant_model": assistant}, record_rounds=True,
                           info={"kind": "chain_assistant", "source": source})


def draft_method(name: str, model, draft, source: str, depth=None, top_k=None, total_tokens=None,
                 context=None, sampling=None) -> Method:
    """PosS tree speculation with `draft`, optionally with a tree shape (and ``tree_context_candidates``:
    ``context``, ``tree_sampling``: ``sampling``) overriding the draft's own."""
    shape = {"depth": depth, "top_k": top_k, "total_tokens": total_tokens, "context": context, "sampling": sampling}
    config = draft.generation_config
    effective = {key: value if value is not None else getattr(config, f"tree_{key}", None)
                 for key, value in shape.items() if key not in ("context", "sampling")}
    copied = context if context is not None else getattr(config, "tree_context_candidates", None)
    from ..speculation.sampled_drafter import tree_sampling_mode

    mode = sampling if sampling is not None else tree_sampling_mode(config)
    info = {"kind": "poss_tree", "source": source, "tree": effective, "context_candidates": copied,
            "tree_sampling": mode}
    return generate_method(name, model, draft=draft, shape=shape, record_rounds=True, info=info)
