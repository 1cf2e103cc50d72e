"""Exact integer products for [`Int8Linear`]: per-token quantization and a kernel chosen by timing on this machine.

Activations are rounded per row (token) to integers in [-127, 127]; the product with int8 weights is computed
exactly in integers, so a row's output never depends on the rows computed beside it. Two kernels compute the same
int32 result:

- ``int_mm``: ``torch._int_mm`` (oneDNN's s8 x s8 -> s32 GEMM). Fast from one row on where the CPU has int8
  dot-product instructions (AVX-512 VNNI, AVX-VNNI, AMX); slow elsewhere.
- ``onednn``: oneDNN's int8 GEMM on a weight packed once (``torch.ops.onednn.qlinear_prepack`` /
  ``qlinear_pointwise``, the kernels of torch's x86 quantization), int8 activations with scale 1 and no zero point,
  float32 out: the int32 sum cast to float, as for ``int_mm``. Where the CPU has AMX or VNNI it is the fastest for
  wide matrices (the vocabulary head: 0.6 against 2.4 ms for ``int_mm`` on a 2-core Xeon with AMX); the packing
  avoids the per-call weight reordering of ``torch._int_mm``.
- ``fbgemm8``: fbgemm's int8 GEMM (``torch.ops.quantized.linear_dynamic``) on the 8-bit integers: two constant pad
  rows (-127 and 128) fix its input scale to exactly 1 and its zero point to 127, so the integers pass through
  unchanged. Exact only where the CPU accumulates u8 x s8 products without 16-bit saturation (AVX-512 VNNI); the
  check below includes rows that saturate on AVX2, so it is refused there. Fastest for the vocabulary-sized head.
- ``fbgemm``: the same GEMM with 7-bit activations (``reduce_range``, exact on AVX2 too). It
  quantizes its input with one scale for the whole matrix, so each row of integers is split as ``2 * high + low``
  (high in [-64, 63], low in {0, 1}); two constant pad rows (-64 and 63) fix its input scale to exactly 1, every
  integer product is exact (weights packed with scale 1), and ``2 * high + low`` is summed in float, which rounds
  exactly as a cast of the int32 product does. The split doubles the rows and fbgemm re-quantizes its input.

All give bit-identical outputs, so the choice can differ per matrix shape and number of rows without changing a
single bit of any result. [`choose_kernel`] times the available kernels once per (shape, row bucket) in the process
(interleaved, the 7-bit one left out where the 8-bit one is exact; one far slower than the fastest in a first
timed call is dropped at once) and keeps the faster one; each kernel is first checked against the exact product on
random data (one row and many).
``POSS_INT8_KERNEL=int_mm|onednn|fbgemm8|fbgemm`` forces one (read, never written, by the library).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import warnings

import torch

logger = logging.getLogger(__name__)

ACTIVATION_LEVELS = 127  # per-token activations are rounded to integers in [-127, 127]
KERNELS = ("int_mm", "onednn", "fbgemm8", "fbgemm")
ROW_BUCKETS = (1, 4, 16, 64)  # a product of M rows uses the choice timed at the smallest bucket >= M (else the last)
KERNEL_ENV = "POSS_INT8_KERNEL"
SCREEN_FACTOR = 10.0  # a kernel whose first timed call takes this many times the fastest one's is not timed further


class QuantizedRows:
    """A `[M, K]` float input rounded per row: ``scale`` `[M, 1]` and the integers in [-127, 127], as int8
    (``int8``, for ``torch._int_mm``) or as fbgemm's padded 7-bit split (``padded`` `[2 + 2M, K]`), each built
    only when a kernel reads it."""

    def __init__(self, rows: torch.Tensor):
        scale = rows.abs().amax(dim=1, keepdim=True)  # max |x| per row, exact in any order
        self.scale = scale.clamp_min_(1e-12).div_(ACTIVATION_LEVELS)
        # |rows / scale| <= 127 (1 + 2^-23): rounding lands in [-127, 127] without a clamp
        self.integers = torch.div(rows, self.scale).round_()
        self.num_rows = rows.shape[0]

    @functools.cached_property
    def int8(self) -> torch.Tensor:
        return self.integers.to(torch.int8)

    @functools.cached_property
    def padded8(self) -> torch.Tensor:
        return torch.cat([_pads8(self.integers.shape[1]), self.integers])

    @functools.cached_property
    def padded(self) -> torch.Tensor:
        high = torch.floor(self.integers * 0.5)
        return torch.cat([_pads(self.integers.shape[1]), high, self.integers - 2 * high])


_last_input = threading.local()


def version_of(tensor: torch.Tensor) -> int | None:
    """The tensor's version counter, which in-place writes bump (None under ``torch.inference_mode``, which keeps
    none): with identity, what the caches of quantized inputs and fused outputs check."""
    return None if tensor.is_inference() else tensor._version


def quantize_input(hidden: torch.Tensor, in_features: int) -> QuantizedRows:
    """[`QuantizedRows`] of `[..., in]` ``hidden``. Projections that read the same tensor (q/k/v, gate/up when not
    fused) reuse the last result while that very tensor comes again unmodified (a reference is held, so identity is
    safe; under ``torch.inference_mode`` tensors have no version counter and identity alone is used)."""
    version = version_of(hidden)
    cached = getattr(_last_input, "entry", None)
    if cached is not None and cached[0] is hidden and cached[1] == version:
        return cached[2]
    rows = QuantizedRows(hidden.reshape(-1, in_features).float())
    _last_input.entry = (hidden, version, rows)
    return rows


def forget_last_input() -> None:
    """Drop the reference to the last quantized input (end of a forward)."""
    _last_input.entry = None


# ---------------------------------------------------------------------------------------------------- kernels
def pack_fbgemm(weight_int8: torch.Tensor):
    """fbgemm's packed form of `[out, in]` int8 weights, with scale 1 (the per-channel scales are applied after)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch marks its quantized tensor API as deprecated
        qweight = torch._make_per_tensor_quantized_tensor(weight_int8.contiguous(), 1.0, 0)
        return torch.ops.quantized.linear_prepack(qweight, None)


