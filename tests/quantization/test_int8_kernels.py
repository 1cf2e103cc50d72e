"""The int8 kernels agree bit for bit, fused projections equal their members, and the int8 path's edges."""

import copy

import pytest
import torch

import transformers_poss.quantization.exact_attention as exact_attention
import transformers_poss.quantization.int8_kernels as kernels
from transformers_poss import Int8Linear, quantize_int8
from transformers_poss.quantization.int8 import FusedProjections
from tree_testing import tiny_llama_target


def _rows(m, k, seed=0):
    return kernels.QuantizedRows(torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 4)


@pytest.mark.parametrize("shape", [(96, 40), (576, 160), (1100, 24)])
def test_every_available_kernel_gives_the_exact_integer_product(shape):
    in_features, out_features = shape
    weight = torch.randint(-127, 128, (out_features, in_features), generator=torch.Generator().manual_seed(3),
                           dtype=torch.int8)
    state = kernels.KernelState(weight.t().contiguous())
    for m in (1, 5, 17):
        rows = _rows(m, in_features, seed=m)
        exact = rows.integers.double() @ weight.double().t()
        for kernel in kernels.available_kernels():
            assert torch.equal(state.product(rows, kernel).double(), exact), (kernel, m)


def test_a_forced_kernel_is_used_and_a_wrong_name_is_refused(monkeypatch):
    monkeypatch.setenv(kernels.KERNEL_ENV, "int_mm")
    assert kernels.available_kernels() == ("int_mm",)
    monkeypatch.setenv(kernels.KERNEL_ENV, "fastest")
    with pytest.raises(ValueError, match="POSS_INT8_KERNEL='fastest'"):
        kernels.available_kernels()


def test_kernel_choice_does_not_change_a_bit(monkeypatch):
    """Outputs of an Int8Linear are the same whichever kernel each shape and row count gets."""
    torch.manual_seed(0)
    layer = Int8Linear(torch.randn(48, 64))
    x = torch.randn(7, 64)
    results = []
    for kernel in kernels.available_kernels():
        monkeypatch.setattr(kernels, "_choices", {})
        monkeypatch.setenv(kernels.KERNEL_ENV, kernel)
        results.append(layer(x))
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_fused_projections_equal_their_members_and_follow_weight_changes():
    target = tiny_llama_target()
    reference = copy.deepcopy(target)
    quantize_int8(target)
    attention = target.model.layers[0].self_attn
    assert isinstance(attention.q_proj.__dict__.get("_fused"), FusedProjections)
    x = torch.randn(2, 5, attention.q_proj.in_features)
    fused = [attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)]
    alone = [Int8Linear.from_linear(getattr(reference.model.layers[0].self_attn, n))(x) for n in ("q_proj", "k_proj", "v_proj")]
    assert all(torch.equal(a, b) for a, b in zip(fused, alone))
    # a member called with another tensor recomputes; loading weights in place reaches the fused matrix
    y = torch.randn(1, 3, attention.q_proj.in_features)
    assert torch.equal(attention.k_proj(y), alone_k := Int8Linear.from_linear(reference.model.layers[0].self_attn.k_proj)(y))
    state = {k: torch.zeros_like(v) for k, v in attention.k_proj.state_dict().items()}
    attention.k_proj.load_state_dict(state)
    assert attention.k_proj(y).abs().max() == 0 and not torch.equal(alone_k, attention.k_proj(y))
    assert torch.equal(attention.q_proj(y), Int8Linear.from_linear(reference.model.layers[0].self_attn.q_proj)(y))


