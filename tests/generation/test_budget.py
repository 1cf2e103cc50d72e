"""Speculation budget: cost profiles, per-round node choice, fallback, replay of recorded rounds."""

import torch

from helpers import tiny_draft, tiny_llama
from transformers_poss.generation.budget import (
    CostProfile,
    RoundRecord,
    TreeBudget,
    measure_draft_seconds,
    measure_verify_seconds,
    simulate_shape,
    truncated_accepted,
)


def _profile(curve, draft=0.0):
    return CostProfile(key="k", verify_seconds=curve, draft_context_seconds=draft, draft_step_seconds=draft)


def test_profile_interpolates_and_round_trips():
    p = _profile({1: 1.0, 4: 2.5, 8: 4.0})
    assert p.verify(2) == 1.5 and p.verify(8) == 4.0 and p.verify(12) == 5.5
    assert p.curve() == {1: 1.0, 4: 2.5, 8: 4.0}
    assert CostProfile.from_json(p.to_json()) == p


def _scores():
    # root, two depth-1 nodes (p=.9, .05), children of node 1 (p=.8*.9, .1*.9), child of node 3 (p=.7*.72)
    probs = torch.tensor([1.0, 0.9, 0.05, 0.72, 0.09, 0.504])
    return probs.log()


_DEPTHS = torch.tensor([0, 1, 1, 2, 2, 3])  # depths of the nodes of _scores()


def test_flat_cost_keeps_every_node_steep_cost_keeps_few():
    scores = _scores()
    flat = TreeBudget(_profile({1: 1.0, 64: 1.0}), depth=3, max_nodes=6)
    keep, _ = flat.choose(scores)
    assert keep.tolist() == [0, 1, 2, 3, 4, 5]
    steep = TreeBudget(_profile({1: 1.0, 2: 1.3, 64: 64.0}), depth=3, max_nodes=6)
    keep, rate = steep.choose(scores)
    assert keep.tolist()[0] == 0 and len(keep) < 6
    # kept nodes are closed under parents: node 5 (child of 3, child of 1) only with 3 and 1
    assert set(keep.tolist()) <= {0, 1, 3, 5} and rate > 1.0


def test_calibration_and_fallback():
    budget = TreeBudget(_profile({1: 1.0, 2: 1.9, 64: 64.0}, draft=0.5), depth=3, max_nodes=6, warmup_rounds=3)
    for _ in range(3):
        budget.choose(_scores())
        budget.observe(0)  # the draft is always wrong
    assert budget.calibration < 0.7
    assert budget.should_fall_back()
    good = TreeBudget(_profile({1: 1.0, 8: 1.05}, draft=0.01), depth=3, max_nodes=6, warmup_rounds=3)
    for _ in range(3):
        good.choose(_scores())
        good.observe(3)
    assert not good.should_fall_back() and good.predicted_speedup() > 1.5


def test_fallback_uses_the_acceptance_observed_not_the_drafts_estimate():
    """A draft confident in its first rounds but never right: the rounds so far are slower than plain decoding, so
    the budget falls back right after its warm-up, whatever the draft's probabilities promised."""
    budget = TreeBudget(_profile({1: 1.0, 2: 1.2, 64: 1.5}), depth=3, max_nodes=6, warmup_rounds=2)
    for _ in range(2):
        keep, rate = budget.choose(_scores(), _DEPTHS)
        assert len(keep) > 1 and rate > 1.5  # the draft's estimate: well worth it
        budget.observe(0)
    assert budget.tokens == 2 and budget.predicted_speedup() < 1.0 and budget.should_fall_back()


def test_replay_truncation():
    record = RoundRecord(depths=torch.tensor([0, 1, 1, 2, 2, 3]), scores=_scores(), path=torch.tensor([0, 1, 3, 5]))
    assert truncated_accepted(record, depth=3, total_tokens=6) == 3
    assert truncated_accepted(record, depth=2, total_tokens=6) == 2
    assert truncated_accepted(record, depth=3, total_tokens=2) == 1  # only the best node (1) survives
    result = simulate_shape([record, record], _profile({1: 1.0, 6: 2.0}), depth=3, total_tokens=6)
    assert result["mean_acceptance_length"] == 4.0 and abs(result["predicted_speedup"] - 2.0) < 1e-9


