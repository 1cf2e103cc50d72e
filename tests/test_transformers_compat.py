"""The one seam to transformers' private internals: checked at import, one clear error when something changed."""

import importlib

import pytest
from transformers.generation.utils import GenerationMixin

import transformers_poss
from transformers_poss import _transformers_compat as compat


def test_installed_transformers_is_compatible():
    assert compat.incompatibilities() == []


def test_trainer_methods_of_the_atomic_checkpoints_are_checked(monkeypatch):
    from transformers import Trainer

    compat.check_trainer()
    monkeypatch.delattr(Trainer, "_get_output_dir")
    with pytest.raises(ImportError, match="Trainer._get_output_dir is missing"):
        compat.check_trainer()


def test_a_missing_private_method_gives_one_clear_import_error(monkeypatch):
    monkeypatch.delattr(GenerationMixin, "_prefill")
    with pytest.raises(ImportError) as error:
        importlib.reload(compat)
    message = str(error.value)
    assert "GenerationMixin._prefill is missing" in message
    assert compat.SUPPORTED_TRANSFORMERS in message and ">=5.24,<6" in message


def test_a_changed_signature_is_named(monkeypatch):
    original = GenerationMixin._update_model_kwargs_for_generation

    def renamed(self, outputs, model_kwargs, is_encoder_decoder=False, new_tokens=1):
        return original(self, outputs, model_kwargs, is_encoder_decoder, new_tokens)

    monkeypatch.setattr(GenerationMixin, "_update_model_kwargs_for_generation", renamed)
    problems = compat.incompatibilities()
    assert problems == ["GenerationMixin._update_model_kwargs_for_generation has no parameter(s) num_new_tokens"]
    with pytest.raises(ImportError, match="num_new_tokens"):
        compat.check_transformers()


def test_no_other_module_uses_private_transformers_methods():
    """Every call of a checked private name goes through the seam."""
    import pathlib
    import re

    names = [name for _, name in compat.EXPECTED_PARAMETERS] + ["_attn_implementation", "_pad_token_tensor",
                                                                 "_mask_length"]
    pattern = re.compile(r"(?<!self)\.(" + "|".join(names) + r")\b")  # self._x: the package's own methods
    root = pathlib.Path(transformers_poss.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        if path.name == "_transformers_compat.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if pattern.search(code) and "``" not in code and not code.strip().startswith(('"', "'")):
                offenders.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    assert offenders == []
