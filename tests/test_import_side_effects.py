"""Importing the package changes nothing process-wide: environment, threads, global torch settings."""

import json
import os
import subprocess
import sys

from transformers_poss.cli import take_wait_policy

PROBE = r"""
import json, os, sys
env_before = dict(os.environ)
import torch
state_before = (torch.get_num_threads(), torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled(),
                torch.backends.quantized.engine, torch.is_grad_enabled())
import transformers_poss  # noqa: F401
state_after = (torch.get_num_threads(), torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled(),
               torch.backends.quantized.engine, torch.is_grad_enabled())
changed = sorted(k for k in set(env_before) | set(os.environ) if env_before.get(k) != os.environ.get(k))
print(json.dumps({"changed": changed, "same_state": [str(a) == str(b) for a, b in zip(state_before, state_after)]}))
"""

PROBE_FIRST = r"""
import json, os
env_before = dict(os.environ)
import transformers_poss  # noqa: F401  (before torch: nothing may be set for torch to pick up)
changed = sorted(k for k in set(env_before) | set(os.environ) if env_before.get(k) != os.environ.get(k))
print(json.dumps({"changed": changed}))
"""


def _run(code: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMP_")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_import_leaves_environment_and_torch_settings_unchanged():
    result = _run(PROBE)
    assert result["changed"] == []
    assert all(result["same_state"]), result


def test_import_before_torch_sets_no_openmp_variable():
    assert _run(PROBE_FIRST)["changed"] == []


def test_wait_policy_flag_is_taken_anywhere_in_both_spellings():
    assert take_wait_policy(["bench", "--omp-wait-policy", "passive", "--x"]) == (["bench", "--x"], "passive")
    assert take_wait_policy(["--omp_wait_policy=ACTIVE", "demo"]) == (["demo"], "active")
    assert take_wait_policy(["demo"]) == (["demo"], None)


def test_wait_policy_flag_reaches_the_restarted_command():
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMP_")}
    done = subprocess.run([sys.executable, "-m", "transformers_poss", "--omp-wait-policy", "passive", "--version"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "transformers-poss" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "transformers_poss", "--omp-wait-policy", "sometimes", "--version"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode != 0 and "sometimes" in bad.stderr and "Traceback" not in bad.stderr
