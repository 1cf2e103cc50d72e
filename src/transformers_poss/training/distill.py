"""Self-distillation data: the target answers the prompts itself, so the draft learns the target's own outputs.

- [`regenerate`]: keep the system/user turns of conversations, regenerate every assistant turn with the target
  (batched ``generate``, turn by turn, conversations of similar length together). Resumable JSONL output.
- [`synthesize_prompts`]: without any dataset, sample user turns from the target itself: the chat template is
  rendered up to where a user message starts and the target continues from there. Empty, truncated, degenerate and
  duplicate prompts are dropped. Resumable JSONL output. ``categories`` (e.g. [`REQUEST_CATEGORIES`]) steer the
  prompts toward the kinds of requests users send, one system instruction per category, taken in turn.
- [`synthesize_followups`]: the target writes the next user turn of answered conversations (follow-up questions),
  for [`regenerate`] to answer.

Evaluation prompts (MT-Bench and the like) must never be fed here; ``exclude`` removes given prompts explicitly.
"""

from __future__ import annotations

import json
import os
import re
import time

import torch
from tqdm.auto import tqdm
from transformers import LogitsProcessor, LogitsProcessorList

from ..speculation.sampled_drafter import DraftWarping
from ..speculation.target_cache import growing_cache

__all__ = [
    "user_prefix",
    "end_of_turn_ids",
    "is_degenerate",
    "synthesize_prompts",
    "synthesize_followups",
    "REQUEST_CATEGORIES",
    "regenerate",
    "read_jsonl",
    "int8_copy",
]

_SENTINEL = "\u2063POSS_USER_TURN\u2063"
_END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>", "</s>")


# Kinds of requests users send, each with the instruction that makes the target write such a request as the user.
REQUEST_CATEGORIES = {
    "writing": "You are a user of an AI assistant. Ask it to write something: a story, poem, email, speech or post.",
    "roleplay": "You are a user of an AI assistant. Ask it to play a character or role and answer as that character.",
    "reasoning": "You are a user of an AI assistant. Ask it a puzzle or a question that needs step-by-step reasoning.",
    "math": "You are a user of an AI assistant. Ask it to solve a math problem: arithmetic, algebra, geometry or "
            "probability.",
    "coding": "You are a user of an AI assistant. Ask it to write, explain or fix a short piece of code.",
    "extraction": "You are a user of an AI assistant. Give it a short text and ask it to extract, list or summarise "
                  "facts from it.",
    "stem": "You are a user of an AI assistant. Ask it a question about science, engineering or technology.",
    "humanities": "You are a user of an AI assistant. Ask it about history, philosophy, art, economics or society.",
    "short": "You are a user of an AI assistant. Ask a quick question that needs a one-sentence answer.",
    "long": "You are a user of an AI assistant. Ask for a detailed, thorough explanation or a long piece of text.",
}


def read_jsonl(path) -> list[dict]:
    """Records of a JSONL file (none when it does not exist).

    A last line cut off by a kill while appending is dropped (and removed from the file, so appending resumes
    cleanly); any other line that is not valid JSON is an error naming the file and line.
    """
    from ..textfiles import is_gzip, read_lines

    if not os.path.exists(path):
        return []
    lines = [line for _, line in read_lines(path)]  # plain or gzip-compressed (`.jsonl.gz`)
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            if number == len(lines) and not line.endswith("\n") and not is_gzip(path):
                import warnings

                warnings.warn(f"{path}:{number}: dropping a line cut off by an interrupted run.", stacklevel=2)
                with open(path, "w", encoding="utf-8") as handle:
                    handle.writelines(lines[:-1])
                break
            raise ValueError(f"{path}:{number}: not valid JSON ({error.msg} at column {error.colno}); fix or remove "
                             "the line.") from None
    return records


def _append_jsonl(path, records):
    with open(path, "a", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")


def int8_copy(model):
    """A copy of ``model`` with int8 dynamic-quantized Linear layers (CPU, fbgemm) for faster generation.

    About 2x faster per decoding step than fp32 on a 2-core AVX2 CPU at batch 64. Its outputs differ from the fp32
    model's, so the draft then learns a slightly different distribution than the one it will draft for.
    """
    import copy

    return torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), {torch.nn.Linear}, dtype=torch.qint8)