def fbgemm_product(rows: QuantizedRows, packed) -> torch.Tensor:
    """``integers @ W^T`` `[M, out]` as float on fbgemm (|high products| < 2^24 while in_features < 2064)."""
    products = torch.ops.quantized.linear_dynamic(rows.padded, packed, True)
    high, low = products[2:].chunk(2)
    return 2 * high + low


def fbgemm8_product(rows: QuantizedRows, packed) -> torch.Tensor:
    """``integers @ W^T`` `[M, out]` as float on fbgemm's 8-bit path (exact only where checked, see above)."""
    return torch.ops.quantized.linear_dynamic(rows.padded8, packed, False)[2:]


def int_mm_product(rows: QuantizedRows, weight_int8_t: torch.Tensor) -> torch.Tensor:
    """``integers @ W^T`` `[M, out]` as int32 on ``torch._int_mm`` (``weight_int8_t`` `[in, out]`)."""
    return torch._int_mm(rows.int8, weight_int8_t)


def pack_onednn(weight_int8: torch.Tensor):
    """oneDNN's packed form of `[out, in]` int8 weights (scale 1, no zero point; the per-channel scales are applied
    after), with the unit scales and zero points its product reads."""
    out_features = weight_int8.shape[0]
    packed = torch.ops.onednn.qlinear_prepack(weight_int8.contiguous(), None)
    return packed, torch.ones(out_features), torch.zeros(out_features, dtype=torch.long)


def onednn_product(rows: QuantizedRows, packed) -> torch.Tensor:
    """``integers @ W^T`` `[M, out]` as float32 on oneDNN (the int32 sum cast to float, as for ``int_mm``)."""
    weight, ones, zeros = packed
    return torch.ops.onednn.qlinear_pointwise(rows.int8, 1.0, 0, weight, ones, zeros, None, 1.0, 0, torch.float32,
                                              "none", [], "")  # fmt: skip


@functools.lru_cache(maxsize=None)
def _pads(in_features: int) -> torch.Tensor:
    pads = torch.zeros(2, in_features)
    pads[0, 0], pads[1, 0] = -64.0, 63.0
    return pads


@functools.lru_cache(maxsize=None)
def _pads8(in_features: int) -> torch.Tensor:
    pads = torch.zeros(2, in_features)
    pads[0, 0], pads[1, 0] = -127.0, 128.0
    return pads


@functools.lru_cache(maxsize=1)
def int_mm_available() -> bool:
    """Whether ``torch._int_mm`` runs here and gives the exact integer product (checked once per process)."""
    try:
        return all(_exact(kernel="int_mm", in_features=k, out_features=n) for k, n in ((96, 40), (1100, 24)))
    except (RuntimeError, NotImplementedError) as error:
        logger.info("torch._int_mm unavailable (%s)", error)
        return False