def test_a_member_whose_buffer_was_replaced_runs_alone_and_its_siblings_stay_fused():
    target = tiny_llama_target()
    reference = copy.deepcopy(target).model.layers[0].self_attn
    quantize_int8(target)
    attention = target.model.layers[0].self_attn
    x = torch.randn(1, 4, attention.q_proj.in_features)
    fused = attention.q_proj.__dict__["_fused"]
    attention.v_proj.weight_scale = attention.v_proj.weight_scale * 2  # a new tensor, not a view of the whole
    assert fused.serves(attention.q_proj) and not fused.serves(attention.v_proj)
    q, k, v = attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)
    assert torch.equal(q, Int8Linear.from_linear(reference.q_proj)(x))
    assert torch.equal(k, Int8Linear.from_linear(reference.k_proj)(x))
    assert torch.allclose(v, 2 * Int8Linear.from_linear(reference.v_proj)(x), rtol=1e-6)


def test_int8_model_runs_under_inference_mode():
    target = quantize_int8(tiny_llama_target())
    ids = torch.randint(3, 90, (1, 9))
    with torch.no_grad():
        expected = target(ids).logits
    with torch.inference_mode():
        got = target(ids).logits
        generated = target.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(expected, got) and generated.shape[1] == 13


def test_saving_an_int8_model_is_refused_with_advice(tmp_path):
    target = quantize_int8(tiny_llama_target())
    with pytest.raises(ValueError, match="quantized in place by quantize_int8.*Save the float model before"):
        target.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_long_prompts_attend_in_chunks_with_the_same_bits(monkeypatch):
    """Prefill memory is bounded: queries run in chunks, and each query's result does not change."""
    torch.manual_seed(0)
    query, key, value = torch.randn(1, 4, 40, 16), torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    whole = exact_attention.exact_attention_forward(None, query, key, value, None)[0]
    monkeypatch.setattr(exact_attention, "QUERY_CHUNK_BYTES", 8 * 4 * 40 * 7)  # chunks of 7 queries
    chunked = exact_attention.exact_attention_forward(None, query, key, value, None)[0]
    assert torch.equal(whole, chunked)
    causal = torch.ones(40, 40, dtype=torch.bool).tril()[None, None]
    assert torch.equal(exact_attention.exact_attention_forward(None, query, key, value, causal)[0], whole)


def test_a_quantized_draft_runs_one_operator_per_linear_and_stays_close():
    """Drafts get per-call activation scales (one fbgemm call per linear); targets keep per-token scales."""
    from torch.profiler import profile

    from transformers_poss import PosSDraftConfig, PosSDraftModel

    target = quantize_int8(tiny_llama_target())
    assert all(m.per_token for m in target.modules() if isinstance(m, Int8Linear))
    draft = PosSDraftModel(PosSDraftConfig.for_target(target.config, num_specialists=1, positions_per_specialist=1))
    reference = copy.deepcopy(draft)
    quantize_int8(draft)
    layers = [m for m in draft.modules() if isinstance(m, Int8Linear)]
    if not kernels.fbgemm_available():
        pytest.skip("this torch build has no fbgemm: drafts keep per-token scales")
    assert layers and not any(m.per_token for m in layers)
    linear = layers[0]
    x = torch.randn(4, linear.in_features)
    linear(x)  # packs the weight once
    with profile() as prof:
        out = linear(x)
    ops = [e.name for e in prof.events() if e.cpu_parent is None]
    assert ops.count("quantized::linear_dynamic") == 1 and len(ops) <= 4, ops
    name = next(n for n, m in draft.named_modules() if m is linear)
    exact = dict(reference.named_modules())[name](x)
    assert (out - exact).norm() / exact.norm() < 0.03


def test_fused_projections_hold_no_output_after_every_member_read_it():
    """A long prompt's q/k/v and gate/up outputs must not stay alive in every layer after the forward."""
    target = quantize_int8(tiny_llama_target())
    with torch.no_grad():
        target(torch.randint(3, 90, (1, 40)))
    groups = {id(m.__dict__["_fused"]): m.__dict__["_fused"] for m in target.modules() if "_fused" in m.__dict__}
    assert groups and all(group._last is None for group in groups.values())