def test_measurements_run_on_a_tiny_model():
    target = tiny_llama()
    times = measure_verify_seconds(target, sizes=(1, 4), context_length=16, repeats=2)
    assert set(times) == {1, 4} and all(t > 0 for t in times.values())
    context, step = measure_draft_seconds(tiny_draft(target), top_k=2, context_length=16, repeats=2)
    assert context > 0 and step >= 0


def _generate(target, draft, **kwargs):
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(3))
    plain = target.generate(ids, max_new_tokens=24, do_sample=False)
    out = target.generate(ids, assistant_model=draft, max_new_tokens=24, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)  # lossless whatever the budget decides
    return out.acceptance


def test_auto_budget_in_generate_measures_once_and_stays_lossless(tmp_path, monkeypatch):
    monkeypatch.setenv("POSS_CACHE", str(tmp_path))
    target = tiny_llama()
    draft = tiny_draft(target)
    draft.generation_config.tree_total_tokens = "auto"
    draft.generation_config.tree_max_total_tokens = 8
    stats = _generate(target, draft)
    assert len(list((tmp_path / "costs").glob("*.json"))) == 1  # the profile is cached on disk
    assert stats.num_rounds >= 1


def test_auto_budget_falls_back_when_speculation_cannot_pay(tmp_path, monkeypatch):
    from transformers_poss.generation import budget as budget_module

    # a machine where drafting is very expensive: no tree can pay for itself
    expensive = _profile({1: 1.0, 64: 2.0}, draft=50.0)
    monkeypatch.setattr(budget_module, "load_or_measure_profile", lambda *a, **k: expensive)
    target = tiny_llama()
    draft = tiny_draft(target)
    draft.generation_config.tree_total_tokens = "auto"
    stats = _generate(target, draft)
    assert stats.fell_back_to_plain
    assert stats.accepted_lengths[-1] == 1


def test_rounds_are_recorded_for_replay():
    target = tiny_llama()
    draft = tiny_draft(target)
    draft.generation_config.tree_record_rounds = True
    stats = _generate(target, draft)
    assert len(stats.rounds) == stats.num_rounds
    profile = _profile({1: 1.0, 64: 1.0})
    replay = simulate_shape(stats.rounds, profile, depth=6, total_tokens=60)
    assert abs(replay["mean_acceptance_length"] - stats.mean_acceptance_length) < 1e-9


def test_chain_rounds_replayed_as_a_chain_match_the_run():
    """Rounds of a tree_top_k=1 run are chains: replaying them as chains of the same depth gives the run's acceptance,
    shorter chains accept a prefix of it."""
    target = tiny_llama()
    draft = tiny_draft(target)
    train_ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(3))
    from tree_testing import train_draft_briefly

    train_draft_briefly(target, draft, [train_ids], steps=80)
    draft.generation_config.tree_depth, draft.generation_config.tree_top_k = 4, 1
    draft.generation_config.tree_total_tokens = 5
    draft.generation_config.tree_record_rounds = True
    stats = _generate(target, draft)
    assert max(stats.accepted_lengths) >= 3
    profile = _profile({1: 1.0, 64: 1.0})
    replay = simulate_shape(stats.rounds, profile, depth=4, total_tokens=5, top_k=1)
    assert replay["kind"] == "chain" and abs(replay["mean_acceptance_length"] - stats.mean_acceptance_length) < 1e-9
    for record, accepted in zip(stats.rounds, stats.accepted_lengths):
        assert truncated_accepted(record, 4, 5, top_k=1) == accepted - 1
        assert truncated_accepted(record, 2, 60, top_k=1) == min(accepted - 1, 2)



