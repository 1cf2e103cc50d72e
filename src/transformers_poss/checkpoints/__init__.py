"""How a draft enters and leaves the library: loading, checking, converting and exporting checkpoints.

- `loading`: ``from_pretrained`` of a saved draft: checks of the folder before transformers reads it and of the
  model after, then the tree shape, card and training recipe saved beside the weights;
- `hub`, `model_card`: ``save_pretrained`` / ``push_to_hub`` (the files that travel with a draft, uploads, the
  Trainer's card hook) and the draft's model card;
- `official`: the checkpoints released with the PosS paper, EAGLE / HASS and EAGLE-3 ones, in (``from_official``);
- `export`, `export_eagle3`: drafts out, as EAGLE / EAGLE-3 checkpoints for vLLM / SGLang and as ``custom_generate``
  folders (`poss export`);
- `folders`: output folders written as a whole (no overwrite without ``--overwrite``, staged writes).

The model files reach this package through the names below only (``PosSDraftModel.from_pretrained``,
``save_pretrained``, ``push_to_hub``, ``from_official``); `export` and `export_eagle3` load drafts themselves, so
they are imported from their modules, never from here.
"""

from .hub import push_draft_to_hub, save_pretrained_with_card
from .loading import load_pretrained
from .official import OfficialCheckpoint, read_official

__all__ = ["OfficialCheckpoint", "load_pretrained", "push_draft_to_hub", "read_official", "save_pretrained_with_card"]
