"""Two processes (DDP over gloo on CPU) train the same draft, including with a specialist that is never run."""

import json
import os
import signal
import subprocess
import sys

import pytest

from helpers import tiny_draft, tiny_llama

WORKER = os.path.join(os.path.dirname(__file__), "training_ddp_worker.py")


def _kill_workers(process, tmp_path):
    """Kill the launcher's process group and every worker process started for ``tmp_path``."""
    if process is not None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                cmdline = handle.read().decode(errors="replace")
        except OSError:
            continue
        if WORKER in cmdline and str(tmp_path) in cmdline:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.parametrize("unrolled_steps", [2, 1])
def test_two_process_gloo_training(tmp_path, unrolled_steps):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               WORKER, str(tmp_path), str(unrolled_steps)]
    log = tmp_path / "launcher.log"
    with open(log, "w") as handle:  # a file, not a pipe: a worker left behind cannot block the test on it
        process = subprocess.Popen(command, env=env, stdout=handle, stderr=subprocess.STDOUT, text=True,
                                   start_new_session=True)
        try:
            process.wait(timeout=180)
        except subprocess.TimeoutExpired:
            _kill_workers(process, tmp_path)
            raise
        finally:
            _kill_workers(None, tmp_path)  # workers re-parented away from the launcher's group, if any
    stderr = log.read_text()
    assert process.returncode == 0, stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["world_size"] == 2
    assert ranks[0]["fc"] == pytest.approx(ranks[1]["fc"], rel=0, abs=1e-9)  # replicas stay in sync
    assert ranks[0]["eval_acc_1"] == ranks[1]["eval_acc_1"]  # evaluation counts are summed over both processes
    initial = tiny_draft(tiny_llama(), num_specialists=2, positions_per_specialist=1)
    assert ranks[0]["fc"] != pytest.approx(initial.fc.weight.double().sum().item(), abs=1e-6)
    unused = unrolled_steps == 1  # specialist 1 never runs: DDP must be told to look for unused parameters
    assert ranks[0]["find_unused"] is unused
    untouched = initial.layers[1].mlp.up_proj.weight.double().sum().item()
    assert (ranks[0]["layer1"] == pytest.approx(untouched, abs=1e-9)) is unused