def test_depth_is_chosen_with_the_nodes():
    # a drafting step costs as much as a verification: only the depth-1 nodes pay for their drafting
    costly = TreeBudget(_profile({1: 1.0, 64: 1.0}, draft=1.0), depth=3, max_nodes=6)
    keep, rate = costly.choose(_scores(), _DEPTHS)
    assert keep.tolist() == [0, 1, 2] and costly.chosen_depth == 1 and costly.next_depth == 2
    assert abs(rate - 1.95 / 2.0) < 1e-6  # (1 + 0.9 + 0.05) / (draft(1) + t(3))
    # free drafting and flat verification: every node, the full depth
    free = TreeBudget(_profile({1: 1.0, 64: 1.0}), depth=3, max_nodes=6)
    keep, _ = free.choose(_scores(), _DEPTHS)
    assert keep.tolist() == [0, 1, 2, 3, 4, 5] and free.chosen_depth == 3 and free.next_depth == 3
    # a shallower drafted tree: only its depths are candidates, the next round probes one level deeper
    keep, _ = free.choose(_scores()[:3], _DEPTHS[:3], drafted_depth=1)
    assert keep.tolist() == [0, 1, 2] and free.chosen_depth == 1 and free.next_depth == 2
    # nothing pays: root only, depth 0, and the next round drafts one level
    steep = TreeBudget(_profile({1: 1.0, 2: 100.0, 64: 100.0}), depth=3, max_nodes=6)
    keep, _ = steep.choose(_scores(), _DEPTHS)
    assert keep.tolist() == [0] and steep.chosen_depth == 0 and steep.next_depth == 1
    # the node cap holds across depths
    capped = TreeBudget(_profile({1: 1.0, 64: 1.0}), depth=3, max_nodes=3)
    keep, _ = capped.choose(_scores(), _DEPTHS)
    assert keep.tolist() == [0, 1, 3] and capped.chosen_depth == 2


def test_auto_budget_chooses_the_drafting_depth(monkeypatch):
    from transformers_poss.generation import budget as budget_module
    from transformers_poss.speculation.drafter import PosSProposer

    # flat verification, expensive drafting steps: depth-1 trees pay, deeper levels do not
    profile = CostProfile(key="k", verify_seconds={1: 1.0, 64: 1.0}, draft_context_seconds=0.01,
                          draft_step_seconds=5.0)
    monkeypatch.setattr(budget_module, "load_or_measure_profile", lambda *a, **k: profile)
    monkeypatch.setattr(TreeBudget, "should_fall_back", lambda self: False)
    monkeypatch.setattr(TreeBudget, "plain_probe_due", lambda self: False)  # depths only: no plain probe rounds
    drafted = []
    original = PosSProposer.propose

    def propose(self, *args):
        drafted.append(self.depth)
        return original(self, *args)

    monkeypatch.setattr(PosSProposer, "propose", propose)
    target = tiny_llama()
    draft = tiny_draft(target)
    draft.generation_config.tree_depth, draft.generation_config.tree_top_k = 4, 3
    draft.generation_config.tree_total_tokens = "auto"
    stats = _generate(target, draft)
    assert drafted[0] == 4 and set(drafted[1:]) == {2}  # chosen depth 1, probing depth 2
    # (the last round may be cut to its root: the token budget is spent)
    assert stats.tree_depths[:-1] == [1] * (stats.num_rounds - 1) and not stats.fell_back_to_plain

    # cheap drafting: the depth grows back to the configured one, one level per round at most
    cheap = CostProfile(key="k", verify_seconds={1: 1.0, 64: 1.0}, draft_context_seconds=0.0, draft_step_seconds=0.0)
    monkeypatch.setattr(budget_module, "load_or_measure_profile", lambda *a, **k: cheap)
    drafted.clear()
    stats = _generate(target, draft)
    assert len(stats.tree_depths) == stats.num_rounds
    assert all(d <= max(previous, 1) + 1 for previous, d in zip(stats.tree_depths, stats.tree_depths[1:]))
    assert all(d <= drafted_depth for d, drafted_depth in zip(stats.tree_depths, drafted))
    assert max(drafted) == 4