def test_a_quantized_draft_shares_one_fbgemm_call_between_siblings_bit_for_bit():
    """k/v and gate/up of a draft (one activation scale per call) read the same input: one call serves both, with the
    bits of each member's own call."""
    from torch.profiler import profile

    from transformers_poss import PosSDraftConfig, PosSDraftModel

    if not kernels.fbgemm_available():
        pytest.skip("this torch build has no fbgemm: drafts keep per-token scales")
    target = tiny_llama_target()
    draft = quantize_int8(PosSDraftModel(PosSDraftConfig.for_target(target.config, num_specialists=1,
                                                                     positions_per_specialist=1)))
    layer = draft.layers[0]
    x = torch.randn(1, 4, layer.mlp.gate_proj.in_features)
    for group in (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj"))):
        parent = getattr(layer, group[0])
        members = [getattr(parent, name) for name in group[1]]
        assert isinstance(members[0].__dict__.get("_fused"), FusedProjections)
        alone = []
        for member in members:  # each member's own fbgemm call on an unfused copy
            single = Int8Linear.__new__(Int8Linear)
            torch.nn.Module.__init__(single)
            single.out_features, single.in_features, single.per_token = member.out_features, member.in_features, False
            for name in ("weight_int8_t", "weight_scale", "bias"):
                value = getattr(member, name)
                single.register_buffer(name, None if value is None else value.clone())
            alone.append(single(x))
        with profile() as prof:
            shared = [member(x) for member in members]
        calls = [e.name for e in prof.events()].count("quantized::linear_dynamic")
        assert calls == 1 and all(torch.equal(a, b) for a, b in zip(shared, alone))


def test_kernels_are_chosen_when_the_model_is_quantized(monkeypatch):
    """Every weight shape and row bucket has its kernel before the first forward, so no forward (and no round a
    speculation budget measures) pays for the timing."""
    monkeypatch.setattr(kernels, "_choices", {})
    target = quantize_int8(tiny_llama_target())
    assert {b for (_, _, b) in kernels._choices} == set(kernels.ROW_BUCKETS)
    timed = []
    monkeypatch.setattr(kernels, "_time_kernels", lambda *a, **k: timed.append(a) or "int_mm")
    with torch.no_grad():
        for n in (1, 3, 16, 40, 70):
            target(torch.randint(3, 90, (1, n)))
    assert not timed and kernels._choices


def test_the_seven_bit_kernel_is_not_timed_where_the_eight_bit_one_is_exact(monkeypatch):
    """Both run the same fbgemm GEMM, the 7-bit one on twice the rows: timing it too only lets noise pick it."""
    monkeypatch.setattr(kernels, "available_kernels", lambda: ("int_mm", "fbgemm8", "fbgemm"))
    assert kernels.candidate_kernels() == ("int_mm", "fbgemm8")
    monkeypatch.setattr(kernels, "available_kernels", lambda: ("int_mm", "fbgemm"))
    assert kernels.candidate_kernels() == ("int_mm", "fbgemm")
    monkeypatch.setattr(kernels, "available_kernels", lambda: ("fbgemm8",))
    assert kernels.candidate_kernels() == ("fbgemm8",)


def test_kernel_timing_interleaves_the_kernels(monkeypatch):
    """Each round runs every kernel once, so drift of the machine hits them alike; the least time wins."""
    state = kernels.KernelState(torch.randint(-127, 128, (32, 8), dtype=torch.int8))
    calls, costs, now = [], {"int_mm": 3e-3, "fbgemm8": 1e-3}, [0.0]

    def product(self, rows, kernel):
        calls.append(kernel)
        now[0] += costs[kernel]

    monkeypatch.setattr(kernels.KernelState, "product", product)
    monkeypatch.setattr(kernels.time, "perf_counter", lambda: now[0])
    assert kernels._time_kernels(state, 4, ("int_mm", "fbgemm8"), repeats=3) == "fbgemm8"
    # one warm-up call each, one screening call each, then alternating rounds
    assert calls[2:] == ["int_mm", "fbgemm8"] * 4


def test_a_kernel_far_slower_in_one_call_is_not_timed_further(monkeypatch):
    """A kernel with no fast path on this CPU (oneDNN's int8 GEMM took seconds a call on one) is dropped after one
    timed call instead of being run in every round; within the screening factor it is timed as usual."""
    state = kernels.KernelState(torch.randint(-127, 128, (32, 8), dtype=torch.int8))
    calls, now = [], [0.0]
    costs = {"int_mm": 3e-5, "onednn": 3e-5 * (kernels.SCREEN_FACTOR + 1), "fbgemm8": 2e-5}

    def product(self, rows, kernel):
        calls.append(kernel)
        now[0] += costs[kernel]

    monkeypatch.setattr(kernels.KernelState, "product", product)
    monkeypatch.setattr(kernels.time, "perf_counter", lambda: now[0])
    assert kernels._time_kernels(state, 16, ("int_mm", "onednn", "fbgemm8"), repeats=5) == "fbgemm8"
    assert calls.count("onednn") == 2 and calls.count("int_mm") == 7  # warm-up and screening only
    calls.clear()
    costs["fbgemm8"] = 1.0  # the only one left after screening is chosen without further rounds
    assert kernels._time_kernels(state, 16, ("int_mm", "fbgemm8"), repeats=5) == "int_mm"
    assert calls == ["int_mm", "fbgemm8"] * 2


def test_timing_leaves_only_the_packed_copies_a_chosen_kernel_reads(monkeypatch):
    """Choosing times every kernel on one weight of each shape, which packs it for each; the copies no choice reads
    are dropped (each is as large as the weight)."""
    monkeypatch.setattr(kernels, "_choices", {})
    monkeypatch.setattr(kernels, "candidate_kernels", lambda rows=64: ("int_mm", "onednn", "fbgemm8"))
    monkeypatch.setattr(kernels, "_time_kernels", lambda state, bucket, names, repeats=7: (
        state.packed(), state.onednn(), "onednn" if bucket >= 16 else "int_mm")[-1])
    if not (kernels.onednn_available() and kernels.fbgemm_available()):
        pytest.skip("this torch build lacks oneDNN's or fbgemm's int8 GEMM")
    target = quantize_int8(tiny_llama_target())
    states = [m.__dict__["_fused"].state if "_fused" in m.__dict__ else m.__dict__.get("_kernel")
              for m in target.modules() if isinstance(m, Int8Linear)]
    timed = [s for s in states if s is not None and (s._packed is not None or s._onednn is not None)]
    assert timed and all(s._packed is None and s._onednn is not None for s in timed)


def test_onednn_is_not_timed_for_single_rows(monkeypatch):
    """Timed alone oneDNN wins single-row products of wide matrices, yet a decode step measured slower with it."""
    monkeypatch.setattr(kernels, "available_kernels", lambda: ("int_mm", "onednn", "fbgemm"))
    assert kernels.candidate_kernels(1) == ("int_mm", "fbgemm")
    assert kernels.candidate_kernels(16) == ("int_mm", "onednn", "fbgemm")
    monkeypatch.setattr(kernels, "available_kernels", lambda: ("onednn",))
    assert kernels.candidate_kernels(1) == ("onednn",)


def test_single_rows_go_to_fbgemm_where_its_eight_bit_gemm_is_exact(monkeypatch):
    """Timed alone ``torch._int_mm`` won a single-row product that measured slower inside a decode step; where
    fbgemm's 8-bit GEMM is exact it takes every single row, and more rows are still timed among all kernels."""
    monkeypatch.setattr(kernels, "available_kernels", lambda: ("int_mm", "onednn", "fbgemm8", "fbgemm"))
    assert kernels.candidate_kernels(1) == ("fbgemm8",)
    assert kernels.candidate_kernels(4) == ("int_mm", "onednn", "fbgemm8")
    monkeypatch.setattr(kernels, "available_kernels", lambda: ("int_mm", "fbgemm"))  # AVX2: the 7-bit split only
    assert kernels.candidate_kernels(1) == ("int_mm", "fbgemm")
