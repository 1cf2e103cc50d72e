"""The machine's cost profile: how long verification and drafting take here, measured once and cached.

The best tree is a property of the hardware: on a GPU a 60-node verification costs about as much as one token, on a
CPU the cost grows with the number of nodes. [`load_or_measure_profile`] measures the target's forward time ``t(n)``
for ``n`` tree nodes and the draft's step times once per model / device / dtype / quantization / threads (a
progress bar over the measured points says so), and caches the [`CostProfile`] as JSON under the package cache
(``costs/``); `budget.TreeBudget` and ``poss tune`` read it.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, field

import torch
from transformers.utils import logging

from .._transformers_compat import attn_implementation

logger = logging.get_logger(__name__)

DEFAULT_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)

VERIFY_REPEATS = 3  # timed passes over the sizes (after one warm-up pass); calls check the profile as they run


@dataclass
class CostProfile:
    """Measured costs (seconds) on one machine.

    Attributes:
        key: identifies model, device, dtype, quantization and threads.
        verify_seconds: target forward time for ``n`` new tokens (tree nodes), keyed by ``n`` (as str in JSON).
        draft_context_seconds: a draft context step over a few new pairs, including its top-k.
        draft_step_seconds: one further draft step (frontier of ``top_k`` nodes), including its top-k.
    """

    key: str
    verify_seconds: dict[int, float]
    draft_context_seconds: float = 0.0
    draft_step_seconds: float = 0.0
    meta: dict = field(default_factory=dict)

    def verify(self, n: int) -> float:
        """t(n), linearly interpolated between measured sizes (extrapolated from the last two beyond them)."""
        sizes = sorted(self.verify_seconds)
        if n in self.verify_seconds:
            return self.verify_seconds[n]
        if n <= sizes[0]:
            return self.verify_seconds[sizes[0]]
        lo = max((s for s in sizes if s < n), default=sizes[-2])
        hi = min((s for s in sizes if s > n), default=sizes[-1])
        if lo == hi:
            lo = sizes[-2]
        t_lo, t_hi = self.verify_seconds[lo], self.verify_seconds[hi]
        return t_lo + (t_hi - t_lo) * (n - lo) / (hi - lo)

    def draft(self, depth: int) -> float:
        """Drafting time of a tree of ``depth``."""
        return self.draft_context_seconds + max(depth - 1, 0) * self.draft_step_seconds

    def curve(self) -> dict[int, float]:
        """t(n) / t(1) for every measured n."""
        base = self.verify(1)
        return {n: self.verify_seconds[n] / base for n in sorted(self.verify_seconds)}

    def to_json(self) -> str:
        data = asdict(self)
        data["verify_seconds"] = {str(k): v for k, v in self.verify_seconds.items()}
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "CostProfile":
        data = json.loads(text)
        data["verify_seconds"] = {int(k): float(v) for k, v in data["verify_seconds"].items()}
        return cls(**data)


def usable_profile(profile: CostProfile) -> CostProfile:
    """``profile`` if its times can drive a budget, else a ValueError saying what is wrong (a corrupt cache file)."""
    import math

    times = profile.verify_seconds
    if not isinstance(times, dict) or 1 not in times or len(times) < 2:
        raise ValueError("verification times need n = 1 and at least one larger size")
    if not all(isinstance(t, float) and math.isfinite(t) and t > 0 for t in times.values()):
        raise ValueError("verification times must be positive seconds")
    for name in ("draft_context_seconds", "draft_step_seconds"):
        value = getattr(profile, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be seconds >= 0")
    return profile


def profile_key(target, draft=None, top_k: int | None = None) -> str:
    """A key for the cache: model identity, device, dtype, quantization, threads, torch version."""
    config = target.config.get_text_config()
    head = target.get_output_embeddings()
    parts = [
        getattr(target.config, "_name_or_path", "") or "",
        config.model_type,
        str(config.hidden_size),
        str(getattr(config, "num_hidden_layers", "")),
        str(config.vocab_size),
        str(target.dtype),
        str(next(target.parameters()).device),
        str(getattr(target, "_poss_quantized", None)),
        str(torch.get_num_threads()),
        torch.__version__,
        type(head).__name__,
        str(attn_implementation(config)),
    ]
    if draft is not None:
        parts += [str(draft.config.num_specialists), str(draft.config.draft_vocab_size), str(top_k),
                  str(getattr(draft, "_poss_quantized", None))]
        config = draft.config
        if config.feature_layers is not None or config.layer_style != "eagle2" or config.own_lm_head:
            parts += [str(config.feature_layers), config.layer_style, str(config.own_lm_head)]  # other draft costs
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]


def _timed(fn, repeats: int) -> float:
    values = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        values.append(time.perf_counter() - start)
    return statistics.median(values)


@torch.no_grad()
def measure_verify_seconds(target, sizes=DEFAULT_SIZES, context_length: int = 128, repeats: int = VERIFY_REPEATS,
                           progress=None) -> dict[int, float]:
    """Median time of one target forward over ``n`` new tokens (logits of all of them) on a ``context_length`` cache.

    Sizes are interleaved within each repeat so that machine drift hits all of them alike. ``progress``: a tqdm bar
    advanced by one per forward (``(repeats + 1) * len(sizes)`` in all, the warm-up pass included), or None.
    """
    from transformers import DynamicCache

    device = target.get_input_embeddings().weight.device
    vocab = target.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (1, context_length), generator=generator).to(device)
    cache = DynamicCache(config=target.config.get_text_config(decoder=True))
    target(input_ids=prompt, cache=cache, use_cache=True)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(repeats + 1):  # first pass warms up
        for n in sizes:
            ids = torch.randint(0, vocab, (1, n), generator=generator).to(device)
            positions = torch.arange(context_length, context_length + n, device=device)[None]
            start = time.perf_counter()
            target(input_ids=ids, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=0)
            times[n].append(time.perf_counter() - start)
            cache.crop(-n)
            if progress is not None:
                progress.update()
    return monotone({n: statistics.median(v[1:]) for n, v in times.items()})


def monotone(times: dict[int, float]) -> dict[int, float]:
    """``times`` made non-decreasing in ``n``: each ``t(n)`` becomes the least time measured at ``n`` or more
    tokens. A forward over more tokens never costs less, so a point above a larger one was measured while other work
    ran (on a busy 2-core machine t(3) measured 4.0 s beside t(24) = 0.65 s); left as it is, the budget would never
    verify that many nodes."""
    out, least = {}, float("inf")
    for n in sorted(times, reverse=True):
        least = min(least, times[n])
        out[n] = least
    return dict(sorted(out.items()))


DRAFT_POINTS = 3  # trees `measure_draft_seconds` times


@torch.no_grad()
def measure_draft_seconds(draft, top_k: int, context_length: int = 128, repeats: int = 5,
                          progress=None) -> tuple[float, float]:
    """(context step, further step) drafting times: trees of depth 1 and 3 after a 2-pair context update.

    ``progress``: a tqdm bar advanced by one per measured tree (`DRAFT_POINTS` in all: a warm-up, depth 1, depth 3).
    """
    from ..speculation.drafter import PosSProposer

    device = draft.device
    hidden = draft.config.target_feature_size  # the width of the target features the draft reads
    generator = torch.Generator().manual_seed(0)

    def run(depth):
        proposer = PosSProposer(draft, depth=depth, top_k=top_k, total_tokens=depth + 1)  # all `depth` levels drafted
        ids = torch.randint(0, draft.config.vocab_size, (1, context_length), generator=generator).to(device)
        proposer.propose(ids, torch.randn(1, context_length, hidden, generator=generator).to(device))
        new_ids, new_feats = ids[:, :2], torch.randn(1, 2, hidden, generator=generator).to(device)
        seconds = _timed(lambda: proposer.propose(new_ids, new_feats), repeats)
        if progress is not None:
            progress.update()
        return seconds

    run(1)  # warm-up
    one, three = run(1), run(3)
    return one, max((three - one) / 2, 0.0)


def cache_dir() -> str:
    from ..targets.embedded import cache_root

    path = os.path.join(str(cache_root()), "costs")
    os.makedirs(path, exist_ok=True)
    return path


def load_or_measure_profile(target, draft=None, top_k: int = 10, sizes=DEFAULT_SIZES, refresh: bool = False,
                            progress: bool = True) -> CostProfile:
    """The cached cost profile of ``target`` (+ ``draft``) on this machine, measuring it on first use (seconds).

    A measurement shows a progress bar over its points (transformers' tqdm, "measuring verification cost t(n) (once,
    cached at PATH)"): off with ``progress=False`` or transformers' switch
    (``transformers.utils.logging.disable_progress_bar()``, ``HF_HUB_DISABLE_PROGRESS_BARS=1``). A cached profile is
    read back without measuring; ``refresh=True`` measures again.
    """
    key = profile_key(target, draft, top_k)
    try:
        path = os.path.join(cache_dir(), f"{key}.json")
    except OSError as error:  # the cache is an optimisation: measure, keep the profile in this process, go on
        path = None
        if refresh or key not in _UNCACHED:
            warnings.warn(f"Cannot create the cost-profile cache folder ({error}); the profile is measured and kept "
                          "in memory for this process only. Set POSS_CACHE to a writable folder to keep it.",
                          stacklevel=2)
    if path is None and not refresh and key in _UNCACHED:
        return _UNCACHED[key]
    if path is not None and not refresh and os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as fh:
                return usable_profile(CostProfile.from_json(fh.read()))
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as error:  # unreadable: measure again
            warnings.warn(f"The cached cost profile {path} is unusable ({error}); measuring it again.", stacklevel=2)
    points = (VERIFY_REPEATS + 1) * len(sizes) + (DRAFT_POINTS if draft is not None else 0)
    where = f"cached at {path}" if path else "kept in memory"
    with logging.tqdm(total=points, desc=f"measuring verification cost t(n) (once, {where})",
                      unit="point", disable=not progress) as bar:
        verify = measure_verify_seconds(target, sizes, progress=bar)
        context, step = measure_draft_seconds(draft, top_k, progress=bar) if draft is not None else (0.0, 0.0)
    profile = CostProfile(key=key, verify_seconds=verify, draft_context_seconds=context, draft_step_seconds=step,
                          meta={"threads": torch.get_num_threads(), "top_k": top_k})
    if path is None:
        _UNCACHED[key] = profile
        return profile
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(profile.to_json())
        os.replace(tmp, path)
    except OSError as error:  # read-only or full disk: keep the measurement for this process
        warnings.warn(f"Cannot write the cost profile {path} ({error}); it is kept in memory for this process only. "
                      "Set POSS_CACHE to a writable folder to keep it.", stacklevel=2)
        _UNCACHED[key] = profile
        if os.path.exists(tmp):
            os.remove(tmp)
    return profile


def forget_profile(key: str, reason: str) -> None:
    """Drop the cached profile ``key`` (file and memory), so that the next call measures it again."""
    _UNCACHED.pop(key, None)
    try:
        path = os.path.join(cache_dir(), f"{key}.json")
        if os.path.exists(path):
            os.remove(path)
    except OSError:
        return
    logger.info("cost profile %s no longer matches this machine (%s); it is measured again at the next call", key,
                reason)


# profiles measured in this process that could not be written to the cache folder (profile key -> profile)
_UNCACHED: dict[str, CostProfile] = {}


__all__ = ["DEFAULT_SIZES", "CostProfile", "cache_dir", "forget_profile", "load_or_measure_profile", "measure_draft_seconds",
           "measure_verify_seconds", "profile_key", "usable_profile"]
