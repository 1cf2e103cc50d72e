"""Drafting: the EAGLE-2 dynamic tree with position specialists, for B >= 1 rows, with per-specialist caches kept
across rounds.

One `PosSProposer` drafts one tree per row; a single sequence is a batch of one. The draft's context columns mirror
the target cache's columns: column ``j`` holds the pair (f_j, x_{j+1}) whose feature f_j is target column ``j``, so
the pair is valid exactly where the target column is, at the same position (see `masks.BatchLayout`). Only new pairs
are processed each round: every specialist keeps its own keys/values of the context and catches up (a key/value
projection, no attention) when it is first used in a round.

Two entry points:

- ``propose(input_ids, target_hidden_states)``: rows without holes (a single sequence, or B unpadded rows of one
  length); the proposer keeps the positions itself. Returns a `DraftTree` for one row, a `BatchedTree` for more.
- ``append(tokens, features)`` then ``propose_batch(valid, positions)``: the batched loop, which owns the layout (holes,
  positions) and applies row drops and re-layouts with `select_rows` / `relayout`.
"""

from __future__ import annotations

import torch

from .draft_cache import PosSDraftCache
from .tree import BatchedTree, DraftTree, batched_ancestor_mask


class _RoundState:
    """Tree rows fed to the draft during one round, for B rows: fused inputs `[B, R, F]` (F =
    ``config.fused_size``) with their RoPE (cos, sin) `[B, R, head_dim]` each, kept as the per-level parts they came
    in (joined only when a specialist must project more than the last level), ancestry `[B, R, R]` among them, and
    each specialist's keys/values of them."""

    def __init__(self):
        self.parts: list[tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]] = []  # (fused rows, rope) per level
        self.total = 0  # rows fed so far
        self.ancestry: torch.Tensor | None = None
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}  # specialist -> (keys, values, rows done)

    def add(self, hidden, rope, parent_rows: torch.LongTensor | None):
        """Append `[B, k, F]` fused inputs with their RoPE (cos, sin) whose parents are rows `[B, k]` ``parent_rows``
        (None: the first layer, children of the roots)."""
        batch, k, _ = hidden.shape
        self.parts.append((hidden, rope))
        self.total += k
        eye = torch.eye(k, dtype=torch.bool, device=hidden.device).expand(batch, k, k)
        if self.ancestry is None:
            self.ancestry = eye
            return
        rows = self.ancestry.shape[1]
        inherited = self.ancestry.gather(1, parent_rows[..., None].expand(batch, k, rows))  # [B, k, R]
        top = torch.cat([self.ancestry, eye.new_zeros(batch, rows, k)], dim=2)
        self.ancestry = torch.cat([top, torch.cat([inherited, eye], dim=2)], dim=1)

    def _rows_from(self, done: int):
        """Fused rows ``done ..`` and their RoPE (``done`` is a level boundary: a count of rows fed earlier); the last
        level's rows as given when they are all that is asked (a fused int8 q/k/v matches its inputs by identity),
        else only the levels from ``done`` on are joined."""
        hidden, rope = self.parts[-1]
        if self.total - done == hidden.shape[1]:
            return hidden, rope
        parts, start = [], self.total
        for part in reversed(self.parts):
            if start <= done:
                break
            parts.insert(0, part)
            start -= part[0].shape[1]
        hidden = torch.cat([part[0] for part in parts], dim=1)
        rope = tuple(torch.cat([part[1][i] for part in parts], dim=1) for i in range(2))
        return hidden, rope

    def keys_values(self, specialist: int, layer, cache: PosSDraftCache):
        """Keys/values `[B, kv_heads, L + R, head_dim]` of the context (``cache``, caught up) followed by every fed
        row under ``specialist``; only rows not yet projected are computed, and they go to the cache's tail
        (`PosSDraftCache.with_tail`), so the context is never copied."""
        keys, values, done = self.kv.get(specialist, (None, None, 0))
        if done < self.total:
            keys, values = cache.with_tail(specialist, done, *layer.project_kv(*self._rows_from(done)))
            self.kv[specialist] = (keys, values, self.total)
        return keys, values


