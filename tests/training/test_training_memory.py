"""Training lets malloc keep freed memory for reuse: fewer page faults, applied only when asked, never on import."""

import subprocess
import sys
import textwrap

import pytest

from helpers import motif_sequences, tiny_draft, tiny_llama
from transformers_poss.training import memory
from transformers_poss.training import trainer as trainer_module
from transformers_poss.training.trainer import PosSTrainer, PosSTrainingArguments

FAULTS = textwrap.dedent("""
    import resource, sys
    import torch
    import transformers_poss.training  # importing changes nothing: the faults below depend on the call only
    from transformers_poss.training.memory import keep_freed_memory
    applied = keep_freed_memory() if sys.argv[1] == "on" else False
    faults = []
    for _ in range(6):  # a step's pattern: a large tensor (64 MiB, above malloc's largest mmap threshold) and a small one
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        large = torch.empty(16 * 2**20).fill_(1.0)
        small = torch.empty(2**20).fill_(1.0)
        del large, small
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(applied, min(faults[3:]))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc only")
def test_freed_memory_is_reused_without_page_faults():
    def run(mode):
        out = subprocess.run([sys.executable, "-c", FAULTS, mode], capture_output=True, text=True, check=True)
        applied, faults = out.stdout.split()
        return applied == "True", int(faults)

    pages = 16 * 2**20 * 4 // 4096
    applied, faults = run("on")
    if not applied:
        pytest.skip("not glibc")
    assert faults < pages // 10  # the 64 MiB come back from the heap: at most a few pages touched anew
    assert run("off") == (False, pytest.approx(pages, rel=0.2))  # by default every repetition faults them all in


def test_other_platforms_are_left_alone(monkeypatch):
    memory.keep_freed_memory.cache_clear()
    monkeypatch.setattr(memory.sys, "platform", "darwin")
    try:
        assert memory.keep_freed_memory() is False
    finally:
        memory.keep_freed_memory.cache_clear()


@pytest.mark.parametrize("keep", [True, False])
def test_trainer_applies_it_only_when_asked(tmp_path, monkeypatch, keep):
    calls = []
    monkeypatch.setattr(trainer_module, "keep_freed_memory", lambda: calls.append(1) or True)
    target = tiny_llama()
    draft = tiny_draft(target, num_specialists=1, positions_per_specialist=1).train()
    args = PosSTrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=1,
                                 save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True, bf16=False,
                                 keep_freed_memory=keep)
    assert not calls  # building the arguments and the trainer changes nothing
    trainer = PosSTrainer(model=draft, args=args, target=target, train_dataset=motif_sequences(4, 0, 128))
    assert not calls
    trainer.train()
    assert calls == ([1] if keep else [])