def user_prefix(tokenizer, chat_template=None, system_prompt: str | None = None) -> str:
    """Chat-template text up to where the content of the first user message starts."""
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": _SENTINEL}
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, chat_template=chat_template)
    if _SENTINEL not in text:
        raise ValueError("The chat template does not show the user message verbatim; cannot find the user prefix.")
    return text[: text.index(_SENTINEL)]


def end_of_turn_ids(tokenizer, model=None) -> list[int]:
    """Token ids that end a turn: the eos token(s) and the usual end-of-turn markers present in the vocabulary."""
    ids = set()
    for source in (tokenizer.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    vocab = tokenizer.get_vocab()
    ids.update(vocab[m] for m in _END_MARKERS if m in vocab)
    return sorted(ids)


def is_degenerate(text: str, min_words: int = 3, max_chars: int = 2000) -> bool:
    """Empty, too short/long, containing template markup, or repetitive text."""
    words = text.split()
    if len(words) < min_words or len(text) > max_chars or "<|" in text or "|>" in text:
        return True
    if len(words) >= 8 and len(set(words)) / len(words) < 0.4:
        return True
    trigrams = [tuple(words[i : i + 3]) for i in range(len(words) - 2)]
    return len(trigrams) >= 6 and len(set(trigrams)) / len(trigrams) < 0.6


def _normalized(text: str) -> str:
    return re.sub(r"\W+", " ", text.lower()).strip()


SAMPLING_TOP_K = 50  # transformers' default top-k for sampling, used where the target's generation config sets none


class SampleAmongCandidates(LogitsProcessor):
    """Draws the next token inside the logits processor, from the ``top_k`` candidates only: the distribution of
    transformers' temperature -> top-k -> top-p sampling, without sorting the whole vocabulary for top-p or drawing
    over it (about a third of a batch-96 decode step of the 49k-vocabulary SmolLM2 target on a CPU). Returns logits
    that are 0 at the drawn token and ``-inf`` elsewhere, for a greedy ``generate`` to pick. ``top_k=0``: the whole
    vocabulary, as in transformers."""

    def __init__(self, temperature: float, top_p: float, top_k: int = SAMPLING_TOP_K):
        self.warping = DraftWarping(temperature, top_k if top_k else 2**62, top_p)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        logprobs, ids = self.warping.candidates(scores)  # [B, k] each
        drawn = ids.gather(-1, torch.multinomial(logprobs.exp(), 1))  # [B, 1]
        return torch.full_like(scores, float("-inf")).scatter_(-1, drawn, 0.0)


@torch.no_grad()
def _generate(target, tokenizer, texts, stop_ids, max_new_tokens, temperature, top_p, segment_tokens=None):
    """Batched generation from rendered texts (left padding). Returns (new token id lists, finished flags).

    With ``segment_tokens``, the batch generates that many tokens at a time: after each segment the rows that stopped
    leave, and the others go on from their prompt plus what they wrote so far (a fresh prefill). A batch then no
    longer decodes padding behind rows that finished long ago, which dominates when answer lengths spread widely.
    Each row still follows the target's own greedy or sampled continuation of its context.
    """
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    stops = set(stop_ids)
    sampling = dict(do_sample=False)
    if temperature > 0:
        top_k = getattr(target.generation_config, "top_k", None)
        top_k = SAMPLING_TOP_K if top_k is None else top_k
        sampling["logits_processor"] = LogitsProcessorList([SampleAmongCandidates(temperature, top_p, top_k)])
    new: list[list[int]] = [[] for _ in texts]
    finished = [False] * len(texts)
    active = list(range(len(texts)))
    while active:
        budget = min(segment_tokens or max_new_tokens, max_new_tokens - len(new[active[0]]))  # equal for all active
        rows = [prompts[i] + new[i] for i in active]
        width = max(len(r) for r in rows)
        input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=target.device)
        attention_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=target.device)
        # a cache that grows in place: appending with torch.cat copied the whole cache at every step (`growing_cache`)
        out = target.generate(input_ids=input_ids, attention_mask=attention_mask, cache=growing_cache(target),
                              max_new_tokens=budget, eos_token_id=stop_ids, pad_token_id=pad, **sampling)
        for i, row in zip(active, out[:, width:].tolist()):
            end = next((k for k, t in enumerate(row) if t in stops), None)
            # a row without a stop token wrote all `budget` tokens: generation only ends early once every row stopped
            new[i] += row if end is None else row[:end]
            finished[i] = end is not None
        active = [i for i in active if not finished[i] and len(new[i]) < max_new_tokens]
    return new, finished