class PosSProposer:
    """Drafts one tree per row with a [`PosSDraftModel`].

    Args:
        draft: the draft, attached to its target.
        depth (`int`): draft tokens on the longest path (paper's depth); may be changed between rounds.
        top_k (`int`): children expanded per frontier node, and frontier width.
        total_tokens (`int`): nodes per row in the returned trees, root included; may be changed between rounds.
    """

    def __init__(self, draft, depth: int, top_k: int, total_tokens: int):
        if depth < 1 or top_k < 1 or total_tokens < 2:
            raise ValueError(
                f"Tree shape needs depth >= 1, top_k >= 1 and total_tokens >= 2; got {depth}, {top_k}, {total_tokens}."
            )
        self.draft = draft
        drafting_vocab = draft.config.draft_vocab_size or draft.config.vocab_size
        self.depth, self.top_k, self.total_tokens = depth, min(top_k, drafting_vocab), total_tokens
        self.cache = PosSDraftCache(draft.config.num_specialists)
        self.hidden: torch.Tensor | None = None  # [B, L, F] fused context pairs (F = config.fused_size)
        self.roots: torch.LongTensor | None = None  # [B] token of each row's last pair (the next root)

    @property
    def context_length(self) -> int:
        return 0 if self.hidden is None else self.hidden.shape[1]

    # ------------------------------------------------------------------ context
    @torch.no_grad()
    def append(self, tokens: torch.LongTensor, features: torch.Tensor, valid: torch.BoolTensor | None = None) -> None:
        """New pair columns: tokens x_{t+1} `[B, m]` and target features f_t `[B, m, config.target_feature_size]`
        (k*H with ``feature_layers``, fused to H here); the last column is real for every row. ``valid`` (`[B, m]`, which new columns are real) is part of the interface for proposers that keep
        per-row state; the draft reads validity from the layout passed to `propose_batch`."""
        hidden = self.draft.fuse(tokens, self.draft.fuse_target_features(features))
        self.hidden = hidden if self.hidden is None else torch.cat([self.hidden, hidden], dim=1)
        self.roots = tokens[:, -1]

    def _catch_up(self, specialist: int, positions: torch.LongTensor):
        """Project the columns ``specialist`` has not seen into its cache (``positions``: `[B, L]`); return its keys
        and values `[B, kv_heads, L, head_dim]`."""
        seen = self.cache.get_seq_length(specialist)
        if seen < self.hidden.shape[1]:
            hidden = self.hidden[:, seen:]
            layer = self.draft.layers[specialist]
            emb = self.draft.position_embeddings(hidden, positions[:, seen:])
            return self.cache.update(specialist, *layer.project_kv(hidden, emb))
        return self.cache.keys[specialist], self.cache.values[specialist]

    def select_rows(self, rows: torch.LongTensor) -> None:
        """Keep only batch rows ``rows`` (`[B']`)."""
        self.hidden, self.roots = self.hidden[rows], self.roots[rows]
        self.cache.select_rows(rows)

    def relayout(self, index: torch.LongTensor, positions: torch.LongTensor) -> None:
        """Row ``b`` keeps columns ``index[b]`` (`[B, L']`); ``positions`` (`[B, L]`) is the layout before."""
        for s, keys in enumerate(self.cache.keys):
            if keys is not None:
                self._catch_up(s, positions)
                self.cache.gather_columns(s, index)
        self.hidden = self.hidden.gather(1, index[..., None].expand(-1, -1, self.hidden.shape[2]))

    def _top_k(self, features: torch.Tensor):
        """Top-k target token ids and draft log-probs of `[B, R, H]` features: `[B, R, k]` each."""
        logprobs = torch.log_softmax(self.draft.compute_logits(features).float(), dim=-1)
        values, indices = logprobs.topk(self.top_k, dim=-1)
        return self.draft.to_target_tokens(indices), values

    # ------------------------------------------------------------------ tree
    @torch.no_grad()
    def propose(self, input_ids: torch.LongTensor, target_hidden_states: torch.Tensor) -> DraftTree | BatchedTree:
        """Append the new context pairs of rows without holes and draft a tree after them.

        Args:
            input_ids (`[B, m]`): tokens x_{t+1} of the new pairs; ``input_ids[:, -1]`` are the roots.
            target_hidden_states (`[B, m, config.target_feature_size]`): target features f_t of the same pairs.

        Returns:
            a `DraftTree` (with ``scores``) for a single row, else a `BatchedTree`.
        """
        self.append(input_ids, target_hidden_states)
        batch, length = self.hidden.shape[:2]
        positions = torch.arange(length, device=self.hidden.device)[None].expand(batch, length)
        valid = torch.ones(batch, length, dtype=torch.bool, device=self.hidden.device)
        trees = self.propose_batch(valid, positions)
        return trees.single() if batch == 1 else trees

    @torch.no_grad()
    def propose_batch(self, valid: torch.BoolTensor, positions: torch.LongTensor, depth: int | None = None):
        """Draft one tree per row after the appended pairs.

        Args:
            valid, positions (`[B, L]`): the context layout (L = columns appended so far).
            depth: tree depth this round (default: the configured depth); 0 gives root-only trees.

        Returns:
            a `BatchedTree` of ``min(total_tokens, nodes drafted)`` nodes per row, root first, with ``scores``.
        """
        depth = self.depth if depth is None else min(depth, self.depth)
        depth = min(depth, self.total_tokens - 1)  # a kept node is never deeper than the node budget
        if depth < 1:
            return BatchedTree.root_only(self.roots)
        draft, k = self.draft, self.top_k
        specialist = draft.config.specialist_for_step(0)
        keys, values = self._catch_up(specialist, positions)
        root_positions = positions[:, -1:]  # [B, 1] position of each row's last pair
        hidden = self.hidden[:, -1:]
        # RoPE of the root's position and of every level below it, in one call: (cos, sin) `[B, depth, head_dim]`
        rope = draft.position_embeddings(hidden, root_positions + torch.arange(depth, device=root_positions.device))
        emb = tuple(part[:, :1] for part in rope)
        root_feature = draft.layers[specialist](hidden, emb, keys, values, valid[:, None, None, :])[:, 0]  # [B, H]
        batch, device = root_feature.shape[0], root_feature.device

        tokens, scores = self._top_k(root_feature[:, None])  # [B, 1, k]
        frontier_tokens, frontier_scores = tokens[:, 0], scores[:, 0]  # [B, k]
        pool_tokens, pool_scores = [frontier_tokens], [frontier_scores]
        pool_parents = [torch.full((batch, k), -1, dtype=torch.long, device=device)]
        pool_depths = [torch.ones(k, dtype=torch.long, device=device)]
        frontier_features = root_feature[:, None].expand(batch, k, -1)
        frontier_pool = torch.arange(k, device=device)[None].expand(batch, k)
        frontier_rows = None
        state = _RoundState()
        pool_size = k
        context_mask = valid[:, None, :].expand(batch, k, -1)

        for step in range(1, depth):
            specialist = draft.config.specialist_for_step(step)
            layer = draft.layers[specialist]
            hidden = draft.fuse(frontier_tokens, frontier_features)  # [B, k, F]: the draft's own H-wide features
            emb = tuple(part[:, step : step + 1].expand(batch, k, -1) for part in rope)  # [B, k, head_dim]
            state.add(hidden, emb, frontier_rows)
            total = state.total
            self._catch_up(specialist, positions)
            keys, values = state.keys_values(specialist, layer, self.cache)  # [B, kv_heads, L + R, head_dim]
            mask = torch.cat([context_mask, state.ancestry[:, total - k :]], dim=2)[:, None]  # [B, 1, k, L + R]
            out = layer(hidden, emb, keys, values, mask)  # [B, k, H]

            child_tokens, child_logprobs = self._top_k(out)  # [B, k, k]
            child_scores = frontier_scores[..., None] + child_logprobs
            pool_tokens.append(child_tokens.reshape(batch, -1))
            pool_scores.append(child_scores.reshape(batch, -1))
            pool_parents.append(frontier_pool.repeat_interleave(k, dim=1))
            pool_depths.append(torch.full((k * k,), step + 1, dtype=torch.long, device=device))

            best_scores, best = child_scores.reshape(batch, -1).topk(k, dim=-1)  # [B, k]
            parent_index = best // k
            frontier_tokens = child_tokens.reshape(batch, -1).gather(1, best)
            frontier_scores = best_scores
            frontier_features = out.gather(1, parent_index[..., None].expand(-1, -1, out.shape[-1]))
            frontier_pool = pool_size + best
            frontier_rows = parent_index + (total - k)
            pool_size += k * k

        return self._select(
            torch.cat(pool_tokens, 1), torch.cat(pool_scores, 1), torch.cat(pool_parents, 1), torch.cat(pool_depths)
        )

    def _select(self, pool_tokens, pool_scores, pool_parents, pool_depths) -> BatchedTree:
        """Per row, keep the ``total_tokens - 1`` best candidates (`[B, P]`) by cumulative score; add the roots.

        A stable sort keeps a parent before a child of equal score, so the kept nodes always form a tree.
        """
        batch, size = pool_tokens.shape
        device = pool_tokens.device
        keep = min(self.total_tokens - 1, size)
        order = torch.sort(pool_scores, dim=1, descending=True, stable=True).indices[:, :keep]
        kept = torch.sort(order, dim=1).values  # pool order: parents before children
        node_of = torch.full((batch, size), -1, dtype=torch.long, device=device)
        node_of.scatter_(1, kept, torch.arange(1, keep + 1, device=device).expand(batch, keep))
        parent_pool = pool_parents.gather(1, kept)
        parents = node_of.gather(1, parent_pool.clamp(min=0))
        parents = torch.where(parent_pool < 0, torch.zeros_like(parent_pool), parents)
        parents = torch.cat([torch.full((batch, 1), -1, dtype=torch.long, device=device), parents], dim=1)
        tokens = torch.cat([self.roots[:, None].to(device), pool_tokens.gather(1, kept)], dim=1)
        depths = torch.cat([torch.zeros(batch, 1, dtype=torch.long, device=device), pool_depths[kept]], dim=1)
        scores = torch.cat([torch.zeros(batch, 1, device=device), pool_scores.gather(1, kept)], dim=1)
        valid = torch.ones(batch, keep + 1, dtype=torch.bool, device=device)
        return BatchedTree(tokens, parents, depths, batched_ancestor_mask(parents), valid, scores)
