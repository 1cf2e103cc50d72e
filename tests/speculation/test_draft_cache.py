"""PosSDraftCache: appends into a growing storage, temporary tail rows, rows and columns replaced from outside."""

import torch

from transformers_poss import PosSDraftCache


def _kv(length, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, length, 4, generator=g), torch.randn(batch, 3, length, 4, generator=g)


def test_appends_equal_concatenation_across_growth():
    cache, keys, values = PosSDraftCache(2), [], []
    for step, length in enumerate([5, 1, 3, 60, 2, 130, 1]):  # crosses the storage's capacity several times
        k, v = _kv(length, seed=step)
        keys.append(k), values.append(v)
        got_k, got_v = cache.update(1, k, v)
        assert torch.equal(got_k, torch.cat(keys, 2)) and torch.equal(got_v, torch.cat(values, 2))
        assert torch.equal(cache.keys[1], torch.cat(keys, 2))
        assert cache.get_seq_length(1) == sum(x.shape[2] for x in keys)
    assert cache.keys[0] is None and cache.get_seq_length(0) == 0


def test_tail_rows_follow_the_context_and_never_join_it():
    cache = PosSDraftCache(1)
    ctx_k, ctx_v = _kv(7)
    cache.update(0, ctx_k, ctx_v)
    tail = [_kv(n, seed=10 + n) for n in (4, 4, 70)]  # the last one makes the storage grow mid-round
    done = 0
    for i, (k, v) in enumerate(tail):
        got_k, got_v = cache.with_tail(0, done, k, v)
        done += k.shape[2]
        assert got_k.shape[2] == 7 + done
        # the context, then every tail row written so far, in order
        written = tail[: i + 1]
        assert torch.equal(got_k, torch.cat([ctx_k] + [t[0] for t in written], 2))
        assert torch.equal(got_v, torch.cat([ctx_v] + [t[1] for t in written], 2))
    assert torch.equal(got_k, torch.cat([ctx_k] + [t[0] for t in tail], 2))
    assert cache.get_seq_length(0) == 7 and torch.equal(cache.keys[0], ctx_k)
    # the next append overwrites the tail: the context grows by the new columns only
    new_k, new_v = _kv(2, seed=99)
    got_k, got_v = cache.update(0, new_k, new_v)
    assert torch.equal(got_k, torch.cat([ctx_k, new_k], 2)) and torch.equal(got_v, torch.cat([ctx_v, new_v], 2))


def test_rows_and_columns_replaced_from_outside_are_kept():
    cache = PosSDraftCache(1)
    k, v = _kv(9, batch=3)
    cache.update(0, k, v)
    cache.select_rows(torch.tensor([2, 0]))
    more_k, more_v = _kv(2, batch=2, seed=5)
    got_k, _ = cache.update(0, more_k, more_v)
    assert torch.equal(got_k, torch.cat([k[[2, 0]], more_k], 2))
    index = torch.tensor([[0, 3, 10], [1, 2, 4]])
    cache.gather_columns(0, index)
    expected = torch.stack([got_k[b, :, index[b]] for b in range(2)])
    assert torch.equal(cache.keys[0], expected)
    tail_k, tail_v = _kv(1, batch=2, seed=6)
    got_k, _ = cache.with_tail(0, 0, tail_k, tail_v)
    assert torch.equal(got_k, torch.cat([expected, tail_k], 2))
    # keys assigned directly (as a caller may) are taken as the context, not the old storage
    fresh_k, fresh_v = _kv(4, batch=2, seed=7)
    cache.keys[0], cache.values[0] = fresh_k, fresh_v
    got_k, got_v = cache.update(0, tail_k, tail_v)
    assert torch.equal(got_k, torch.cat([fresh_k, tail_k], 2)) and torch.equal(got_v, torch.cat([fresh_v, tail_v], 2))


def test_round_state_joins_only_the_levels_a_specialist_has_not_projected():
    """`_RoundState._rows_from(done)` returns fused rows ``done ..`` with their RoPE, equal to slicing all levels
    joined, and the last level as given (same tensor) when only it is asked."""
    from transformers_poss.speculation.drafter import _RoundState

    torch.manual_seed(0)
    state, sizes = _RoundState(), [1, 4, 4, 3]
    for level, k in enumerate(sizes):
        parents = None if level == 0 else torch.zeros(2, k, dtype=torch.long)
        state.add(torch.randn(2, k, 5), (torch.randn(2, k, 3), torch.randn(2, k, 3)), parents)
    hidden = torch.cat([part[0] for part in state.parts], dim=1)
    rope = [torch.cat([part[1][i] for part in state.parts], dim=1) for i in range(2)]
    for done in (0, 1, 5, 9):
        rows, (cos, sin) = state._rows_from(done)
        assert torch.equal(rows, hidden[:, done:]) and torch.equal(cos, rope[0][:, done:])
        assert torch.equal(sin, rope[1][:, done:])
    assert state._rows_from(9)[0] is state.parts[-1][0]
