"""What ``generate`` returns with a PosS draft and ``return_dict_in_generate=True``."""

from __future__ import annotations

from dataclasses import dataclass

from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..speculation.stats import AcceptanceStats


@dataclass
class PosSGenerateOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` with the acceptance statistics of tree speculative decoding.

    Args:
        acceptance (`AcceptanceStats`): per-round acceptance lengths, position-wise acceptance and phase timings.
    """

    acceptance: AcceptanceStats | None = None
