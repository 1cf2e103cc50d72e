"""Drafting: the EAGLE-2 dynamic tree with position specialists, with per-specialist caches kept across rounds.

The proposer owns the drafting state of one sequence. Each call gets the context pairs (f_t, x_{t+1}) that were
accepted since the previous call (the last one ends in the root, the latest target token) and returns a
[`DraftTree`]. Only new pairs are processed: every specialist keeps its own keys/values of the accepted context and
catches up (a key/value projection, no attention) when it is first used in a round.
"""

from __future__ import annotations

import torch

from .modeling_poss import PosSDraftCache, causal_mask
from .tree import DraftTree, ancestor_mask_from_parents


class _RoundState:
    """Tree rows fed to the draft during one round: fused inputs, positions and ancestry among them."""

    def __init__(self):
        self.hidden: torch.Tensor | None = None  # [1, R, H] fused inputs of all fed tree rows
        self.positions: torch.Tensor | None = None  # [1, R]
        self.ancestry: torch.Tensor | None = None  # [R, R] bool, ancestor-or-self among fed rows
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}  # specialist -> (keys, values, rows done)

    def add(self, hidden, positions, parent_rows: torch.LongTensor | None):
        """Append `[1, k, H]` rows at `[1, k]` positions whose parents are rows ``parent_rows`` (None: roots)."""
        k = hidden.shape[1]
        new_anc = torch.eye(k, dtype=torch.bool, device=hidden.device)
        if self.hidden is None:
            self.hidden, self.positions, self.ancestry = hidden, positions, new_anc
            return
        rows = self.ancestry.shape[0]
        inherited = self.ancestry[parent_rows]  # [k, R]
        top = torch.cat([self.ancestry, torch.zeros(rows, k, dtype=torch.bool, device=hidden.device)], dim=1)
        bottom = torch.cat([inherited, new_anc], dim=1)
        self.ancestry = torch.cat([top, bottom], dim=0)
        self.hidden = torch.cat([self.hidden, hidden], dim=1)
        self.positions = torch.cat([self.positions, positions], dim=1)

    def keys_values(self, specialist: int, layer, draft):
        """Keys/values of every fed row under ``specialist`` (only rows not yet projected are computed)."""
        keys, values, done = self.kv.get(specialist, (None, None, 0))
        total = self.hidden.shape[1]
        if done < total:
            hidden = self.hidden[:, done:]
            new_k, new_v = layer.project_kv(hidden, draft.position_embeddings(hidden, self.positions[:, done:]))
            keys = new_k if keys is None else torch.cat([keys, new_k], dim=-2)
            values = new_v if values is None else torch.cat([values, new_v], dim=-2)
            self.kv[specialist] = (keys, values, total)
        return keys, values