def synthesize_prompts(target, tokenizer, num_prompts: int, output_path, batch_size: int = 16,
                       max_new_tokens: int = 96, temperature: float = 1.0, top_p: float = 0.95, seed: int = 0,
                       exclude=(), chat_template=None, max_rounds: int | None = None, progress: bool = True,
                       categories: dict[str, str] | None = None, segment_tokens: int | None = None) -> list[str]:
    """Sample ``num_prompts`` distinct user prompts from the target; appended to ``output_path`` as
    ``{"prompt": ...}`` lines (plus ``"category"`` when ``categories`` are given). Already written prompts count
    (resume). Returns all prompts in the file.

    ``categories`` maps a name to a system instruction that asks the target, writing as the user, for that kind of
    request; rounds take the categories in turn, so every kind is represented. Without it the user turn is sampled
    from the bare template. ``segment_tokens`` lets rows that stopped leave the batch every that many tokens (see
    ``_generate``).
    """
    names = list(categories or {None: None})
    prefixes = {name: user_prefix(tokenizer, chat_template, categories[name] if name else None) for name in names}
    stop_ids = end_of_turn_ids(tokenizer, target)
    records = read_jsonl(output_path)
    prompts = [r["prompt"] for r in records]
    seen = {_normalized(p) for p in prompts} | {_normalized(p) for p in exclude}
    bar = tqdm(total=num_prompts, initial=min(len(prompts), num_prompts), desc="prompts", disable=not progress)
    rounds = 0
    while len(prompts) < num_prompts and (max_rounds is None or rounds < max_rounds):
        name = names[(len(records) + rounds) % len(names)]
        torch.manual_seed(seed + len(prompts) * 7919 + rounds)
        rows, finished = _generate(target, tokenizer, [prefixes[name]] * batch_size, stop_ids, max_new_tokens,
                                   temperature, top_p, segment_tokens)
        rounds += 1
        fresh = []
        for row, done in zip(rows, finished):
            text = tokenizer.decode(row, skip_special_tokens=True).strip()
            key = _normalized(text)
            if done and not is_degenerate(text) and key not in seen:
                seen.add(key)
                fresh.append(text)
        fresh = fresh[: num_prompts - len(prompts)]
        _append_jsonl(output_path, [{"prompt": p} | ({"category": name} if name else {}) for p in fresh])
        prompts += fresh
        bar.update(len(fresh))
    bar.close()
    return prompts


def _next_user_prefix(tokenizer, messages, chat_template=None) -> str:
    """Chat-template text of ``messages`` up to where the content of the next user message starts."""
    text = tokenizer.apply_chat_template(list(messages) + [{"role": "user", "content": _SENTINEL}], tokenize=False,
                                         chat_template=chat_template)
    if _SENTINEL not in text:
        raise ValueError("The chat template does not show the user message verbatim; cannot find the user prefix.")
    return text[: text.index(_SENTINEL)]


def synthesize_followups(target, tokenizer, conversations, batch_size: int = 16, max_new_tokens: int = 96,
                         temperature: float = 1.0, top_p: float = 0.95, seed: int = 0, exclude=(),
                         chat_template=None, keep_answers: bool = False) -> list[list[dict] | None]:
    """A follow-up user turn for each answered conversation, written by the target as the user.

    Returns, per conversation, its system/user turns plus the follow-up, or ``None`` where the target wrote nothing
    usable (unfinished, degenerate, a repeat of an earlier turn, or an excluded prompt). The assistant turns are
    dropped, ready for [`regenerate`] to answer every turn, or kept with ``keep_answers=True`` (then
    ``regenerate(..., keep_answers=True)`` answers only the follow-up).
    """
    stop_ids = end_of_turn_ids(tokenizer, target)
    excluded = {_normalized(p) for p in exclude}
    out: list[list[dict] | None] = []
    for start in range(0, len(conversations), batch_size):
        chunk = conversations[start : start + batch_size]
        torch.manual_seed(seed + start)
        texts = [_next_user_prefix(tokenizer, c, chat_template) for c in chunk]
        rows, finished = _generate(target, tokenizer, texts, stop_ids, max_new_tokens, temperature, top_p)
        for conversation, row, done in zip(chunk, rows, finished):
            text = tokenizer.decode(row, skip_special_tokens=True).strip()
            earlier = {_normalized(m["content"]) for m in conversation if m["role"] == "user"}
            key = _normalized(text)
            if not done or is_degenerate(text) or key in earlier or key in excluded:
                out.append(None)
                continue
            kept = list(conversation) if keep_answers else [m for m in conversation if m["role"] != "assistant"]
            out.append(kept + [{"role": "user", "content": text}])
    return out


