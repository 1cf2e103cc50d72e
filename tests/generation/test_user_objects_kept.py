"""`generate` gives the caller's draft back as it came: dtype, device and weights (a bf16 draft beside an fp32
target is run in fp32 for the call only)."""

import torch

from helpers import tiny_draft
from transformers_poss.generation import generate as poss_generate
from tree_testing import one_thread, tiny_llama_target  # noqa: F401 - autouse fixture


def _bf16_draft(target):
    draft = tiny_draft(target).to(torch.bfloat16)
    draft.generation_config.tree_total_tokens = 8
    return draft


def _snapshot(draft):
    return {name: value.clone() for name, value in draft.state_dict().items()}


def _assert_unchanged(draft, before):
    after = draft.state_dict()
    assert set(after) == set(before)
    for name, value in before.items():
        assert after[name].dtype == value.dtype and torch.equal(after[name], value), name


def test_bf16_draft_stays_bf16_after_generate(tmp_path):
    target = tiny_llama_target()
    draft = _bf16_draft(target)
    before = _snapshot(draft)
    prompt = torch.randint(3, 96, (1, 7), generator=torch.Generator().manual_seed(1))
    plain = target.generate(prompt, max_new_tokens=10, do_sample=False)
    assert torch.equal(target.generate(prompt, assistant_model=draft, max_new_tokens=10, do_sample=False), plain)
    _assert_unchanged(draft, before)
    batch = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(2))  # the batched loop too
    target.generate(batch, attention_mask=torch.ones_like(batch), assistant_model=draft, max_new_tokens=6,
                    do_sample=False)  # fmt: skip
    _assert_unchanged(draft, before)
    target.generate(prompt, custom_generate=poss_generate, draft=draft, max_new_tokens=6)
    _assert_unchanged(draft, before)
    draft.save_pretrained(tmp_path / "d")
    assert (tmp_path / "d" / "model.safetensors").stat().st_size < 1.2 * sum(
        v.numel() * 2 for v in before.values() if v.is_floating_point()
    )


def test_draft_restored_after_an_error():
    target = tiny_llama_target()
    draft = _bf16_draft(target)
    before = _snapshot(draft)
    prompt = torch.randint(3, 96, (1, 7), generator=torch.Generator().manual_seed(1))

    class Boom(RuntimeError):
        pass

    def stop(*args, **kwargs):
        raise Boom()

    from transformers import StoppingCriteria, StoppingCriteriaList

    class Raise(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            stop()

    try:
        target.generate(prompt, assistant_model=draft, max_new_tokens=6, do_sample=False,
                        stopping_criteria=StoppingCriteriaList([Raise()]))  # fmt: skip
    except Boom:
        pass
    _assert_unchanged(draft, before)
