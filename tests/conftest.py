import os
import pathlib

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

SHARED = pathlib.Path(__file__).resolve().parents[2] / "shared"
FIXTURES = SHARED / "fixtures" / "official-poss"
MT_BENCH = SHARED / "data" / "mt_bench.jsonl"


def pytest_configure(config):
    config.addinivalue_line("markers", "integration: uses the real embedded targets")


@pytest.fixture
def fixtures_dir():
    if not FIXTURES.exists():
        pytest.skip(f"official fixtures not found at {FIXTURES}")
    return FIXTURES