class PosSProposer:
    """Drafts trees for one sequence with a [`PosSDraftModel`].

    Args:
        draft: the draft, attached to its target.
        depth (`int`): draft tokens on the longest path (paper's depth).
        top_k (`int`): children expanded per frontier node, and frontier width.
        total_tokens (`int`): nodes in the returned tree, root included.
    """

    def __init__(self, draft, depth: int, top_k: int, total_tokens: int):
        if depth < 1 or top_k < 1 or total_tokens < 2:
            raise ValueError(
                f"Tree shape needs depth >= 1, top_k >= 1 and total_tokens >= 2; got {depth}, {top_k}, {total_tokens}."
            )
        self.draft = draft
        drafting_vocab = draft.config.draft_vocab_size or draft.config.vocab_size
        self.depth, self.top_k, self.total_tokens = depth, min(top_k, drafting_vocab), total_tokens
        self.reset()

    def reset(self):
        """Forget the context (start a new sequence)."""
        self.cache = PosSDraftCache(self.draft.config.num_specialists)
        self.context_hidden: torch.Tensor | None = None  # [1, L, H] fused context pairs

    @property
    def context_length(self) -> int:
        return 0 if self.context_hidden is None else self.context_hidden.shape[1]

    # ------------------------------------------------------------------ context
    def _catch_up(self, specialist: int, length: int | None = None):
        """Project the first ``length`` context pairs (default: all) that ``specialist`` has not seen yet into its
        cache; return its keys/values."""
        length = self.context_length if length is None else length
        seen = self.cache.get_seq_length(specialist)
        if seen < length:
            hidden = self.context_hidden[:, seen:length]
            positions = torch.arange(seen, length, device=hidden.device)[None]
            layer = self.draft.layers[specialist]
            return self.cache.update(specialist, *layer.project_kv(hidden, self.draft.position_embeddings(hidden, positions)))
        return self.cache.keys[specialist], self.cache.values[specialist]

    def _context_step(self, input_ids, target_hidden_states) -> torch.Tensor:
        """Specialist 0 over the new pairs; returns the predicted feature of the root, `[1, H]`."""
        draft = self.draft
        hidden = draft.fuse(input_ids, target_hidden_states)
        past = self.context_length
        self.context_hidden = hidden if self.context_hidden is None else torch.cat([self.context_hidden, hidden], 1)
        specialist = draft.config.specialist_for_step(0)
        self._catch_up(specialist, past)
        length = hidden.shape[1]
        positions = torch.arange(past, past + length, device=hidden.device)[None]
        pos_emb = draft.position_embeddings(hidden, positions)
        layer = draft.layers[specialist]
        keys, values = self.cache.update(specialist, *layer.project_kv(hidden, pos_emb))
        out = layer(hidden, pos_emb, keys, values, causal_mask(length, past, hidden.device))
        return out[:, -1]

    def _top_k(self, features: torch.Tensor):
        """Top-k target token ids and their log-probs under the draft: `[R, k]` each."""
        logprobs = torch.log_softmax(self.draft.compute_logits(features).float(), dim=-1)
        values, indices = logprobs.topk(self.top_k, dim=-1)
        return self.draft.to_target_tokens(indices), values

    # ------------------------------------------------------------------ tree
    @torch.no_grad()
    def propose(self, input_ids: torch.LongTensor, target_hidden_states: torch.Tensor) -> DraftTree:
        """Draft a tree after the new context pairs.

        Args:
            input_ids (`[1, m]`): tokens x_{t+1} of the new pairs; ``input_ids[0, -1]`` is the root.
            target_hidden_states (`[1, m, H]`): target features f_t of the same pairs.
        """
        if input_ids.shape[0] != 1:
            raise ValueError("PosSProposer drafts for one sequence at a time (batch size 1).")
        draft, k = self.draft, self.top_k
        root_feature = self._context_step(input_ids, target_hidden_states)
        context = self.context_length
        device = root_feature.device

        tokens, scores = self._top_k(root_feature)  # [1, k]
        pool_tokens, pool_scores = [tokens[0]], [scores[0]]
        pool_parents = [torch.full((k,), -1, dtype=torch.long, device=device)]
        pool_depths = [torch.ones(k, dtype=torch.long, device=device)]
        frontier_tokens, frontier_scores = tokens[0], scores[0]
        frontier_features = root_feature.expand(k, -1)
        frontier_pool = torch.arange(k, device=device)
        frontier_rows = None  # rows (in the round state) of the frontier's parents
        state = _RoundState()
        pool_size = k

        for step in range(1, self.depth):
            specialist = draft.config.specialist_for_step(step)
            hidden = draft.fuse(frontier_tokens[None], frontier_features[None])  # [1, k, H]
            positions = torch.full((1, k), context + step - 1, dtype=torch.long, device=device)
            state.add(hidden, positions, frontier_rows)
            rows = torch.arange(state.hidden.shape[1] - k, state.hidden.shape[1], device=device)
            ctx_keys, ctx_values = self._catch_up(specialist)
            layer = draft.layers[specialist]
            tree_keys, tree_values = state.keys_values(specialist, layer, draft)
            keys = torch.cat([ctx_keys, tree_keys], dim=-2)
            values = torch.cat([ctx_values, tree_values], dim=-2)
            mask = torch.cat(
                [torch.ones(k, context, dtype=torch.bool, device=device), state.ancestry[rows]], dim=1
            )[None, None]
            out = layer(hidden, draft.position_embeddings(hidden, positions), keys, values, mask)[0]  # [k, H]

            child_tokens, child_logprobs = self._top_k(out)  # [k, k]
            child_scores = frontier_scores[:, None] + child_logprobs
            pool_tokens.append(child_tokens.reshape(-1))
            pool_scores.append(child_scores.reshape(-1))
            pool_parents.append(frontier_pool.repeat_interleave(k))
            pool_depths.append(torch.full((k * k,), step + 1, dtype=torch.long, device=device))

            best_scores, best = child_scores.reshape(-1).topk(k)
            parent_idx = best // k
            frontier_tokens = child_tokens.reshape(-1)[best]
            frontier_scores = best_scores
            frontier_features = out[parent_idx]
            frontier_pool = pool_size + best
            frontier_rows = rows[parent_idx]
            pool_size += k * k

        return self._select(
            input_ids[0, -1],
            torch.cat(pool_tokens),
            torch.cat(pool_scores),
            torch.cat(pool_parents),
            torch.cat(pool_depths),
        )

    def _select(self, root, pool_tokens, pool_scores, pool_parents, pool_depths) -> DraftTree:
        """Keep the ``total_tokens - 1`` best candidates by cumulative score and add the root.

        A stable sort keeps a parent before a child of equal score, so the kept nodes always form a tree.
        """
        keep = min(self.total_tokens - 1, pool_tokens.shape[0])
        order = torch.sort(pool_scores, descending=True, stable=True).indices[:keep]
        kept = torch.sort(order).values  # pool order: parents before children
        node_of = torch.full((pool_tokens.shape[0] + 1,), -1, dtype=torch.long, device=pool_tokens.device)
        node_of[kept] = torch.arange(1, keep + 1, device=pool_tokens.device)
        parent_pool = pool_parents[kept]
        parents = torch.where(parent_pool < 0, torch.zeros_like(parent_pool), node_of[parent_pool])
        device = pool_tokens.device
        parents = torch.cat([torch.tensor([-1], device=device), parents])
        tokens = torch.cat([root.reshape(1).to(device), pool_tokens[kept]])
        depths = torch.cat([torch.zeros(1, dtype=torch.long, device=device), pool_depths[kept]])
        scores = torch.cat([torch.zeros(1, device=device), pool_scores[kept]])
        return DraftTree(
            tokens=tokens, parents=parents, depths=depths, tree_mask=ancestor_mask_from_parents(parents), scores=scores
        )
