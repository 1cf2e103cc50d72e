"""Tiny targets, random trees and scripted proposers for the tree-verification tests."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

from transformers_poss.speculation.tree import DraftTree, ancestor_mask_from_parents


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: extra threads only add overhead (and spin) on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_llama_target(vocab_size=96, seed=0, attn="sdpa", layers=2, **kwargs):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation=attn,
        **kwargs,
    )
    return LlamaForCausalLM(config).eval()


def tiny_gemma3_target(vocab_size=96, window=4, seed=0, attn="sdpa"):
    """Gemma 3 with alternating sliding-window (``window`` tokens) and full-attention layers."""
    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=window,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        max_position_embeddings=256,
        attn_implementation=attn,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
    )
    return Gemma3ForCausalLM(config).eval()


def tree_from_parents(tokens, parents) -> DraftTree:
    parents = torch.as_tensor(parents, dtype=torch.long)
    depths = torch.zeros_like(parents)
    for i in range(1, parents.shape[0]):
        depths[i] = depths[parents[i]] + 1
    return DraftTree(
        tokens=torch.as_tensor(tokens, dtype=torch.long),
        parents=parents,
        depths=depths,
        tree_mask=ancestor_mask_from_parents(parents),
    )


def level_order(tokens: list[int], parents: list[int], generator: torch.Generator) -> DraftTree:
    """Renumber a tree by depth with random order inside each depth (accepted paths become non-contiguous)."""
    depths = [0] * len(tokens)
    for i in range(1, len(tokens)):
        depths[i] = depths[parents[i]] + 1
    jitter = torch.rand(len(tokens), generator=generator).tolist()
    order = sorted(range(len(tokens)), key=lambda i: (depths[i], jitter[i] if i else -1.0))
    new_index = {old: new for new, old in enumerate(order)}
    new_parents = [-1] + [new_index[parents[old]] for old in order[1:]]
    return tree_from_parents([tokens[old] for old in order], new_parents)


def random_tree(root: int, num_nodes: int, max_depth: int, vocab_size: int, generator: torch.Generator) -> DraftTree:
    tokens, parents, depths = [root], [-1], [0]
    while len(tokens) < num_nodes:
        candidates = [i for i, d in enumerate(depths) if d < max_depth]
        parent = candidates[int(torch.randint(len(candidates), (1,), generator=generator))]
        tokens.append(int(torch.randint(vocab_size, (1,), generator=generator)))
        parents.append(parent)
        depths.append(depths[parent] + 1)
    return level_order(tokens, parents, generator)


class RandomProposer:
    """Proposes random trees (acceptance is rare: exercises rejection and the bonus token)."""

    def __init__(self, vocab_size, num_nodes=8, max_depth=3, seed=0):
        self.vocab_size, self.num_nodes, self.max_depth = vocab_size, num_nodes, max_depth
        self.generator = torch.Generator().manual_seed(seed)
        self.calls = []

    def propose(self, input_ids, target_hidden_states):
        self.calls.append((input_ids.clone(), target_hidden_states.clone()))
        root = int(input_ids[0, -1])
        return random_tree(root, self.num_nodes, self.max_depth, self.vocab_size, self.generator)


class OracleProposer:
    """Proposes trees around the target's own continuation, so that several tokens get accepted per round.

    Each round: the target's continuation of ``depth`` tokens (through ``generate`` with ``continuation_kwargs``,
    e.g. the same repetition penalty), each chain token corrupted with probability ``corrupt``, plus ``siblings``
    random nodes per depth; nodes are renumbered level by level in random order. It also checks that the features it
    receives are the target's post-norm features of the new context pairs.
    """

    def __init__(self, target, prompt, depth=4, siblings=2, corrupt=0.15, seed=0, padding=0, **continuation_kwargs):
        self.target = target
        self.padding = padding  # left-padded prompt: features of padded rows are not compared
        self.context = prompt[0, :1].tolist()  # x_0; the proposer receives x_1 onwards
        self.depth, self.siblings, self.corrupt = depth, siblings, corrupt
        self.continuation_kwargs = continuation_kwargs
        self.generator = torch.Generator().manual_seed(seed)
        self.vocab_size = target.config.get_text_config().vocab_size
        self.feature_errors = []

    def _check_features(self, new_tokens, features):
        """Features of pairs t = len(context)-m .. len(context)-1 must be the target's own post-norm features."""
        self.context += new_tokens[0].tolist()
        if self.padding:
            return
        ids = torch.tensor([self.context[:-1]])
        with torch.no_grad():
            expected = self.target.model(ids).last_hidden_state[:, -new_tokens.shape[1] :]
        self.feature_errors.append(float((expected - features).abs().max()))

    def _continuation(self) -> list[int]:
        ids = torch.tensor([self.context])
        kwargs = dict(self.continuation_kwargs)
        if self.padding:
            kwargs["attention_mask"] = (torch.arange(ids.shape[1]) >= self.padding).long()[None]
        out = self.target.generate(ids, max_new_tokens=self.depth, do_sample=False, **kwargs)
        return out[0, len(self.context) :].tolist()

    def propose(self, input_ids, target_hidden_states):
        self._check_features(input_ids, target_hidden_states)
        chain = self._continuation()
        tokens, parents, depths = [self.context[-1]], [-1], [0]
        chain_parent = 0
        for d, token in enumerate(chain, start=1):
            previous = [i for i, depth in enumerate(depths) if depth == d - 1]
            if float(torch.rand(1, generator=self.generator)) < self.corrupt:
                token = (token + 1 + int(torch.randint(self.vocab_size - 1, (1,), generator=self.generator))) % self.vocab_size
            tokens.append(token)
            parents.append(chain_parent)
            depths.append(d)
            chain_parent = len(tokens) - 1
            for _ in range(self.siblings):
                tokens.append(int(torch.randint(self.vocab_size, (1,), generator=self.generator)))
                parents.append(previous[int(torch.randint(len(previous), (1,), generator=self.generator))])
                depths.append(d)
        return level_order(tokens, parents, self.generator)


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson goodness-of-fit p-value of observed ``counts`` against ``probs`` (cells with a small expected count
    are pooled into one)."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    expected = probs / probs.sum() * counts.sum()
    small = expected < min_expected
    obs = torch.cat([counts[~small], counts[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    if bool(((exp == 0) & (obs > 0)).any()):
        return 0.0
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.double), stat / 2.0))