def test_first_measurement_shows_a_progress_bar_over_its_points(tmp_path, monkeypatch, capsys):
    """The first call measures with a progress bar (transformers' tqdm, one step per measured point) and caches the
    profile; the next call reads the same profile back without measuring; transformers' switch turns the bar off."""
    from transformers.utils import logging as hf_logging

    from transformers_poss.generation import budget, cost_profile

    monkeypatch.setenv("POSS_CACHE", str(tmp_path))
    bars = []

    def hook(factory, args, kwargs):
        bars.append((factory, kwargs, factory(*args, **kwargs)))
        return bars[-1][2]

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()
    hf_logging.set_tqdm_hook(hook)
    try:
        target = tiny_llama()
        draft = tiny_draft(target)
        sizes = (1, 2, 4)
        profile = budget.load_or_measure_profile(target, draft, top_k=2, sizes=sizes)
        again = budget.load_or_measure_profile(target, draft, top_k=2, sizes=sizes)
        hf_logging.disable_progress_bar()
        quiet = budget.load_or_measure_profile(target, None, top_k=2, sizes=sizes)
    finally:
        hf_logging.set_tqdm_hook(None)
        (hf_logging.enable_progress_bar if was_enabled else hf_logging.disable_progress_bar)()
    path = tmp_path / "costs" / f"{budget.profile_key(target, draft, 2)}.json"
    assert again == profile and CostProfile.from_json(path.read_text()) == profile  # cached: no second measurement
    assert set(profile.verify_seconds) == set(sizes) and all(t > 0 for t in profile.verify_seconds.values())
    assert profile.draft_context_seconds > 0 and profile.draft_step_seconds >= 0 and profile.meta["top_k"] == 2
    assert set(quiet.verify_seconds) == set(sizes) and quiet.draft_context_seconds == 0.0
    (factory, kwargs, bar), (quiet_factory, _, _) = bars  # one bar per measurement, none for the cached read
    assert kwargs["desc"] == f"measuring verification cost t(n) (once, cached at {path})"
    points = (cost_profile.VERIFY_REPEATS + 1) * len(sizes) + cost_profile.DRAFT_POINTS
    assert bar.total == points and bar.n == points
    assert quiet_factory is hf_logging.EmptyTqdm  # transformers' progress-bar switch is honoured
    assert "measuring verification cost t(n)" in capsys.readouterr().err


def test_plain_probes_measure_the_speedup_and_decide_the_fall_back():
    """Root-only probe rounds time a plain step in the call itself; the fall-back then follows what was measured,
    not the profile (here the profile promises 2x, the measured rounds are slower than plain steps)."""
    optimistic = _profile({1: 0.01, 8: 0.01}, draft=0.0)
    budget = TreeBudget(optimistic, depth=3, max_nodes=8, warmup_rounds=2, plain_probes=(1,), plain_probe_every=4)
    due = []
    for _ in range(14):
        due.append(budget.plain_probe_due())
        if due[-1]:
            budget.observe_plain(0.010, verify_seconds=0.009)
            continue
        budget.choose(torch.tensor([0.0, -0.1, -0.2, -0.3]), torch.tensor([0, 1, 2, 3]))
        budget.observe(1)  # 2 tokens a round
        budget.observe_seconds(0.030, verify_seconds=0.009, nodes=4)  # but drafting makes a round 3 plain steps
    assert due == [False, True, False, False, True, False, False, False, True] + [False, False, False, True, False]
    assert budget.predicted_speedup() > 1.5
    assert abs(budget.measured_speedup() - 2 / 3) < 1e-9 and budget.should_fall_back()
    # the profile's verification shape matched (every forward 0.9x of it): no reason to measure it again
    assert abs(budget.profile_error() - 1.0) < 1e-9
    assert TreeBudget(optimistic, depth=3, max_nodes=8).profile_error() is None  # nothing measured yet
    # one-node forwards 5x cheaper than profiled, tree forwards as profiled: the shape is off
    skewed = TreeBudget(optimistic, depth=3, max_nodes=8)
    for _ in range(3):
        skewed.observe_plain(0.002, verify_seconds=0.2)
    skewed._last = (0.5, 1.0)
    for _ in range(8):
        skewed.observe(1)
        skewed.observe_seconds(1.0, verify_seconds=1.0, nodes=4)
    assert skewed.profile_error() == 5.0


