"""The cost profile is an optimisation: a cache folder that cannot be created or written gives a warning, the
measured profile is kept in memory for the process, and `generate` goes on (lossless)."""

import os

import pytest
import torch

from helpers import tiny_draft, tiny_llama
from transformers_poss.generation import cost_profile


def _auto_draft(target):
    draft = tiny_draft(target)
    draft.generation_config.tree_total_tokens = "auto"
    draft.generation_config.tree_max_total_tokens = 8
    return draft


def _generate(target, draft):
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(3))
    plain = target.generate(ids, max_new_tokens=16, do_sample=False)
    assert torch.equal(target.generate(ids, assistant_model=draft, max_new_tokens=16, do_sample=False), plain)


def test_cache_folder_that_cannot_be_created(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder would go")
    monkeypatch.setenv("POSS_CACHE", str(blocker / "cache"))
    monkeypatch.setattr(cost_profile, "_UNCACHED", {})
    target = tiny_llama()
    draft = _auto_draft(target)
    with pytest.warns(UserWarning, match="Cannot create the cost-profile cache folder.*POSS_CACHE"):
        _generate(target, draft)
    assert len(cost_profile._UNCACHED) == 1
    measured = []
    monkeypatch.setattr(cost_profile, "measure_verify_seconds", lambda *a, **k: measured.append(1))
    _generate(target, draft)  # the profile kept in memory: no second measurement, no second warning
    assert not measured
    assert blocker.read_text().startswith("a file")


def test_cache_file_that_cannot_be_written(tmp_path, monkeypatch):
    monkeypatch.setenv("POSS_CACHE", str(tmp_path))
    monkeypatch.setattr(cost_profile, "_UNCACHED", {})

    def refuse(src, dst):
        raise PermissionError(13, "Permission denied", dst)

    monkeypatch.setattr(cost_profile.os, "replace", refuse)
    target = tiny_llama()
    with pytest.warns(UserWarning, match="Cannot write the cost profile"):
        _generate(target, _auto_draft(target))
    assert os.listdir(tmp_path / "costs") == []  # no temporary file left behind
    assert len(cost_profile._UNCACHED) == 1
