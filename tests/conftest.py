import os
import pathlib
import sys

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# test modules share helpers across folders (e.g. `from test_generation import ...`): make every folder importable,
# so a single file runs on its own as it does in the whole suite
for _folder in sorted(p for p in pathlib.Path(__file__).resolve().parent.rglob("*") if p.is_dir() and p.name != "__pycache__"):
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))

TESTS = pathlib.Path(__file__).resolve().parent
FIXTURES = TESTS / "fixtures" / "official-poss"  # reference outputs of the authors' draft code (README.md there)
MT_BENCH = TESTS.parent / "src" / "transformers_poss" / "bench" / "data" / "mt_bench.jsonl"  # shipped with the package


def pytest_configure(config):
    config.addinivalue_line("markers", "integration: uses the real embedded targets")


@pytest.fixture
def fixtures_dir():
    return FIXTURES