def test_a_profile_far_from_the_measured_costs_is_measured_again(tmp_path, monkeypatch):
    from transformers_poss.generation import cost_profile

    monkeypatch.setenv("POSS_CACHE", str(tmp_path))
    profile = _profile({1: 1.0, 8: 1.0})
    path = tmp_path / "costs" / f"{profile.key}.json"
    path.parent.mkdir(parents=True)
    path.write_text(profile.to_json())
    cost_profile.forget_profile(profile.key, "test")
    assert not path.exists()


def _run_rounds(budget, rounds, plain_seconds, round_seconds, tokens=2):
    """Drive ``budget`` like the loop does (which hands over at a fall-back); the costs are functions of the round
    index. Returns the round at which a fall-back was decided (or None) and the indices of the plain probes."""
    probes = []
    for _ in range(rounds):
        if budget.should_fall_back():
            return budget.round_index, probes
        index = budget.round_index
        if budget.plain_probe_due():
            probes.append(index)
            budget.observe_plain(plain_seconds(index), verify_seconds=plain_seconds(index))
            continue
        budget.choose(torch.tensor([0.0, -0.1, -0.2, -0.3]), torch.tensor([0, 1, 2, 3]))
        budget.observe(tokens - 1)
        budget.observe_seconds(round_seconds(index), verify_seconds=round_seconds(index), nodes=4)
    return None, probes


def test_load_that_arrives_after_the_probes_does_not_end_speculation():
    """Rounds pay 1.67x; from round 6 on other work doubles every cost. Compared with the early (unloaded) probes
    the loaded rounds look slower than plain decoding, but each probe is paired with the rounds beside it and a
    fall-back needs a fresh probe, which sees the load too."""
    profile = _profile({1: 0.01, 8: 0.01}, draft=0.0)
    budget = TreeBudget(profile, depth=3, max_nodes=8, warmup_rounds=8, plain_probes=(1, 3), plain_probe_every=32)
    load = lambda index: 2.0 if index >= 6 else 1.0  # noqa: E731
    decided, probes = _run_rounds(budget, 40, lambda i: 0.010 * load(i), lambda i: 0.012 * load(i))
    assert decided is None and budget.measured_speedup() > 1.3
    totals = budget.measured_tokens / budget.measured_seconds * min(seconds for _, seconds in budget.plain_rounds)
    assert totals < 1.0  # what the call's totals against the unloaded probe would have said


def test_a_losing_call_falls_back_only_on_a_fresh_probe():
    """Rounds at 0.8x of plain decoding: once the warm-up is over, a probe is taken beside the latest rounds, and
    the fall-back follows it (not a comparison with probes many rounds old)."""
    profile = _profile({1: 0.01, 8: 0.01}, draft=0.0)
    budget = TreeBudget(profile, depth=3, max_nodes=8, warmup_rounds=8, plain_probes=(1, 3), plain_probe_every=32)
    decided, probes = _run_rounds(budget, 16, lambda i: 0.010, lambda i: 0.025)
    assert decided is not None and probes[:2] == [1, 3] and len(probes) == 3
    assert 0 < decided - probes[-1] <= TreeBudget.PAIR_WINDOW
    assert abs(budget.measured_speedup() - 0.8) < 1e-9


def test_rounds_with_nothing_to_verify_are_timed_as_plain_steps(monkeypatch):
    """With context candidates the budget may draft nothing (depth 0) and the context may offer nothing: such a
    root-only round is a plain step, so it feeds the plain side of the comparison, never the speculative side (where
    it would look like speculation that did not pay and end the call's speculation). A round that drafted and kept
    only the root paid for drafting: it stays on the speculative side."""
    from transformers_poss.generation import budget as budget_module

    monkeypatch.setattr(budget_module, "load_or_measure_profile", lambda *a, **k: _profile({1: 0.01, 8: 0.01}))
    def root_only(self, scores, depths=None, drafted_depth=None):  # keep the root only, draft nothing next round
        self.next_depth, self._last = 0, (0.0, 0.01)
        return torch.zeros(1, dtype=torch.long), 1.0

    monkeypatch.setattr(TreeBudget, "choose", root_only)
    seen = {"plain": 0, "speculative": 0}
    plain, speculative = TreeBudget.observe_plain, TreeBudget.observe_seconds

    def count(kind, method):
        def wrapper(self, *args, **kwargs):
            seen[kind] += 1
            return method(self, *args, **kwargs)
        return wrapper

    monkeypatch.setattr(TreeBudget, "observe_plain", count("plain", plain))
    monkeypatch.setattr(TreeBudget, "observe_seconds", count("speculative", speculative))
    target = tiny_llama()
    draft = tiny_draft(target)
    draft.generation_config.tree_total_tokens = "auto"
    draft.generation_config.tree_context_candidates = True
    stats = _generate(target, draft)
    # the first round drafted (and paid for it); every later one drafted nothing and verified nothing
    assert not stats.fell_back_to_plain and seen["speculative"] == 1 and seen["plain"] == stats.num_rounds - 1 == 22


