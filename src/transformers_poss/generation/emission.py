"""Emission of generated tokens in the tree loop: through ``generate``'s stopping criteria, streamer and score records,
one token at a time, so that a stop inside an accepted run truncates exactly where plain decoding stops."""

from __future__ import annotations

import torch


class Emitter:
    """Appends tokens one at a time through the stopping criteria, streamer and score records of ``generate``."""

    def __init__(self, input_ids, stopping_criteria, streamer, scores, raw_logits):
        self.input_ids = input_ids
        self.stopping_criteria = stopping_criteria
        self.streamer = streamer
        self.scores = scores
        self.raw_logits = raw_logits
        self.finished = False

    def emit(self, tokens: torch.LongTensor, scores: torch.Tensor, raw_logits: torch.Tensor) -> int:
        """Append ``tokens`` ([k]) until a stopping criterion fires; return how many were appended."""
        count = 0
        for i in range(tokens.shape[0]):
            self.input_ids = torch.cat([self.input_ids, tokens[i : i + 1].view(1, 1)], dim=-1)
            if self.scores is not None:
                self.scores += (scores[i : i + 1],)
            if self.raw_logits is not None:
                self.raw_logits += (raw_logits[i : i + 1],)
            count += 1
            if bool(self.stopping_criteria(self.input_ids, self.scores).all()):
                self.finished = True
                break
        if self.streamer is not None:
            self.streamer.put(tokens[:count].view(1, -1).cpu())
        return count


def first_token(logits: torch.Tensor, input_ids: torch.LongTensor, logits_processor, do_sample: bool):
    """The first new token from the prefill's last logits `[1, vocab]`, chosen as plain decoding does.

    Returns:
        `(token [1], processed scores [1, vocab])`.
    """
    scores = logits_processor(input_ids, logits)
    if do_sample:
        token = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1)[:, 0]
    else:
        token = scores.argmax(dim=-1)
    return token, scores
