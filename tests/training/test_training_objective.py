"""The multi-step training objective: the chain property, masking, gradients and loss behaviour."""

import pytest
import torch

from helpers import FEATURE_VARIANTS, randomize_norms, tiny_draft, tiny_llama
from transformers_poss import PosSDraftCache, PosSProposer
from transformers_poss.modeling_poss_layers import causal_mask
from transformers_poss.training.objective import ObjectiveConfig, step_attention_mask, unroll


def _sequential_depth_features(draft, input_ids, features, context_end, steps):
    """Sequential drafting along the chain given by ``input_ids``, one step at a time with each specialist's KV cache
    (the draft's building blocks, as its forward and the drafter use them).

    Context pairs 0..context_end are accepted (target features `[1, T, config.target_feature_size]`, fused first);
    depth d + 1 feeds the pair (previous output, x_{context_end + d + 1}). Returns the predicted feature at depths
    1..steps, each `[1, H]`.
    """
    config = draft.config
    cache = PosSDraftCache(config.num_specialists)
    seen = [0] * config.num_specialists
    context = slice(0, context_end + 1)
    rows = [draft.fuse(input_ids[:, context], draft.fuse_target_features(features[:, context]))]
    results = []
    for step in range(steps):
        if step > 0:
            position = context_end + step
            rows.append(draft.fuse(input_ids[:, position : position + 1], results[-1][:, None]))
        hidden = torch.cat(rows, dim=1)
        specialist = config.specialist_for_step(step)
        start = seen[specialist]
        new = hidden[:, start:]
        emb = draft.position_embeddings(new, torch.arange(start, hidden.shape[1])[None])
        layer = draft.layers[specialist]
        keys, values = cache.update(specialist, *layer.project_kv(new, emb))
        out = layer(new, emb, keys, values, causal_mask(new.shape[1], start, new.device))
        seen[specialist] = hidden.shape[1]
        results.append(out[:, -1])
    return results


# (feature variant of helpers.FEATURE_VARIANTS or None: the post-norm feature, S, N)
CHAIN_CASES = [(None, 1, 1), (None, 1, 3), (None, 2, 1), (None, 3, 2), ("eagle2-fl", 3, 2), ("eagle2-fl", 1, 3),
               ("eagle3-fl", 2, 2), ("eagle3-post-norm", 1, 3)]


def _chain_draft(variant, specialists, per):
    if variant is None:
        target = tiny_llama()
        return target, tiny_draft(target, num_specialists=specialists, positions_per_specialist=per)
    target = tiny_llama(layers=4)
    draft = tiny_draft(target, num_specialists=specialists, positions_per_specialist=per, **FEATURE_VARIANTS[variant])
    return target, randomize_norms(draft)


@pytest.mark.parametrize("variant,specialists,per", CHAIN_CASES)
def test_chain_property_matches_cached_drafting(variant, specialists, per):
    """Step k of the training unroll at position t = sequential drafting at depth k + 1 after accepting up to t - k,
    for drafts reading the post-norm feature and several target layers (EAGLE-3 style), in both layer styles."""
    target, draft = _chain_draft(variant, specialists, per)
    steps = draft.config.training_depth
    length = 24
    torch.manual_seed(3)
    input_ids = torch.randint(0, 128, (1, length))
    features = torch.randn(1, length, draft.config.target_feature_size)
    with torch.no_grad():
        outputs = unroll(draft, input_ids, features, steps, chunk_size=7)
        for t in range(steps, length):
            for k in range(steps):
                reference = _sequential_depth_features(draft, input_ids, features, t - k, k + 1)[k]
                torch.testing.assert_close(outputs[k][:, t], reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant,specialists,per", [(None, 2, 1), (None, 3, 2), ("eagle2-fl", 3, 2),
                                                     ("eagle3-fl", 2, 2)])