def test_a_pause_then_speculation_again_and_the_hand_over_once_a_pause_outlasts_the_call(monkeypatch):
    """Speculation found not to pay is paused for 16 plain rounds (root-only, counted as plain steps), then drafted
    again; only when the next pause would outlast the call does the stock loop take over. Greedy output is unchanged
    throughout."""
    from transformers_poss.generation import budget as budget_module

    monkeypatch.setattr(budget_module, "load_or_measure_profile", lambda *a, **k: _profile({1: 1.0, 64: 1.0}, 0.01))
    monkeypatch.setattr(TreeBudget, "plain_probe_due", lambda self: False)
    losing = {"rounds": set()}  # the drafted-round counts at which the budget finds that speculation loses

    def should_fall_back(self):
        return self.rounds >= max(self.warmup_rounds, self.resume_rounds) and self.rounds in losing["rounds"]

    monkeypatch.setattr(TreeBudget, "should_fall_back", should_fall_back)
    target = tiny_llama()
    draft = tiny_draft(target)
    draft.generation_config.tree_total_tokens = "auto"
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(3))
    plain = target.generate(ids, max_new_tokens=60, do_sample=False)

    losing["rounds"] = {8}  # once: a pause, then speculation to the end
    out = target.generate(ids, assistant_model=draft, max_new_tokens=60, do_sample=False, return_dict_in_generate=True)
    stats = out.acceptance
    assert torch.equal(out.sequences, plain) and not stats.fell_back_to_plain and stats.plain_steps == 16
    assert stats.tree_depths[8:24] == [0] * 16 and all(d > 0 for d in stats.tree_depths[24:-1])

    losing["rounds"] = {8, 12}  # again after the pause: the next pause (32 rounds) would outlast the call
    out = target.generate(ids, assistant_model=draft, max_new_tokens=60, do_sample=False, return_dict_in_generate=True)
    stats = out.acceptance
    assert torch.equal(out.sequences, plain) and stats.fell_back_to_plain
    assert stats.tree_depths[8:24] == [0] * 16 and stats.num_rounds == len(stats.tree_depths)


def test_a_profile_measured_under_load_is_made_monotone_and_one_far_off_in_scale_is_dropped():
    from transformers_poss.generation.cost_profile import monotone

    # measured beside other work: t(3) and t(4) far above t(24); a forward over more tokens never costs less
    measured = {1: 0.225, 2: 0.449, 3: 4.04, 4: 4.0, 16: 2.55, 24: 0.648, 32: 0.643, 64: 1.24}
    assert monotone(measured) == {1: 0.225, 2: 0.449, 3: 0.643, 4: 0.643, 16: 0.643, 24: 0.643, 32: 0.643, 64: 1.24}
    assert monotone({1: 1.0, 2: 1.5, 4: 2.0}) == {1: 1.0, 2: 1.5, 4: 2.0}  # a sane curve is kept as it is
    # its shape may even match the drafted rounds, but plain steps cost a quarter of its t(1): measured again
    budget = TreeBudget(_profile({1: 0.2, 8: 0.4}), depth=3, max_nodes=8)
    for _ in range(3):
        budget.observe_plain(0.05, verify_seconds=0.05)
    assert budget.plain_cost_error() == 4.0
    assert TreeBudget(_profile({1: 0.2, 8: 0.4}), depth=3, max_nodes=8).plain_cost_error() is None