def _user_turns(messages: list[dict], keep_answers: bool) -> list[tuple[dict, dict | None]]:
    """``(user message, the assistant message answering it or None)`` per user turn; answers are only kept with
    ``keep_answers`` (otherwise every turn is answered anew)."""
    turns: list[tuple[dict, dict | None]] = []
    for message in messages:
        if message["role"] == "user":
            turns.append((message, None))
        elif message["role"] == "assistant" and keep_answers and turns and turns[-1][1] is None:
            turns[-1] = (turns[-1][0], message)
    return turns


def regenerate(target, tokenizer, conversations, output_path, batch_size: int = 16, max_new_tokens: int = 512,
               temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, chat_template=None,
               progress: bool = True, segment_tokens: int | None = None, keep_answers: bool = False) -> dict:
    """Regenerate the assistant turns of ``conversations`` (lists of messages, or bare prompt strings).

    Each finished conversation is appended to ``output_path`` as ``{"id": index, "messages": [...]}`` (with
    ``"sampling": {"temperature", "top_p"}`` when ``temperature > 0``); ids already in the file are skipped
    (resume). ``segment_tokens`` lets finished rows leave a batch every that many tokens (see ``_generate``).
    With ``keep_answers``, an assistant message that follows a user turn is kept as it is and only user turns
    without an answer are answered (e.g. a follow-up question to a conversation answered before).
    Returns ``{"conversations", "generated_tokens", "seconds", "tokens_per_s"}``.
    """
    if segment_tokens is not None and segment_tokens < 1:
        raise ValueError(f"segment_tokens must be a positive number of tokens or None, got {segment_tokens}.")
    conversations = [[{"role": "user", "content": c}] if isinstance(c, str) else c for c in conversations]
    done = {r["id"] for r in read_jsonl(output_path)}
    todo = [i for i in range(len(conversations)) if i not in done]
    stop_ids = end_of_turn_ids(tokenizer, target)

    def prompt_length(i):
        first_user = next((m["content"] for m in conversations[i] if m["role"] == "user"), "")
        return len(first_user)

    todo.sort(key=prompt_length)
    sampled = {"sampling": {"temperature": temperature, "top_p": top_p}} if temperature > 0 else {}  # per record
    generated, start = 0, time.perf_counter()
    bar = tqdm(total=len(conversations), initial=len(done), desc="self-distillation", unit="conv", disable=not progress)
    for b in range(0, len(todo), batch_size):
        chunk = todo[b : b + batch_size]
        torch.manual_seed(seed + b)
        histories = {i: [m for m in conversations[i] if m["role"] == "system"] for i in chunk}
        turns = {i: _user_turns(conversations[i], keep_answers) for i in chunk}
        for turn in range(max(len(t) for t in turns.values())):
            active = [i for i in chunk if turn < len(turns[i])]
            for i in active:
                histories[i].append(turns[i][turn][0])
            asking = [i for i in active if turns[i][turn][1] is None]
            texts = [tokenizer.apply_chat_template(histories[i], tokenize=False, add_generation_prompt=True,
                                                   chat_template=chat_template) for i in asking]
            rows, _ = _generate(target, tokenizer, texts, stop_ids, max_new_tokens, temperature, top_p,
                                segment_tokens) if asking else ([], [])
            answers = {i: turns[i][turn][1] for i in active}
            for i, row in zip(asking, rows):
                generated += len(row) + 1
                answers[i] = {"role": "assistant", "content": tokenizer.decode(row, skip_special_tokens=True).strip()}
            for i in active:
                histories[i].append(answers[i])
        _append_jsonl(output_path, [{"id": i, "messages": histories[i], **sampled} for i in chunk])
        bar.update(len(chunk))
        seconds = time.perf_counter() - start
        bar.set_postfix(tok_s=f"{generated / max(seconds, 1e-9):.1f}")
    bar.close()
    seconds = time.perf_counter() - start
    return {"conversations": len(todo), "generated_tokens": generated, "seconds": seconds,
            "tokens_per_s": generated / seconds if seconds else 0.0}
