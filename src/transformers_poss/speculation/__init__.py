"""The speculation core, for a batch of B >= 1 rows (one row is a batch of one): pure tensor code, no generation loop.

- `tree`: `DraftTree` (one row) and `BatchedTree` (B rows, padded);
- `drafter`: `PosSProposer`, the EAGLE-2 dynamic tree with position specialists; `draft_cache`: its per-specialist
  keys/values; `kv_storage`: keys/values as views of a storage that grows by doubling (both caches);
- `acceptance`: greedy / rejection-sampling acceptance of verified trees; `stats`: `AcceptanceStats`;
- `target_cache`: the target's `DynamicCache` after a verification (keep the accepted rows); `masks`: the attention
  masks of a verification forward and the per-row layout of a batch.
"""
