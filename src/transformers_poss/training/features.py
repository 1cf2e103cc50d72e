"""Offline target features: safetensors shards computed once, read memory-mapped.

Shards hold only what the loss needs, per stored token: its id (int32), its assistant flag (uint8) and the target
features (bf16 by default), plus sequence offsets (int64). A single-feature draft stores f_t: ``hidden_size * 2 + 5``
bytes per token, 1.13 MiB per 1k tokens for SmolLM2-135M (H = 576), 8.0 MiB for an 8B Llama (H = 4096).

A draft with ``feature_layers`` (k target layers, EAGLE-3 style) stores the k hidden states concatenated,
``hidden_states`` `[N, k * H]`, and the post-norm feature ``last_hidden_state`` `[N, H]` that the token loss needs
(its soft labels are the target's ``lm_head`` of it), unless the post-norm layer is one of the k, whose slot is then
read instead: ``(k + 1) * H * 2 + 5`` bytes per token (4.4 MiB per 1k tokens for SmolLM2 with layers [2, 15, 27]).
``features.json`` and each shard's metadata record the layers. A draft reading a subset of the stored layers (in any
order, and the post-norm layer ``num_hidden_layers`` beside them) reads a view of the same folder, and so does a
single-feature draft (the post-norm feature alone; `FeatureShardDataset.can_serve`); a draft of another layout is
refused.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers.utils import logging
from transformers.utils.logging import tqdm  # off with transformers' switch (`poss --no-progress`)

from .feature_inputs import (PosSDataCollator, TargetFeatures, batch_to, check_feature_layout, describe_layers,
                             draft_feature_layers, draft_inputs)

__all__ = ["TargetFeatures", "PosSDataCollator", "batch_to", "draft_inputs", "write_feature_shards",
           "FeatureShardDataset", "check_feature_layout", "draft_feature_layers", "stored_feature_layers",
           "target_fingerprint"]

INDEX_FILE = "features.json"
_UNSET = object()

logger = logging.get_logger(__name__)


def target_fingerprint(target) -> str:
    """A digest identifying the target's features: its config, and a sample of every weight tensor (dtype, shape
    and up to 64 strided values), so a retrained, re-quantized or different target gives a different digest."""
    import hashlib

    digest = hashlib.sha256()
    config = getattr(target, "config", None)
    digest.update((config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else "").encode())
    for name, tensor in list(target.state_dict().items()):
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
        if tensor.device.type != "meta" and tensor.numel() and (tensor.is_floating_point() or tensor.dtype == torch.int8):
            flat = tensor.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 64)][:64].to(device="cpu", dtype=torch.float64)
            digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:32]


def _layers_text(layers) -> str:
    return json.dumps(list(layers) if layers else None)


def stored_feature_layers(directory):
    """The layers of the features in ``directory`` (None: the post-norm feature; also for shards written before
    multi-layer features existed), or the marker ``_UNSET`` when it holds no features yet."""
    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.exists():
        return json.loads(index.read_text()).get("feature_layers")
    first = directory / "shard-00000.safetensors"
    if first.exists():
        try:
            with safe_open(str(first), framework="pt") as handle:
                return json.loads((handle.metadata() or {}).get("feature_layers", "null"))
        except Exception:  # an unreadable shard is recomputed
            return _UNSET
    return _UNSET


def _write_shard(path: Path, items: list[dict], features: list[torch.Tensor], dtype, fingerprint: str | None = None,
                 last: list[torch.Tensor] | None = None, layers=None):
    lengths = torch.tensor([0] + [len(i["input_ids"]) for i in items])
    tensors = {
        "input_ids": torch.cat([torch.as_tensor(i["input_ids"]) for i in items]).to(torch.int32),
        "assistant_mask": torch.cat([torch.as_tensor(i["assistant_mask"]) for i in items]).to(torch.uint8),
        "hidden_states": torch.cat(features).to(dtype).contiguous(),
        "offsets": torch.cumsum(lengths, 0),
    }
    if last is not None:
        tensors["last_hidden_state"] = torch.cat(last).to(dtype).contiguous()
    metadata = {"target_fingerprint": fingerprint} if fingerprint else {}
    if layers:
        metadata["feature_layers"] = _layers_text(layers)
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=metadata or None)
    os.replace(tmp, path)


def _shard_matches(path: Path, items: list[dict], fingerprint: str | None = None, layers=None) -> bool:
    """True when ``path`` exists and stores exactly these sequences (same tokens and assistant masks) computed by the
    same target (``fingerprint``, see `target_fingerprint`) for the same layers, so a resumed run reuses it; a shard
    left from other data (a grown or reshuffled data set) or from another target is recomputed."""
    if not path.exists():
        return False
    try:
        with safe_open(str(path), framework="pt") as handle:
            stored_ids, stored_mask = handle.get_tensor("input_ids"), handle.get_tensor("assistant_mask")
            metadata = handle.metadata() or {}
    except Exception:  # a truncated or unreadable shard is recomputed
        return False
    if fingerprint is not None and metadata.get("target_fingerprint") != fingerprint:
        return False
    if metadata.get("feature_layers", "null") != _layers_text(layers):
        return False
    ids = torch.cat([torch.as_tensor(i["input_ids"]) for i in items]).to(torch.int32)
    mask = torch.cat([torch.as_tensor(i["assistant_mask"]) for i in items]).to(torch.uint8)
    return torch.equal(stored_ids, ids) and torch.equal(stored_mask, mask)


def _holds_view(directory: Path, dataset, fingerprint: str, layers, num_hidden_layers) -> bool:
    """True when ``directory`` holds finished features of other layers that serve ``layers`` (a view,
    `FeatureShardDataset.can_serve`), computed by the same target for exactly these sequences."""
    if not (directory / INDEX_FILE).exists():
        return False
    stored = FeatureShardDataset(directory)
    if not stored.can_serve(layers, num_hidden_layers) or len(stored) != len(dataset):
        return False
    start = 0
    for shard in stored.index["shards"]:
        items = [dataset[i] for i in range(start, start + shard["sequences"])]
        if not _shard_matches(directory / shard["file"], items, fingerprint, stored.stored_layers):
            return False
        start += shard["sequences"]
    return True


def write_feature_shards(target, dataset, output_dir, batch_size: int = 8, sequences_per_shard: int = 512,
                         dtype: torch.dtype = torch.bfloat16, device=None, progress: bool = True,
                         feature_layers: list[int] | None = None, autocast: bool = False) -> dict:
    """Precompute target features of a tokenized dataset into ``output_dir/shard-XXXXX.safetensors``.

    Resumable: finished shards (written atomically) that hold the same sequences are skipped. Sequences of a shard
    are run through the target in length-sorted batches to limit padding.

    Args:
        target: the target causal LM (or a PeftModel around one).
        dataset: items ``{"input_ids": [L], "assistant_mask": [L]}`` (e.g. a [`ConversationDataset`]).
        dtype: storage dtype of the features (bf16 halves the disk size of fp32).
        feature_layers: the target layers the draft reads (its ``config.feature_layers``); None: the post-norm
            feature. A folder holding features of other layers is left as it is when it serves these layers for
            exactly these sequences (a view, see `FeatureShardDataset`), else refused (give another ``output_dir``).
        autocast: run the target under bf16 autocast (1.7-1.8x faster on a 2-core CPU with bf16 units; the features
            then differ from float32 ones by about 1% in relative norm). Part of the shards' fingerprint, so
            switching it recomputes them.
    Returns:
        the index written to ``output_dir/features.json``.
    """
    output_dir = Path(output_dir)
    layers = list(feature_layers) if feature_layers else None
    existing = stored_feature_layers(output_dir)
    fingerprint = target_fingerprint(target) + ("|bf16-autocast" if autocast else "")
    compute = TargetFeatures(target, layers)
    if existing is not _UNSET and (list(existing) if existing else None) != layers:
        if _holds_view(output_dir, dataset, fingerprint, layers, compute.num_hidden_layers):
            return json.loads((output_dir / INDEX_FILE).read_text())  # read as a view: nothing to write
        raise ValueError(f"{output_dir} holds target features of {describe_layers(existing)}, not "
                         f"{describe_layers(layers)}: write these features into another folder (--features_dir), or "
                         "delete that folder.")
    output_dir.mkdir(parents=True, exist_ok=True)
    # the post-norm feature is stored on its own only when it is not one of the selected layers (then its slot is
    # read): the exact soft labels need it, and an H-wide bf16 row is far smaller than the target's logits or top-k
    slot = layers.index(compute.num_hidden_layers) if layers and compute.num_hidden_layers in layers else None
    store_last = bool(layers) and slot is None
    device = device or next(target.parameters()).device
    device_type = torch.device(device).type
    total = len(dataset)
    shards = []
    bar = tqdm(total=total, desc="target features", unit="seq", disable=not progress)
    report = _ShardReport(total, -(-total // sequences_per_shard), output_dir, quiet=not progress or not bar.disable)
    for shard_index, start in enumerate(range(0, total, sequences_per_shard)):
        path = output_dir / f"shard-{shard_index:05d}.safetensors"
        items = [dataset[i] for i in range(start, min(total, start + sequences_per_shard))]
        tokens = sum(len(i["input_ids"]) for i in items)
        computed = not _shard_matches(path, items, fingerprint, layers)
        if computed:
            features, last = [None] * len(items), [None] * len(items)
            order = sorted(range(len(items)), key=lambda i: len(items[i]["input_ids"]))
            for b in range(0, len(order), batch_size):
                chosen = order[b : b + batch_size]
                batch = PosSDataCollator()([items[i] for i in chosen])
                with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):
                    out, post = compute.compute(batch["tokens"].to(device), batch["attention_mask"].to(device))
                out, post = out.cpu(), post.cpu()
                for row, i in enumerate(chosen):
                    features[i] = out[row, : len(items[i]["input_ids"])]
                    last[i] = post[row, : len(items[i]["input_ids"])]
            _write_shard(path, items, features, dtype, fingerprint, last if store_last else None, layers)
        shards.append({"file": path.name, "sequences": len(items), "tokens": tokens})
        bar.update(len(items))
        report.shard_done(len(items), tokens, computed)
    bar.close()
    config = getattr(target, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = getattr(text, "hidden_size", None)
    index = {
        "shards": shards,
        "num_sequences": total,
        "num_tokens": sum(s["tokens"] for s in shards),
        "hidden_size": hidden,
        "dtype": str(dtype).replace("torch.", ""),
        "target": getattr(config, "_name_or_path", None),
        "target_fingerprint": fingerprint,
        "feature_layers": layers,
    }
    if layers:
        index["feature_size"] = len(layers) * hidden
        index["last_hidden_state"] = "stored" if store_last else {"slot": slot}
    (output_dir / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return index


class _ShardReport:
    """One log line per shard computed (where no progress bar shows, e.g. output to a log file): sequences done, the
    rate of the shards computed in this call and the time left at that rate."""

    def __init__(self, total: int, num_shards: int, output_dir: Path, quiet: bool):
        self.total, self.num_shards, self.name, self.quiet = total, num_shards, output_dir.name, quiet
        self.done = self.shards = self.computed = self.tokens = 0
        self.seconds, self.last = 0.0, time.perf_counter()

    def shard_done(self, sequences: int, tokens: int, computed: bool) -> None:
        now = time.perf_counter()
        self.done, self.shards = self.done + sequences, self.shards + 1
        if computed:
            self.computed, self.tokens = self.computed + sequences, self.tokens + tokens
            self.seconds += now - self.last
        self.last = now
        if self.quiet or not computed or self.seconds <= 0:
            return
        left = (self.total - self.done) * self.seconds / self.computed
        logger.info(f"target features ({self.name}): shard {self.shards}/{self.num_shards}, {self.done}/{self.total} "
                    f"sequences, {self.tokens / self.seconds:,.0f} tokens/s, about {left / 60:.0f} min left")


class FeatureShardDataset(torch.utils.data.Dataset):
    """Sequences stored by [`write_feature_shards`]; items ``{"input_ids", "assistant_mask", "hidden_states"}``, plus
    ``"last_hidden_state"`` (the post-norm features `[L, H]`) for multi-layer features.

    Tensors are read lazily (memory-mapped) per item, so datasets larger than memory work. ``feature_layers``, when
    given (a list, or None for the post-norm feature), are the layers the items hold: the stored layers, or a view of
    them (`can_serve`; ``num_hidden_layers``, the target's layer count, names the post-norm layer); other layers are
    refused with a ValueError saying what to do.
    """

    def __init__(self, directory, feature_layers=_UNSET, num_hidden_layers: int | None = None):
        self.directory = Path(directory)
        self.index = json.loads((self.directory / INDEX_FILE).read_text())
        last = self.index.get("last_hidden_state")
        hidden = self.index.get("hidden_size")
        self._last_columns = (last["slot"] * hidden, (last["slot"] + 1) * hidden) if isinstance(last, dict) else None
        # ``hidden_size`` is the target's text hidden size: the width of one stored layer
        self._last_stored = last == "stored"
        self._view = None  # [(stored tensor, first column, end column)] per layer read, when not the stored layout
        self._view_layers = None
        if feature_layers is not _UNSET:
            wanted = draft_feature_layers(feature_layers)
            if wanted != self.stored_layers and self.can_serve(wanted, num_hidden_layers):
                self._view, self._view_layers = self._view_plan(wanted or [None]), wanted
            else:
                check_feature_layout(self.stored_layers, feature_layers, f"the features in {self.directory}")
        self._handles = {}
        self._locations = []  # (shard file, start, end)
        for shard in self.index["shards"]:
            with safe_open(str(self.directory / shard["file"]), framework="pt") as handle:
                offsets = handle.get_tensor("offsets").tolist()
            self._locations += [(shard["file"], a, b) for a, b in zip(offsets[:-1], offsets[1:])]

    @property
    def stored_layers(self) -> list[int] | None:
        """The target layers stored (None: the post-norm feature, as in shards written before layers existed)."""
        return self.index.get("feature_layers")

    @property
    def feature_layers(self) -> list[int] | None:
        """The target layers the items' ``hidden_states`` hold: the stored ones, or those of the view asked for."""
        return self._view_layers if self._view else self.stored_layers

    def can_serve(self, feature_layers, num_hidden_layers: int | None = None) -> bool:
        """Whether a draft reading ``feature_layers`` can read these features: the stored layers, or (multi-layer
        shards, which keep the post-norm feature) any of them in any order, plus the post-norm layer
        ``num_hidden_layers`` (the target's layer count), or the post-norm feature alone (``None``: a single-feature
        draft)."""
        wanted, stored = draft_feature_layers(feature_layers), self.stored_layers
        if wanted == stored:
            return True
        if not stored:
            return False
        if not wanted:
            return True  # multi-layer shards always hold the post-norm feature
        return len(set(wanted)) == len(wanted) and all(i in stored or i == num_hidden_layers for i in wanted)

    def _view_plan(self, wanted: list) -> list[tuple[str, int, int]]:
        hidden, stored = self.index["hidden_size"], self.stored_layers
        plan = []
        for layer in wanted:  # None: the post-norm feature
            if layer is not None and layer in stored:
                slot = stored.index(layer)
                plan.append(("hidden_states", slot * hidden, (slot + 1) * hidden))
            elif self._last_stored:
                plan.append(("last_hidden_state", 0, hidden))
            else:
                plan.append(("hidden_states", *self._last_columns))
        return plan

    def __len__(self) -> int:
        return len(self._locations)

    @property
    def lengths(self) -> list[int]:
        """Tokens of every stored sequence, from the shards' offsets (no features read): what
        ``train_sampling_strategy="group_by_length"`` batches by."""
        return [end - start for _, start, end in self._locations]

    def _handle(self, name):
        if name not in self._handles:
            self._handles[name] = safe_open(str(self.directory / name), framework="pt")
        return self._handles[name]

    def __getitem__(self, index: int) -> dict:
        name, start, end = self._locations[index]
        handle = self._handle(name)
        item = {
            "input_ids": handle.get_slice("input_ids")[start:end].long(),
            "assistant_mask": handle.get_slice("assistant_mask")[start:end].long(),
            "hidden_states": self._read_view(handle, start, end) if self._view else
            handle.get_slice("hidden_states")[start:end],
        }
        if self._view and self._view_layers is None:
            return item  # a single-feature draft's items: its features are the post-norm ones
        if self._last_stored:
            item["last_hidden_state"] = handle.get_slice("last_hidden_state")[start:end]
        elif self._last_columns is not None:
            a, b = self._last_columns
            item["last_hidden_state"] = handle.get_slice("hidden_states")[start:end, a:b]
        return item

    def token_ids(self, index: int) -> torch.LongTensor:
        """The stored token ids of sequence ``index`` (its features are not read)."""
        name, start, end = self._locations[index]
        return self._handle(name).get_slice("input_ids")[start:end].long()

    def _read_view(self, handle, start: int, end: int) -> torch.Tensor:
        """The view's layers of one sequence, `[L, k * H]`."""
        tensors = {name: handle.get_slice(name)[start:end] for name in {name for name, _, _ in self._view}}
        return torch.cat([tensors[name][:, a:b] for name, a, b in self._view], dim=-1)

    def __getstate__(self):  # dataloader workers reopen the files
        state = dict(self.__dict__)
        state["_handles"] = {}
        return state

    @property
    def num_tokens(self) -> int:
        return self.index["num_tokens"]