def test_chain_property_matches_tree_proposer(variant, specialists, per):
    """Along the proposer's own top-1 chain, step k at position c + k reproduces its token and log-prob."""
    target, draft = _chain_draft(variant, specialists, per)
    steps = draft.config.training_depth
    torch.manual_seed(5)
    context = 9  # pairs 0..context-1 accepted; the last one holds the root
    input_ids = torch.randint(0, 128, (1, context + steps))
    features = torch.randn(1, context + steps, draft.config.target_feature_size)
    proposer = PosSProposer(draft, depth=steps, top_k=1, total_tokens=steps + 1)
    tree = proposer.propose(input_ids[:, :context], features[:, :context])
    assert tree.parents.tolist() == [-1] + list(range(steps))  # a chain
    drafted = tree.tokens[1:]
    input_ids[0, context : context + steps - 1] = drafted[:-1]  # pair c + j carries drafted token j
    with torch.no_grad():
        outputs = unroll(draft, input_ids, features, steps, chunk_size=5)
        c = context - 1
        logps = [torch.log_softmax(draft.compute_logits(outputs[k][0, c + k]), -1) for k in range(steps)]
    assert [int(lp.argmax()) for lp in logps] == drafted.tolist()
    cumulative = torch.cumsum(torch.stack([lp[tok] for lp, tok in zip(logps, drafted)]), 0)
    torch.testing.assert_close(cumulative, tree.scores[1:].float(), rtol=1e-5, atol=1e-5)


