"""Loading a draft reads top-down: `from_pretrained` / `from_official` pass through at most 4 modules of the package
and never call back into one they have left; the old module paths are the same objects as the new ones."""

import importlib
import sys

import pytest

from helpers import tiny_draft, tiny_llama
from transformers_poss import PosSDraftModel

MODEL_FILES = {"modeling_poss", "configuration_poss", "modeling_poss_layers"}


def module_walk(load, *args, **kwargs) -> list[str]:
    """The package modules ``load(...)`` calls into, in order: one entry per call from one module into another
    (calls to a module's own helpers and returns are not moves). What transformers / torch run, and what they call
    back (building the config and the model inside ``from_pretrained``), is not the package's plumbing; neither is
    what the model's own methods call (construction, ``attach_target``)."""
    steps, scope = [], set()

    def tracer(frame, event, arg):
        module = frame.f_globals.get("__name__", "")
        if event != "call" or not module.startswith("transformers_poss.") or frame.f_code.co_name == "<module>":
            return None
        module = module.removeprefix("transformers_poss.")
        if not steps:
            steps.append(module)
            scope.add(frame)
            return None
        if frame.f_back not in scope:
            return None
        caller = frame.f_back.f_globals["__name__"].removeprefix("transformers_poss.")
        if caller != module and steps[-1] != module:
            steps.append(module)
        if module not in MODEL_FILES:
            scope.add(frame)
        return None

    sys.settrace(tracer)
    try:
        load(*args, **kwargs)
    finally:
        sys.settrace(None)
    return steps


def _check(steps):
    assert steps[0] == "modeling_poss"
    assert len(set(steps)) <= 4, steps
    assert len(steps) == len(set(steps)), f"climbs back: {' -> '.join(steps)}"


def test_from_pretrained_goes_down_once(tmp_path):
    tiny_draft(tiny_llama()).save_pretrained(tmp_path / "draft")
    PosSDraftModel.from_pretrained(tmp_path / "draft")  # imports done before tracing
    steps = module_walk(PosSDraftModel.from_pretrained, str(tmp_path / "draft"))
    _check(steps)
    assert steps[1] == "checkpoints.loading"


def test_from_official_goes_down_once(tmp_path):
    import json

    from test_official import _official_state, _write
    from test_official_eagle3 import _eagle3_state, _target
    from test_official_eagle3 import _write as _write_eagle3

    target = tiny_llama()
    folder = _write(tmp_path / "PosS2-tiny", _official_state(target, layers=3))
    config = json.loads((folder / "config.json").read_text())  # an exported checkpoint's recorded tree shape
    config["transformers_poss"] = {"generation": {"tree_depth": 4, "tree_top_k": 3, "tree_total_tokens": 12}}
    (folder / "config.json").write_text(json.dumps(config))
    PosSDraftModel.from_official(str(folder), target=target)
    steps = module_walk(PosSDraftModel.from_official, str(folder), target=target, positions_per_specialist=2)
    _check(steps)
    assert steps[1] == "checkpoints.official"
    eagle3_target = _target()
    eagle3 = _write_eagle3(tmp_path / "eagle3", _eagle3_state(eagle3_target))
    _check(module_walk(PosSDraftModel.from_official, str(eagle3), target=eagle3_target))


def test_model_files_use_one_entry_point():
    import ast
    import pathlib

    import transformers_poss

    root = pathlib.Path(transformers_poss.__file__).parent
    for name in MODEL_FILES:
        tree = ast.parse((root / f"{name}.py").read_text())
        sources = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        assert not {s for s in sources if s.startswith("checkpoints.")}, name  # only `from .checkpoints import`


@pytest.mark.parametrize("old, new", [
    ("hub", "checkpoints.hub"), ("model_card", "checkpoints.model_card"), ("loading_checks", "checkpoints.loading"),
    ("official", "checkpoints.official"), ("official_eagle3", "checkpoints.official"),
    ("export", "checkpoints.export"), ("export_eagle3", "checkpoints.export_eagle3"),
    ("folders", "checkpoints.folders"), ("embedded", "targets.embedded"),
])
def test_old_import_paths_re_export(old, new):
    old_module = importlib.import_module(f"transformers_poss.{old}")
    new_module = importlib.import_module(f"transformers_poss.{new}")
    assert old_module is not new_module  # plain modules, no sys.modules swapping
    names = getattr(old_module, "__all__", None)
    assert names
    for name in names:
        assert getattr(old_module, name) is getattr(new_module, name), name


def test_embedded_load_target_import():
    from transformers_poss.embedded import load_target, resolve_target
    from transformers_poss.targets import embedded

    assert load_target is embedded.load_target and resolve_target is embedded.resolve_target