@functools.lru_cache(maxsize=1)
def onednn_available() -> bool:
    """Whether oneDNN's packed int8 GEMM runs here and gives the exact integer product (checked once per process)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return all(_exact(kernel="onednn", in_features=k, out_features=n) for k, n in ((96, 40), (1100, 24)))
    except (RuntimeError, NotImplementedError, AttributeError) as error:  # a build without the oneDNN int8 ops
        logger.info("oneDNN int8 GEMM unavailable (%s)", error)
        return False


@functools.lru_cache(maxsize=None)
def fbgemm_available(kernel: str = "fbgemm") -> bool:
    """Whether fbgemm's int8 GEMM is present and ``kernel`` ("fbgemm" or "fbgemm8") gives the exact integer
    product, for one row and for many (checked once per process)."""
    if not hasattr(torch.ops.quantized, "linear_dynamic") or "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    try:
        return all(_exact(kernel=kernel, in_features=k, out_features=n) for k, n in ((96, 40), (1100, 24)))
    except (RuntimeError, NotImplementedError) as error:  # a build without the quantized CPU kernels
        logger.info("fbgemm int8 GEMM unavailable (%s)", error)
        return False


def _exact(kernel: str, in_features: int, out_features: int) -> bool:
    """``kernel`` on random data equals the float64 integer product, for 17 rows at once and for each row alone."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randint(-127, 128, (out_features, in_features), generator=generator, dtype=torch.int8)
    integers = torch.randint(-127, 128, (17, in_features), generator=generator).float()
    integers[:, 0] = 127.0  # scale 1: the rows quantize to themselves
    integers[0], weight[0] = 127.0, 127  # products that saturate 16-bit pair sums (AVX2 without VNNI)
    integers[1], weight[1] = -127.0, -127
    exact = integers.double() @ weight.double().t()
    state = KernelState(weight.t().contiguous())
    many = state.product(QuantizedRows(integers), kernel).double()
    one = torch.cat([state.product(QuantizedRows(integers[i : i + 1]), kernel).double() for i in range(17)])
    return torch.equal(many, exact) and torch.equal(one, exact)


def available_kernels() -> tuple[str, ...]:
    forced = os.environ.get(KERNEL_ENV, "").strip().lower()
    if forced:
        if forced not in KERNELS:
            raise ValueError(f"{KERNEL_ENV}={forced!r}: choose one of {', '.join(KERNELS)} (or unset it).")
        return (forced,)
    checks = {"int_mm": int_mm_available, "onednn": onednn_available}
    found = tuple(name for name in KERNELS if checks.get(name, functools.partial(fbgemm_available, name))())
    if not found:
        raise RuntimeError("neither torch._int_mm, oneDNN nor fbgemm computes exact int8 products in this torch build.")
    return found


class KernelState:
    """What the kernels need of one `[in, out]` int8 weight: the weight itself and, built on first use, fbgemm's and
    oneDNN's packed copies (not saved; rebuilt after copies and pickles)."""

    def __init__(self, weight_int8_t: torch.Tensor):
        self.weight_int8_t = weight_int8_t
        self._packed = None
        self._onednn = None
        self.chosen: tuple[dict, dict[int, str]] = (None, {})  # (process-wide choices, {rows: kernel}) seen here

    def packed(self):
        if self._packed is None:
            self._packed = pack_fbgemm(self.weight_int8_t.t())
        return self._packed

    def onednn(self):
        if self._onednn is None:
            self._onednn = pack_onednn(self.weight_int8_t.t())
        return self._onednn

    def keep_only(self, kernels: set[str]) -> None:
        """Drop the packed copies no chosen kernel reads (each is as large as the weight)."""
        if not kernels & {"fbgemm", "fbgemm8"}:
            self._packed = None
        if "onednn" not in kernels:
            self._onednn = None

    def product(self, rows: QuantizedRows, kernel: str) -> torch.Tensor:
        """The exact integer product `[M, out]`, int32 (``int_mm``) or float32 holding the same integers."""
        if kernel == "int_mm":
            return int_mm_product(rows, self.weight_int8_t)
        if kernel == "onednn":
            return onednn_product(rows, self.onednn())
        if kernel == "fbgemm8":
            return fbgemm8_product(rows, self.packed())
        return fbgemm_product(rows, self.packed())


_choices: dict[tuple[int, int, int], str] = {}
_choice_lock = threading.Lock()