def test_default_attention_chunks_change_no_output():
    """Steps >= 1 attend in chunks of ``attention_chunk_size`` queries (64 by default): sequences longer than several
    chunks give the outputs of one chunk holding every query, and gradients match too."""
    target = tiny_llama()
    draft = tiny_draft(target, num_specialists=2, positions_per_specialist=2).double()
    torch.manual_seed(4)
    ids, feats = torch.randint(0, 128, (2, 150)), torch.randn(2, 150, 64, dtype=torch.float64)
    assert ObjectiveConfig().attention_chunk_size == 64
    outputs = unroll(draft, ids, feats, 4)
    whole = unroll(draft, ids, feats, 4, chunk_size=150)
    for chunked, single in zip(outputs, whole):
        torch.testing.assert_close(chunked, single, rtol=1e-10, atol=1e-10)
    grads = []
    for chunk in (64, 150):
        draft.zero_grad()
        draft(ids, feats, loss_mask=torch.ones(2, 150), objective=ObjectiveConfig(noise="none",
              attention_chunk_size=chunk)).loss.backward()
        grads.append(draft.layers[1].mlp.up_proj.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("fused", [True, False])  # chunked labels beside the fused loss / whole logits (top-k term)
@pytest.mark.parametrize("setting,training,autocast,expected", [
    (True, True, True, True),     # training under autocast: the soft labels too
    (False, True, True, False),   # turned off: float32 soft labels
    (True, False, True, False),   # evaluation: always float32
    (True, True, False, False),   # no autocast at all
])
def test_soft_labels_follow_the_step_autocast_only_in_training(monkeypatch, setting, training, autocast, expected,
                                                               fused):
    from transformers_poss.training import objective as objective_module

    seen = []  # True where the labels' head product ran in the step's autocast dtype (float16 here, not bfloat16)
    real = objective_module.soft_label_logits

    def recording(draft, features):
        seen.append(torch.is_autocast_enabled("cpu"))
        if seen[-1]:
            assert torch.get_autocast_dtype("cpu") == torch.float16
        return real(draft, features)

    class RecordingLabels(objective_module.SoftLabels):
        def __init__(self, features, weight, bias, compute_dtype):
            assert compute_dtype in (torch.float16, torch.float32)
            seen.append(compute_dtype == torch.float16)
            super().__init__(features, weight, bias, compute_dtype)

    monkeypatch.setattr(objective_module, "soft_label_logits", recording)
    monkeypatch.setattr(objective_module, "SoftLabels", RecordingLabels)
    target = tiny_llama()
    draft = tiny_draft(target, num_specialists=1, positions_per_specialist=1).train(training)
    ids, feats = torch.randint(0, 128, (2, 12)), torch.randn(2, 12, 64)
    objective = ObjectiveConfig(soft_label_autocast=setting, topk_weight=0.0 if fused else 0.5)
    with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
        out = draft(ids, feats, loss_mask=torch.ones(2, 12), objective=objective)
    assert seen == [expected]
    assert torch.isfinite(out.loss)


def test_step_mask_rows():
    mask, ranges = step_attention_mask(2, 0, 6, 6, "cpu")
    # query 4 at step 2: context pairs 0..2, the step-1 row at 3 and the step-2 row at 4 (itself)
    keys = [(block, pos) for block, a, b in ranges for pos in range(a, b)]
    seen = {keys[i] for i in mask[0, 0, 4].nonzero().flatten().tolist()}
    assert seen == {(0, 0), (0, 1), (0, 2), (1, 3), (2, 4)}
    assert mask[0, 0].any(-1).all()  # every query sees at least itself (no NaN rows)


def test_gradients_reach_only_the_step_specialist_and_fc():
    target = tiny_llama()
    draft = tiny_draft(target, num_specialists=3, positions_per_specialist=1).train()
    torch.manual_seed(0)
    ids, feats = torch.randint(0, 128, (2, 12)), torch.randn(2, 12, 64)
    mask = torch.ones(2, 12)
    for k in range(3):
        draft.zero_grad()
        weights = [1.0 if j == k else 0.0 for j in range(3)]
        draft(ids, feats, loss_mask=mask, objective=ObjectiveConfig(step_weights=weights, noise="none")).loss.backward()
        touched = [s for s in range(3) if draft.layers[s].mlp.up_proj.weight.grad is not None
                   and draft.layers[s].mlp.up_proj.weight.grad.abs().sum() > 0]
        assert touched == [k]
        assert draft.fc.weight.grad.abs().sum() > 0


def test_loss_mask_and_padding_positions_do_not_matter():
    target = tiny_llama()
    draft = tiny_draft(target, num_specialists=2, positions_per_specialist=1)
    torch.manual_seed(1)
    ids, feats = torch.randint(0, 128, (1, 10)), torch.randn(1, 10, 64)
    mask = torch.zeros(1, 10)
    mask[:, 3:7] = 1
    base = draft(ids, feats, loss_mask=mask).loss
    # right padding: more positions after the masked ones (causal attention never looks ahead)
    padded = draft(torch.cat([ids, torch.zeros(1, 5, dtype=torch.long)], 1),
                   torch.cat([feats, torch.randn(1, 5, 64)], 1), loss_mask=torch.cat([mask, torch.zeros(1, 5)], 1)).loss
    torch.testing.assert_close(base, padded)
    # changing a feature at an unmasked later position changes nothing; at a masked target it does
    later = feats.clone()
    later[:, 9] += 1.0
    torch.testing.assert_close(draft(ids, later, loss_mask=mask).loss, base)
    target_change = feats.clone()
    target_change[:, 5] += 1.0
    assert not torch.allclose(draft(ids, target_change, loss_mask=mask).loss, base)


def test_metrics_and_topk_term():
    target = tiny_llama()
    draft = tiny_draft(target, num_specialists=2, positions_per_specialist=2)
    ids, feats = torch.randint(0, 128, (2, 16)), torch.randn(2, 16, 64)
    out = draft(ids, feats, loss_mask=torch.ones(2, 16))
    assert set(f"acc_{d}" for d in range(1, 5)) <= set(out.metrics)
    assert int(out.metrics["count_1"]) == 2 * 15 and int(out.metrics["count_4"]) == 2 * 12
    with_topk = draft(ids, feats, loss_mask=torch.ones(2, 16), objective=ObjectiveConfig(topk_weight=1.0))
    assert with_topk.loss > out.loss


def test_soft_cross_entropy_matches_autograd():
    from transformers_poss.training.objective import SoftCrossEntropy

    torch.manual_seed(0)
    logits = torch.randn(5, 17, dtype=torch.float64, requires_grad=True)
    probs = torch.softmax(torch.randn(5, 17, dtype=torch.float64), -1)
    weights = torch.rand(5, dtype=torch.float64)
    reference = -(probs * torch.log_softmax(logits, -1)).sum(-1)
    torch.testing.assert_close(SoftCrossEntropy.apply(logits, probs), reference)
    (grad,) = torch.autograd.grad((reference * weights).sum(), logits)
    (fused,) = torch.autograd.grad((SoftCrossEntropy.apply(logits, probs) * weights).sum(), logits)
    torch.testing.assert_close(fused, grad)
