"""`poss bench --batch-size B [B ...]`: throughput of plain batched ``generate`` vs batched tree speculation.

For each batch size ``B`` the prompts are cut into consecutive batches of ``B`` left-padded rows. On every batch the
baseline (plain ``generate``) and each draft run back to back, the order alternating from batch to batch, so drift of
a shared machine hits all methods alike. Throughput is the batch's new tokens (each row counted up to its own stop,
padding excluded) over the wall-clock time of the call. Greedy rows must equal the baseline's rows token for token.

The tree shape given (or the draft's own) is the single-row budget; with B rows each row's tree gets
``generation.batched.batch_total_tokens(total_tokens, top_k, B)`` nodes (see docs/generation.md).
"""

from __future__ import annotations

import time

import torch

from ..configuration_poss import DEFAULT_TREE_SHAPE
from ..generation.batched import batch_total_tokens
from .methods import tree_shape
from .runtime import synchronize

ACCEPTANCE_NOTE = "mean_acceptance_length: tokens per row per target forward, bonus token included (+1 convention)"


def pad_batch(prompts, pad_token_id: int):
    """Left-pad `Prompt`s into `[B, T]` ids and attention mask."""
    width = max(int(p.input_ids.shape[1]) for p in prompts)
    device = prompts[0].input_ids.device
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for i, prompt in enumerate(prompts):
        length = int(prompt.input_ids.shape[1])
        ids[i, width - length :] = prompt.input_ids[0]
        mask[i, width - length :] = 1 if prompt.attention_mask is None else prompt.attention_mask[0]
    return ids, mask


def row_tokens(sequence: list[int], eos_ids: set[int]) -> list[int]:
    """A row's new tokens up to and including its first EOS (the padding after it excluded)."""
    for index, token in enumerate(sequence):
        if token in eos_ids:
            return sequence[: index + 1]
    return sequence


def _eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set() if eos is None else set(eos if isinstance(eos, (list, tuple)) else [eos])


def _run(model, ids, mask, settings, pad_token_id, draft=None):
    kwargs = {"attention_mask": mask, "pad_token_id": pad_token_id, **settings.generate_kwargs()}
    if draft is not None:
        kwargs.update(assistant_model=draft, return_dict_in_generate=True)
    synchronize(ids.device)
    start = time.perf_counter()
    out = model.generate(ids, **kwargs)
    synchronize(ids.device)
    seconds = time.perf_counter() - start
    sequences = out.sequences if draft is not None else out
    eos = _eos_ids(model)
    rows = [row_tokens(row, eos) for row in sequences[:, ids.shape[1] :].tolist()]
    lengths = out.acceptance.accepted_lengths if draft is not None else None
    return rows, seconds, lengths


def run_batched(model, prompts, drafts: dict, settings, batch_sizes, pad_token_id: int, shape: dict | None = None,
                seed: int = 0, warmup: bool = True) -> dict:  # fmt: skip
    """Measure every batch size. ``drafts``: name -> PosS draft. Returns the report's ``batched`` section."""
    shape = dict(shape or {})
    entries = []
    for batch_size in batch_sizes:
        batches = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
        names = ["baseline", *drafts]
        totals = {name: {"tokens": 0, "seconds": 0.0, "rounds": [], "identical": 0, "rows": 0} for name in names}
        for name, draft in drafts.items():
            with tree_shape(draft, **shape):
                if warmup:
                    ids, mask = pad_batch(batches[0], pad_token_id)
                    short = type(settings)(min(8, settings.max_new_tokens), settings.temperature, settings.top_p,
                                           settings.top_k)  # fmt: skip
                    _run(model, ids, mask, short, pad_token_id)
                    _run(model, ids, mask, short, pad_token_id, draft)
        for index, batch in enumerate(batches):
            ids, mask = pad_batch(batch, pad_token_id)
            order = names if index % 2 == 0 else names[::-1]
            results = {}
            for name in order:
                torch.manual_seed(seed + index)
                draft = drafts.get(name)
                if draft is None:
                    results[name] = _run(model, ids, mask, settings, pad_token_id)
                    continue
                with tree_shape(draft, **shape):
                    results[name] = _run(model, ids, mask, settings, pad_token_id, draft)
            reference = results["baseline"][0]
            for name, (rows, seconds, lengths) in results.items():
                total = totals[name]
                total["tokens"] += sum(len(row) for row in rows)
                total["seconds"] += seconds
                total["rounds"] += lengths or []
                total["identical"] += sum(row == ref for row, ref in zip(rows, reference))
                total["rows"] += len(rows)
        base_speed = totals["baseline"]["tokens"] / max(totals["baseline"]["seconds"], 1e-9)
        for name in names:
            total = totals[name]
            speed = total["tokens"] / max(total["seconds"], 1e-9)
            entry = {"batch_size": batch_size, "method": name, "batches": len(batches), "rows": total["rows"],
                     "new_tokens": total["tokens"], "seconds": round(total["seconds"], 4),
                     "tokens_per_s": round(speed, 3), "speedup": round(speed / base_speed, 4),
                     "identical_rows": total["identical"], "identical_to_baseline": total["identical"] == total["rows"],
                     "mean_acceptance_length": None, "tree_total_tokens_per_row": None}  # fmt: skip
            if name in drafts:
                rounds = total["rounds"]
                entry["mean_acceptance_length"] = round(sum(rounds) / len(rounds), 4) if rounds else None
                config = drafts[name].generation_config
                total_tokens = shape.get("total_tokens") or config.tree_total_tokens
                top_k = shape.get("top_k") or config.tree_top_k
                if total_tokens == "auto" and batch_size > 1 and next(model.parameters()).device.type == "cpu":
                    entry["tree_total_tokens_per_row"] = "plain (auto)"  # the budget decodes CPU batches plainly
                elif total_tokens == "auto":
                    entry["tree_total_tokens_per_row"] = batch_total_tokens(DEFAULT_TREE_SHAPE["tree_total_tokens"],
                                                                            top_k, batch_size)
                else:
                    entry["tree_total_tokens_per_row"] = batch_total_tokens(total_tokens, top_k, batch_size)
            entries.append(entry)
    return {"batch_sizes": list(batch_sizes), "results": entries, "acceptance_convention": ACCEPTANCE_NOTE}


def methods_summary(batched: dict) -> dict:
    """The report's ``methods`` section in batch mode: per method, its results per batch size."""
    methods = {}
    for entry in batched["results"]:
        method = methods.setdefault(entry["method"], {"batch_sizes": {}, "prompts": 0, "identical_to_baseline": 0})
        method["batch_sizes"][entry["batch_size"]] = entry
        method["prompts"] += entry["rows"]
        method["identical_to_baseline"] += entry["identical_rows"]
    for method in methods.values():
        first = next(iter(method["batch_sizes"].values()))
        method.update(tokens_per_s=first["tokens_per_s"], speedup=first["speedup"],
                      mean_acceptance_length=first["mean_acceptance_length"], position_acceptance=None)
    return methods


def markdown(batched: dict) -> str:
    """One line per (batch size, method): tokens/s over the batch, speed-up over plain batched generate."""
    lines = ["| batch size | method | tree nodes / row | tokens/s | speed-up | mean acc. length | identical rows |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for e in batched["results"]:
        lines.append(f"| {e['batch_size']} | {e['method']} | {e['tree_total_tokens_per_row'] or '-'} "
                     f"| {e['tokens_per_s']:.1f} | {e['speedup']:.2f}x | {e['mean_acceptance_length'] or '-'} "
                     f"| {e['identical_rows']}/{e['rows']} |")
    return "\n".join(lines)