def choose_kernel(state: KernelState, num_rows: int) -> str:
    """The faster exact kernel for this weight's shape and ``num_rows`` (its row bucket), timed once per process
    (and remembered by ``state`` per number of rows, while the process-wide choices are the same ones)."""
    remembered = state.chosen
    if remembered[0] is _choices:
        choice = remembered[1].get(num_rows)
        if choice is not None:
            return choice
    else:
        state.chosen = remembered = (_choices, {})
    in_features, out_features = state.weight_int8_t.shape
    bucket = next((b for b in ROW_BUCKETS if num_rows <= b), ROW_BUCKETS[-1])
    key = (in_features, out_features, bucket)
    choice = _choices.get(key)
    if choice is None:
        with _choice_lock:
            kernels = candidate_kernels(bucket)
            choice = kernels[0] if len(kernels) == 1 else _time_kernels(state, bucket, kernels)
            _choices[key] = choice
            logger.debug("int8 kernel for [%d x %d], %d rows: %s", in_features, out_features, bucket, choice)
    remembered[1][num_rows] = choice
    return choice


def candidate_kernels(num_rows: int = ROW_BUCKETS[-1]) -> tuple[str, ...]:
    """The kernels worth timing for ``num_rows`` rows: the available ones, less

    - the 7-bit ``fbgemm`` where the 8-bit one is exact (the same GEMM on half the rows, without the split: never
      slower, and timing both let noise pick the slower now and then);
    - ``onednn`` for a single row where another kernel is exact: timed alone it wins for wide matrices, but inside
      a decode step it measured slower (SmolLM2 int8, 2-core Xeon with AMX: 37.9 against 35.6 ms a step with it
      left out at one row, medians of 4 alternating processes x 60 steps), so the timing in isolation misleads there;
    - ``int_mm`` for a single row where ``fbgemm8`` is exact, for the same reason: timed alone it won for the
      576 x 576 projection, but inside a decode step that choice measured slower (same machine: 36.7 against 35.6
      ms a step, medians of 3 alternating processes x 30 steps, every pair the same way round).
    """
    kernels = available_kernels()
    if "fbgemm8" in kernels and len(kernels) > 1:
        kernels = tuple(k for k in kernels if k != "fbgemm")
    if num_rows == 1 and len(kernels) > 1:
        kernels = ("fbgemm8",) if "fbgemm8" in kernels else tuple(k for k in kernels if k != "onednn")
    return kernels


def _time_kernels(state: KernelState, num_rows: int, kernels: tuple[str, ...], repeats: int = 7) -> str:
    """The kernel with the least time over ``repeats`` rounds that run every kernel once each, so that drift of
    the machine (other work, frequency) hits all of them alike."""
    generator = torch.Generator().manual_seed(1)
    rows = QuantizedRows(torch.randn(num_rows, state.weight_int8_t.shape[0], generator=generator))
    for kernel in kernels:
        state.product(rows, kernel)  # warm-up (packs fbgemm's or oneDNN's weight)
    first = {kernel: _timed_product(state, rows, kernel) for kernel in kernels}
    # a kernel far slower than the best in one call is out at once, without repeats (oneDNN's int8 GEMM on a CPU
    # it has no fast path for took 100-3000x the others' time: seconds per choice for the vocabulary head)
    kernels = tuple(k for k in kernels if first[k] <= SCREEN_FACTOR * min(first.values()))
    if len(kernels) == 1:
        return kernels[0]
    best = dict.fromkeys(kernels, float("inf"))
    for _ in range(repeats):
        for kernel in kernels:
            best[kernel] = min(best[kernel], _timed_product(state, rows, kernel))  # the least disturbed run
    return min(best, key=best.get)


def _timed_product(state: KernelState, rows: QuantizedRows, kernel: str) -> float:
    """Seconds of one ``kernel`` product of ``rows``."""
    start = time.perf_counter()
    state.product(rows, kernel)
    return time.perf_counter() - start


def kernel_choices() -> dict[str, str]:
    """The kernels chosen so far in this process, ``"in x out, rows<=b" -> kernel`` (for reports)."""
    return {f"{k} x {n}, rows<={b}": choice for (k, n, b), choice in sorted(_choices.items())}


def kernel_summary() -> str:
    """One word for the cost-profile key: the kernel every choice so far agrees on, 'mixed', or the preferred one."""
    chosen = set(_choices.values())
    if len(chosen) == 1:
        return chosen.pop()
    if chosen:
        return "mixed"
    return available_kernels()[0]
