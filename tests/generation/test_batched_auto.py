"""The automatic budget with B > 1 rows on a CPU decodes plainly (batched speculation loses there); a fixed tree
still speculates. Both are identical to plain batched generate."""

import torch

from helpers import tiny_draft, tiny_llama
from transformers_poss.bench.batched import markdown


def _batch():
    torch.manual_seed(0)
    ids = torch.randint(3, 100, (3, 7))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    return dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)


def test_auto_budget_decodes_cpu_batches_plainly(caplog):
    target = tiny_llama()
    draft = tiny_draft(target)
    plain = target.generate(**_batch())
    draft.generation_config.tree_total_tokens = "auto"
    out = target.generate(**_batch(), assistant_model=draft, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    assert out.acceptance.fell_back_to_plain and not out.acceptance.position_proposed  # nothing drafted
    draft.generation_config.tree_total_tokens = 8  # a fixed tree: batched speculation as asked
    out = target.generate(**_batch(), assistant_model=draft, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain) and out.acceptance.position_proposed


def test_bench_table_names_the_nodes_per_row():
    entry = dict(batch_size=2, method="poss", tokens_per_s=1.0, speedup=1.0, mean_acceptance_length=None,
                 identical_rows=2, rows=2)
    table = markdown({"results": [dict(entry, tree_total_tokens_per_row="plain (auto)"),
                                  dict(entry, tree_total_tokens_per_row=8)]})
    assert "| plain (auto) |" in table and "| 8 |" in table
