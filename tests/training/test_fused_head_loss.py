"""The fused head + soft cross-entropy of training: same loss, top-1 and gradients as the unfused computation."""

import pytest
import torch

from helpers import tiny_draft, tiny_llama
from transformers_poss.training import objective as objective_module
from transformers_poss.training.losses import HeadSoftCrossEntropy, SoftLabels, head_chunk_rows
from transformers_poss.training.objective import ObjectiveConfig
from transformers_poss.vocab import set_token_map


@pytest.mark.parametrize("with_bias,weight_grad,chunk", [(False, False, 3), (True, True, 4), (True, False, 64)])
def test_head_soft_cross_entropy_matches_autograd(with_bias, weight_grad, chunk):
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(11, 8, dtype=torch.float64, generator=generator, requires_grad=True)
    weight = torch.randn(19, 8, dtype=torch.float64, generator=generator).requires_grad_(weight_grad)
    bias = torch.randn(19, dtype=torch.float64, generator=generator).requires_grad_(weight_grad) if with_bias else None
    probs = torch.softmax(3 * torch.randn(11, 19, dtype=torch.float64, generator=generator), -1)
    probs[0] *= 0.9  # labels that do not sum to one (a masked-out row, a truncated distribution)
    row_weights = torch.rand(11, dtype=torch.float64, generator=generator)
    logits = features @ weight.t() + (0 if bias is None else bias)
    reference = torch.logsumexp(logits, -1) - (probs * logits).sum(-1)  # = -<p, log softmax> when sum p = 1
    rows, top1 = HeadSoftCrossEntropy.apply(features, weight, bias, probs, torch.float64, chunk)
    torch.testing.assert_close(rows, reference.float())
    assert torch.equal(top1, logits.argmax(-1))
    inputs = [features] + ([weight] + ([bias] if with_bias else []) if weight_grad else [])
    expected = torch.autograd.grad((reference * row_weights).sum(), inputs)
    fused = torch.autograd.grad((rows * row_weights.float()).sum(), inputs)
    for got, want in zip(fused, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # a wrong label changes the loss (the comparison above can fail)
    other = HeadSoftCrossEntropy.apply(features, weight, bias, probs.roll(1, dims=1), torch.float64, chunk)[0]
    assert not torch.allclose(other, rows)


@pytest.mark.parametrize("with_bias", [False, True])
def test_soft_labels_chunk_by_chunk_or_stored_equal_the_whole_softmax(with_bias):
    generator = torch.Generator().manual_seed(1)
    features, weight = torch.randn(10, 8, generator=generator), torch.randn(23, 8, generator=generator)
    bias = torch.randn(23, generator=generator) if with_bias else None
    logits = features @ weight.t() + (0 if bias is None else bias)
    on_the_fly = SoftLabels(features, weight, bias, torch.float32)
    rows = torch.cat([on_the_fly.rows(start, min(10, start + 3)) for start in range(0, 10, 3)])
    torch.testing.assert_close(rows, torch.softmax(logits, -1))
    assert torch.equal(on_the_fly.top1, logits.argmax(-1))
    stored = SoftLabels(features, weight, bias, torch.float32).store(4)
    torch.testing.assert_close(stored.probs, torch.softmax(logits, -1))
    torch.testing.assert_close(stored.rows(2, 7), stored.probs[2:7])
    assert torch.equal(stored.top1, logits.argmax(-1))
    # the fused loss reads them like the probabilities themselves
    loss, _ = HeadSoftCrossEntropy.apply(features, weight, bias, SoftLabels(features, weight, bias, torch.float32),
                                         torch.float32, 3)
    want, _ = HeadSoftCrossEntropy.apply(features, weight, bias, torch.softmax(logits, -1), torch.float32, 3)
    torch.testing.assert_close(loss, want)
    other = SoftLabels(features.roll(1, dims=0), weight, bias, torch.float32)
    assert not torch.allclose(HeadSoftCrossEntropy.apply(features, weight, bias, other, torch.float32, 3)[0], want)


def test_chunk_rows_follow_the_vocabulary():
    assert head_chunk_rows(8192) == 256 and head_chunk_rows(49152) == 42 and head_chunk_rows(100) > 1000


def _loss_and_grads(draft, ids, feats, mask, use_fused, monkeypatch):
    real = objective_module._soft_cross_entropy

    def choose(draft_, pred, probs, head):
        return real(draft_, pred, probs, head if use_fused else None)

    monkeypatch.setattr(objective_module, "_soft_cross_entropy", choose)
    draft.zero_grad()
    out = draft(ids, feats, loss_mask=mask, objective=ObjectiveConfig(noise="none"))
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in draft.named_parameters() if p.grad is not None}
    return out, grads


@pytest.mark.parametrize("steps", [1, 4])  # labels computed beside a single step's loss / stored for four
@pytest.mark.parametrize("kind", ["target_head", "draft_vocab", "own_head"])
def test_training_forward_fused_equals_unfused(kind, steps, monkeypatch):
    target = tiny_llama()
    draft = tiny_draft(target, num_specialists=steps // 2 or 1, positions_per_specialist=2 if steps > 1 else 1,
                       **({"own_lm_head": True} if kind == "own_head" else {})).train()
    if kind == "draft_vocab":
        set_token_map(draft, torch.arange(0, 128, 2))
    torch.manual_seed(3)
    ids, feats, mask = torch.randint(0, 128, (2, 14)), torch.randn(2, 14, 64), torch.ones(2, 14)
    assert draft.logits_head() is not None
    fused, fused_grads = _loss_and_grads(draft, ids, feats, mask, True, monkeypatch)
    plain, plain_grads = _loss_and_grads(draft, ids, feats, mask, False, monkeypatch)
    torch.testing.assert_close(fused.loss, plain.loss)
    for depth in range(1, steps + 1):
        assert torch.equal(fused.metrics[f"correct_{depth}"], plain.metrics[f"correct_{depth}"])
    assert fused_grads.keys() == plain_grads.keys()
    if kind == "own_head":
        assert "lm_head.weight" in fused_grads
    for name in fused_grads:
        torch.testing.assert_close(fused_grads[name], plain_grads[name], rtol=1e-4, atol=1e-6)


def test_bf16_autocast_training_step_runs_and_keeps_float32_parameters():
    target = tiny_llama()
    draft = tiny_draft(target, num_specialists=2, positions_per_specialist=1).train()
    ids, feats = torch.randint(0, 128, (2, 12)), torch.randn(2, 12, 64)
    reference = draft(ids, feats, loss_mask=torch.ones(2, 12), objective=ObjectiveConfig(noise="none")).loss
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = draft(ids, feats, loss_mask=torch.ones(2, 12), objective=ObjectiveConfig(noise="none")).loss
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    torch.testing.assert_close(loss, reference, rtol=0.05, atol=0.05)  # bf16 products, float32 softmax
    assert all(p.dtype == torch.float32 for p in draft.parameters())
    assert draft.fc.weight.grad is not None and torch.isfinite(draft.fc.weight.grad).all()