def tiny_tokenizer():
    """A 96-token word-level tokenizer (two-letter tokens) for stop strings and text streamers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2, "abcdef": 3}
    for i in range(92):
        vocab[chr(97 + i % 26) + chr(97 + i // 26)] = 4 + i
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", bos_token="<s>")


def train_draft_briefly(target, draft, prompts, steps=150, lr=3e-3, new_tokens=48, seed=0):
    """Fit the draft's specialists to the target's own greedy continuations of ``prompts`` (feature regression +
    next-token cross-entropy through the draft's logits). The draft reads the target hidden states of its
    ``feature_layers`` (the post-norm ones without); the regression target is the next post-norm feature."""
    torch.manual_seed(seed)
    layers = draft.config.feature_layers
    with torch.no_grad():
        sequences = [target.generate(p, max_new_tokens=new_tokens, do_sample=False) for p in prompts]
        features = [target.model(s).last_hidden_state for s in sequences]
        labels = [target.lm_head(f).argmax(-1) for f in features]
        inputs = features if layers is None else [
            torch.cat([target(s, output_hidden_states=True).hidden_states[i] for i in layers], -1) for s in sequences
        ]
    head = target.get_output_embeddings()
    logits_of = head if draft.lm_head is None and draft.norm is None else draft.compute_logits
    head.requires_grad_(False)
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=lr)
    draft.train()
    for step in range(steps):
        i = step % len(sequences)
        seq, feat, lab = sequences[i], features[i], labels[i]
        loss = 0.0
        for specialist in range(draft.config.num_specialists):
            out = draft(input_ids=seq[:, 1:], target_hidden_states=inputs[i][:, :-1], specialist=specialist)
            predicted = out.last_hidden_state
            loss = loss + torch.nn.functional.smooth_l1_loss(predicted, feat[:, 1:])
            logits = logits_of(predicted)
            loss = loss + torch.nn.functional.cross_entropy(logits[0], lab[0, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    head.requires_grad_(True)
    return draft.eval()


class TargetTopKProposer:
    """Children are the target's own most likely tokens (``widths[d]`` per node at depth ``d``), best first: the
    children carry most of the probability mass, so any error in the acceptance rule shows in the samples."""

    def __init__(self, target, prompt, widths=(3, 2)):
        self.target, self.widths = target, widths
        self.context = prompt[0, :1].tolist()

    def propose(self, input_ids, target_hidden_states):
        self.context += input_ids[0].tolist()
        tokens, parents = [self.context[-1]], [-1]
        frontier = [(0, self.context)]
        for width in self.widths:
            ids = torch.tensor([sequence for _, sequence in frontier])
            with torch.no_grad():
                top = self.target(ids).logits[:, -1].topk(width, dim=-1).indices.tolist()
            next_frontier = []
            for (node, sequence), children in zip(frontier, top):
                for token in children:
                    tokens.append(token)
                    parents.append(node)
                    next_frontier.append((len(tokens) - 1, sequence + [token]))
            frontier = next_frontier
        return tree_from_parents(tokens, parents)


def broken_rejection(probs, child_tokens, generator=None):
    """A wrong acceptance rule for the sampling tests to catch: accepts child i with probability p(x_i), forgetting
    to renormalise after earlier rejections."""
    for i, token in enumerate(child_tokens.tolist()):
        if float(torch.rand(1)) < float(probs[token]):
            return i, token
    residual = probs.clone()
    residual[child_tokens] = 0
    return -1, int(torch.multinomial(residual if residual.sum() > 0 else probs, 1))
