"""Target features for training: online (the frozen target runs in the training step) or offline (shards on disk).

Offline shards are safetensors files holding only what the loss needs, per stored token: its id (int32), its
assistant flag (uint8) and the target feature f_t (bf16 by default), plus sequence offsets (int64). On disk that is
``hidden_size * 2 + 5`` bytes per token: 1.13 MiB per 1k tokens for SmolLM2-135M (H = 576), 8.0 MiB per 1k
tokens for an 8B Llama (H = 4096).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from .data import pair_loss_mask

__all__ = ["TargetFeatures", "PosSDataCollator", "batch_to", "draft_inputs", "write_feature_shards", "FeatureShardDataset"]

INDEX_FILE = "features.json"


class TargetFeatures:
    """Computes post-final-norm target features f_t without the lm_head. The target is frozen and put in eval mode.

    Works with a transformers causal LM and with a `peft.PeftModel` around one (adapters stay active).
    """

    def __init__(self, target):
        self.target = target
        target.requires_grad_(False)
        target.eval()
        base = target.get_base_model() if hasattr(target, "get_base_model") else target
        self.decoder = base.get_decoder()

    @torch.no_grad()
    def __call__(self, tokens: torch.LongTensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """`[B, L]` tokens (right-padded) -> `[B, L, H]` features."""
        return self.decoder(input_ids=tokens, attention_mask=attention_mask, use_cache=False).last_hidden_state


def batch_to(batch: dict, device) -> dict:
    """A collated batch with its tensors moved to ``device`` (other entries unchanged)."""
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


def draft_inputs(tokens, loss_mask, features, pad_token_id: int = 0) -> dict:
    """Draft training inputs from a token batch: pair t = (f_t, x_{t+1}); the last pair gets a pad token."""
    next_tokens = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], pad_token_id)], dim=1)
    return {"input_ids": next_tokens, "target_hidden_states": features, "loss_mask": loss_mask}


class PosSDataCollator:
    """Right-pads examples ``{"input_ids": [L], "assistant_mask": [L], ("hidden_states": [L, H])}``.

    With stored features the batch is ready for the draft's forward (``input_ids`` = next tokens,
    ``target_hidden_states``, ``loss_mask``), so a plain Trainer can train on it. Without them the batch carries
    ``tokens``, ``attention_mask`` and ``loss_mask`` for online features ([`PosSTrainer`] adds the features).
    """

    def __init__(self, pad_token_id: int = 0, max_length: int | None = None):
        self.pad_token_id = pad_token_id
        self.max_length = max_length

    def _pad(self, rows, value):
        length = max(r.shape[0] for r in rows)
        out = rows[0].new_full((len(rows), length, *rows[0].shape[1:]), value)
        for i, row in enumerate(rows):
            out[i, : row.shape[0]] = row
        return out

    def __call__(self, examples: list[dict]) -> dict:
        cut = slice(0, self.max_length)
        tokens = self._pad([torch.as_tensor(e["input_ids"])[cut].long() for e in examples], self.pad_token_id)
        assistant = self._pad([torch.as_tensor(e["assistant_mask"])[cut].long() for e in examples], 0)
        attention = self._pad([torch.ones(len(torch.as_tensor(e["input_ids"])[cut]), dtype=torch.long) for e in examples], 0)
        loss_mask = pair_loss_mask(assistant) * attention
        if "hidden_states" in examples[0]:
            features = self._pad([torch.as_tensor(e["hidden_states"])[cut] for e in examples], 0)
            return draft_inputs(tokens, loss_mask, features, self.pad_token_id)
        return {"tokens": tokens, "attention_mask": attention, "loss_mask": loss_mask}


# ---------------------------------------------------------------------------------------------------- offline
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


def _write_shard(path: Path, items: list[dict], features: list[torch.Tensor], dtype, fingerprint: str | None = None):
    lengths = torch.tensor([0] + [len(i["input_ids"]) for i in items])
    tensors = {
        "input_ids": torch.cat([torch.as_tensor(i["input_ids"]) for i in items]).to(torch.int32),
        "assistant_mask": torch.cat([torch.as_tensor(i["assistant_mask"]) for i in items]).to(torch.uint8),
        "hidden_states": torch.cat(features).to(dtype).contiguous(),
        "offsets": torch.cumsum(lengths, 0),
    }
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"target_fingerprint": fingerprint} if fingerprint else None)
    os.replace(tmp, path)


def _shard_matches(path: Path, items: list[dict], fingerprint: str | None = None) -> bool:
    """True when ``path`` exists and stores exactly these sequences (same tokens and assistant masks) computed by the
    same target (``fingerprint``, see `target_fingerprint`), so a resumed run reuses it; a shard left from other data
    (a grown or reshuffled data set) or from another target is recomputed."""
    if not path.exists():
        return False
    try:
        with safe_open(str(path), framework="pt") as handle:
            stored_ids, stored_mask = handle.get_tensor("input_ids"), handle.get_tensor("assistant_mask")
            stored_target = (handle.metadata() or {}).get("target_fingerprint")
    except Exception:  # a truncated or unreadable shard is recomputed
        return False
    if fingerprint is not None and stored_target != fingerprint:
        return False
    ids = torch.cat([torch.as_tensor(i["input_ids"]) for i in items]).to(torch.int32)
    mask = torch.cat([torch.as_tensor(i["assistant_mask"]) for i in items]).to(torch.uint8)
    return torch.equal(stored_ids, ids) and torch.equal(stored_mask, mask)


def write_feature_shards(target, dataset, output_dir, batch_size: int = 8, sequences_per_shard: int = 512,
                         dtype: torch.dtype = torch.bfloat16, device=None, progress: bool = True) -> dict:
    """Precompute target features of a tokenized dataset into ``output_dir/shard-XXXXX.safetensors``.

    Resumable: finished shards (written atomically) that hold the same sequences are skipped. Sequences of a shard are run through the target in
    length-sorted batches to limit padding.

    Args:
        target: the target causal LM (or a PeftModel around one).
        dataset: items ``{"input_ids": [L], "assistant_mask": [L]}`` (e.g. a [`ConversationDataset`]).
        dtype: storage dtype of the features (bf16 halves the disk size of fp32).
    Returns:
        the index written to ``output_dir/features.json``.
    """
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    fingerprint = target_fingerprint(target)
    compute = TargetFeatures(target)
    device = device or next(target.parameters()).device
    total = len(dataset)
    shards = []
    bar = tqdm(total=total, desc="target features", unit="seq", disable=not progress)
    for shard_index, start in enumerate(range(0, total, sequences_per_shard)):
        path = output_dir / f"shard-{shard_index:05d}.safetensors"
        items = [dataset[i] for i in range(start, min(total, start + sequences_per_shard))]
        if not _shard_matches(path, items, fingerprint):
            features = [None] * len(items)
            order = sorted(range(len(items)), key=lambda i: len(items[i]["input_ids"]))
            for b in range(0, len(order), batch_size):
                chosen = order[b : b + batch_size]
                batch = PosSDataCollator()([items[i] for i in chosen])
                out = compute(batch["tokens"].to(device), batch["attention_mask"].to(device)).cpu()
                for row, i in enumerate(chosen):
                    features[i] = out[row, : len(items[i]["input_ids"])]
            _write_shard(path, items, features, dtype, fingerprint)
        shards.append({"file": path.name, "sequences": len(items), "tokens": sum(len(i["input_ids"]) for i in items)})
        bar.update(len(items))
    bar.close()
    config = getattr(target, "config", None)
    index = {
        "shards": shards,
        "num_sequences": total,
        "num_tokens": sum(s["tokens"] for s in shards),
        "hidden_size": getattr(config, "hidden_size", None),
        "dtype": str(dtype).replace("torch.", ""),
        "target": getattr(config, "_name_or_path", None),
        "target_fingerprint": fingerprint,
    }
    (output_dir / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return index


class FeatureShardDataset(torch.utils.data.Dataset):
    """Sequences stored by [`write_feature_shards`]; items ``{"input_ids", "assistant_mask", "hidden_states"}``.

    Tensors are read lazily (memory-mapped) per item, so datasets larger than memory work.
    """

    def __init__(self, directory):
        self.directory = Path(directory)
        self.index = json.loads((self.directory / INDEX_FILE).read_text())
        self._handles = {}
        self._locations = []  # (shard file, start, end)
        for shard in self.index["shards"]:
            with safe_open(str(self.directory / shard["file"]), framework="pt") as handle:
                offsets = handle.get_tensor("offsets").tolist()
            self._locations += [(shard["file"], a, b) for a, b in zip(offsets[:-1], offsets[1:])]

    def __len__(self) -> int:
        return len(self._locations)

    def _handle(self, name):
        if name not in self._handles:
            self._handles[name] = safe_open(str(self.directory / name), framework="pt")
        return self._handles[name]

    def __getitem__(self, index: int) -> dict:
        name, start, end = self._locations[index]
        handle = self._handle(name)
        return {
            "input_ids": handle.get_slice("input_ids")[start:end].long(),
            "assistant_mask": handle.get_slice("assistant_mask")[start:end].long(),
            "hidden_states": handle.get_slice("hidden_states")[start:end],
        }

    def __getstate__(self):  # dataloader workers reopen the files
        state = dict(self.__dict__)
        state["_handles"] = {}
        return state

    @property
    def num_tokens(self) -> int:
        return self.index["num_tokens"]
