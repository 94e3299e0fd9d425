"""The Triton kernel path against the float64 spec, run on the CPU by the Triton interpreter
(``TRITON_INTERPRET=1``, set in ``conftest.py`` before Triton is imported)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from gdn2.paths import forget_announcements  # noqa: E402
from gdn2.torch import chunk_gdn2  # noqa: E402
from gdn2.torch import triton as kernel  # noqa: E402
from gdn2.testing import make_case, rounded_case, run_torch, with_expected, worst_error  # noqa: E402
from gdn2.torch.ops import which_path  # noqa: E402
from gdn2.torch.triton.forward import _doubled_inverse, _exclusive_suffix  # noqa: E402

# A kernel that fails falls back to the chunk path with a RuntimeWarning: make that a failure.
kernel_only = pytest.mark.filterwarnings("error::RuntimeWarning")


@pytest.fixture
def interpreter(monkeypatch, fresh_path_log):
    """The Triton interpreter, and the once-only path log emptied: with ``kernel_only``, a kernel
    that gives way to the chunk path fails the test even if the same fallback was warned before."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("GDN2_PATH", raising=False)
    yield


# (B, T, H, K, V, log decay range): T = 1, T not a multiple of 64, several chunks, K != V and
# non-powers of two, head sizes 64 to 256, log decay down to -20 on every channel.
SHAPES = [
    (2, 37, 2, 16, 8, (-20.0, 0.0)),
    (1, 1, 2, 8, 8, (-20.0, 0.0)),
    (1, 45, 1, 48, 80, (-3.0, 0.0)),
    (1, 130, 1, 64, 64, (-20.0, 0.0)),
    (1, 70, 1, 96, 40, (-20.0, 0.0)),
    (1, 20, 1, 256, 24, (-20.0, 0.0)),
    (1, 66, 1, 128, 128, (-3.0, 0.0)),
]


def test_triton_library_is_interpreted():
    assert type(tl.cumsum).__name__ == "InterpretedFunction", "triton was imported before conftest.py set TRITON_INTERPRET=1"


def _rounded_case(case, dtype):
    return rounded_case(case, lambda x: torch.tensor(x).to(dtype).double().numpy())


def _inputs(case, dtype, with_state=True):
    x = case["inputs"]
    tensors = [torch.tensor(x[n], dtype=dtype) for n in ("q", "k", "v", "g", "b", "w")]
    state = torch.tensor(x["initial_state"], dtype=torch.float32) if with_state else None
    return tensors, state


def _assert_float32_kernel_matches(case, seed):
    """Output, final state and every gradient of the kernel path in float32 within 1e-4 of the
    spec (numpy's warnings on the interpreter's non-finite intermediates silenced)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="invalid value|overflow|divide by zero")
        result = run_torch(case, "float32", path="kernel")
    error, name, errors = worst_error(result, case["expected"])
    assert error <= 1e-4, (seed, name, errors)


@kernel_only
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}T{}H{}K{}V{}g{}".format(*s[:5], s[5][0]))
def test_kernel_matches_spec_float32(shape, seed, interpreter):
    """Output, final state and every gradient (with a gradient into the final state)."""
    B, T, H, K, V, decay = shape
    case = make_case(B, T, H, K, V, seed, log_decay_range=decay)
    tensors, state = _inputs(case, torch.float32)
    assert which_path(*tensors, state, path="kernel").path == "kernel"
    result = run_torch(case, "float32", path="kernel")
    assert set(result) == {"o", "final_state", "dq", "dk", "dv", "dg", "db", "dw", "dinitial_state"}
    error, name, errors = worst_error(result, case["expected"])
    assert error <= 1e-4, (seed, name, errors)


@kernel_only
@pytest.mark.parametrize("T", [64, 70])
def test_kernel_strong_decay_every_step(T, seed, interpreter):
    """Every step decays by at least exp(-10): dg is tiny (~1e-5) and must not be swamped by
    rounding of the O(1) terms that cancel in it (P's diagonal, the k-to-end and last-row terms)."""
    case = make_case(1, T, 1, 96, 40, seed, log_decay_range=(-20.0, -10.0))
    result = run_torch(case, "float32", path="kernel")
    error, name, errors = worst_error(result, case["expected"])
    assert error <= 1e-4, (seed, name, errors)


@kernel_only
def test_kernel_bfloat16_and_no_initial_state(seed, interpreter):
    """bfloat16 inputs (float32 accumulation) against the spec on the same, rounded inputs."""
    case = make_case(1, 50, 2, 32, 24, seed, log_decay_range=(-20.0, 0.0), with_state=False)
    case = _rounded_case(case, torch.bfloat16)
    result = run_torch(case, "bfloat16", path="kernel")
    assert "dinitial_state" not in result
    error, name, errors = worst_error(result, case["expected"])
    assert error <= 2e-2, (seed, name, errors)
    assert result["o"].dtype == np.float64 and np.abs(result["o"]).max() > 0


# Every saved buffer the kernels can keep in bfloat16 (the widest choice of SAVED_IN_BFLOAT16).
WIDEST_BFLOAT16 = ("states", "qd", "kd", "Wk", "Uw", "U", "P", "inverse")


@kernel_only
def test_kernel_bfloat16_saved_buffers_widest(seed, interpreter, monkeypatch):
    """Every saved buffer that can be bfloat16 kept in bfloat16 (b k exp(G) in Wk's buffer):
    output, final state and every gradient against the spec on the same, rounded inputs (several
    chunks, T not a multiple of 64, K != V, g in [-20, 0]). The tolerance: bench/saved_precision.py
    at this shape with two heads (--shapes 2), 20 seeds, worst error over o, the final state and
    the gradients 8.8e-3 to 1.25e-2 (median 9.4e-3; the default set's 3.9e-3 to 6.3e-3 over 8 of
    them); at K = V = 128, at most 9.5e-3."""
    from gdn2.torch.triton import forward

    monkeypatch.setattr(kernel, "SAVED_IN_BFLOAT16", WIDEST_BFLOAT16)
    # b k exp(G) in Wk's bfloat16 buffer (the default): the WY launch's products on bfloat16 X and bkd
    monkeypatch.setattr(forward, "DECAYED_ERASE_KEYS_IN_WK", True)
    case = make_case(1, 130, 1, 64, 48, seed, log_decay_range=(-20.0, 0.0))
    case = _rounded_case(case, torch.bfloat16)
    (q, k, v, g, b, w), state = _inputs(case, torch.bfloat16)
    saved = kernel._forward(q, k, v, g, b, w, state, 64 ** -0.5, None, None)[2:]
    assert {name: x.dtype for name, x in zip(kernel.SAVED, saved)} == {
        name: torch.bfloat16 if name in WIDEST_BFLOAT16 else torch.float32 for name in kernel.SAVED}
    result = run_torch(case, "bfloat16", path="kernel")
    error, name, errors = worst_error(result, case["expected"])
    assert error <= 2e-2, (seed, name, errors)


@kernel_only
def test_uw_in_float16_over_its_column_scale(seed, interpreter, monkeypatch):
    """Uw saved in float16 over its largest magnitude per chunk and value column
    (``UW_IN_FLOAT16``), on values far past float16's 65504 (v times 1e6, a hard reset, several
    chunks, K != V): the saved Uw is float16 with each column's largest magnitude 1, times
    ``Uw_scale`` it is the float32 Uw to float16's rounding; the output and every gradient stay
    within the bfloat16 tolerance of the spec and differ from the float32 Uw's by less than
    bfloat16's own rounding (2^-8), leaving out the entries one bfloat16 step apart. Those are many
    (2^-11 against a step of 2^-7 to 2^-8: 7% to 16% of the entries over 13 seeds, at most a
    quarter allowed), and they rule out comparing the two runs' errors against the spec closely:
    with v times 1e6, dg's norm is a few entries of its last row, and one of them a step apart
    took its error from 1.97e-3 to 4.33e-3 (seed 3170873975). Without them, the largest difference
    over those seeds was 1.7e-3 (dg), 9.3e-4 elsewhere."""
    case = make_case(1, 150, 1, 32, 24, seed, log_decay_range=(-3.0, 0.0))
    case["inputs"]["v"] *= 1e6
    case["inputs"]["initial_state"] *= 1e6
    case["inputs"]["g"][0, 70, 0] = -np.inf
    case = _rounded_case(case, torch.bfloat16)
    (q, k, v, g, b, w), state = _inputs(case, torch.bfloat16)
    runs, results = {}, {}
    for in_float16 in (False, True):
        monkeypatch.setattr(kernel, "UW_IN_FLOAT16", in_float16)
        saved = kernel._forward(q, k, v, g, b, w, state, 32 ** -0.5, None, None)[2:]
        runs[in_float16] = dict(zip(kernel.SAVED, saved))
        results[in_float16] = run_torch(case, "bfloat16", path="kernel")
        error, name, errors = worst_error(results[in_float16], case["expected"])
        assert error <= 2e-2, (seed, in_float16, name, errors)
    wide, narrow = runs[False], runs[True]
    assert wide["Uw"].dtype == torch.float32 and (wide["Uw_scale"] == 1).all()
    assert narrow["Uw"].dtype == torch.float16 and narrow["Uw_scale"].max() > 1e5
    largest = narrow["Uw"].float().abs().unflatten(2, (-1, 64)).amax(3)  # [B, H, N, V]
    assert torch.equal(largest, torch.ones_like(largest))
    column_scale = narrow["Uw_scale"].double().repeat_interleave(64, 2)  # per row of Uw
    assert ((narrow["Uw"].double() * column_scale - wide["Uw"].double()).abs() <= 2 ** -11 * column_scale).all()
    for name in results[False]:  # o and the inputs' gradients in bfloat16; the state's and its gradient in float32
        _close(name, torch.as_tensor(results[False][name]), torch.as_tensor(results[True][name]), 2 ** -8,
               name not in ("final_state", "dinitial_state"), one_step_share=0.25)


@kernel_only
def test_state_update_ignores_how_U_is_saved(seed, interpreter, monkeypatch):
    """U saved in bfloat16 or float32: the state pass updates the state on U as computed, so the
    chunk states and the final state are the same bit for bit, and the saved U is the float32 one
    rounded (updating on the saved bfloat16 U took the final state's error against the spec from
    6e-4 to 1e-3 up to 1.7e-3 to 2.2e-3 at B=1 T=200 K=64 V=48)."""
    case = make_case(1, 200, 1, 64, 48, seed, log_decay_range=(-3.0, 0.0))
    (q, k, v, g, b, w), state = _inputs(case, torch.bfloat16)
    runs = {}
    for saved_U in (torch.bfloat16, torch.float32):
        in_bfloat16 = ("states", "qd", "kd", "Wk") + (("U",) if saved_U == torch.bfloat16 else ())
        monkeypatch.setattr(kernel, "SAVED_IN_BFLOAT16", in_bfloat16)
        _, final_state, *saved = kernel._forward(q, k, v, g, b, w, state, 64 ** -0.5, None, None)
        runs[saved_U] = dict(final_state=final_state, **dict(zip(kernel.SAVED, saved)))
        assert runs[saved_U]["U"].dtype == saved_U
    rounded, exact = runs[torch.bfloat16], runs[torch.float32]
    assert torch.equal(rounded["final_state"], exact["final_state"])
    assert torch.equal(rounded["states"], exact["states"])
    assert torch.equal(rounded["U"], exact["U"].to(torch.bfloat16))
    assert exact["U"].abs().max() > 0


def test_warpgroup_barrier_only_where_triton_omits_it():
    """The value launch's own barrier: at more than four warps with a Triton before 3.9 (whose
    sm_90a builds store into shared memory after a warpgroup's wait without one), not otherwise."""
    from gdn2.torch.triton.backward import warpgroup_barrier

    assert warpgroup_barrier(8, "3.6.0") and warpgroup_barrier(8, "3.8.0") and warpgroup_barrier(16, "3.7.1")
    assert not warpgroup_barrier(8, "3.9.0") and not warpgroup_barrier(8, "3.10.2") and not warpgroup_barrier(8, "4.0.0")
    assert not warpgroup_barrier(4, "3.6.0") and not warpgroup_barrier(2, "3.6.0")


@kernel_only
def test_value_launch_barrier_changes_no_bit(seed, interpreter, monkeypatch):
    """The value launch with and without its warpgroup barrier (``warpgroup_barrier``; a spy checks
    that each form reached the kernel): every gradient the same bit for bit (bfloat16, several
    chunks, K != V)."""
    from gdn2.torch.triton import backward

    case = make_case(1, 150, 1, 32, 24, seed, log_decay_range=(-3.0, 0.0))
    (q, k, v, g, b, w), state = _inputs(case, torch.bfloat16)
    generator = torch.Generator().manual_seed(seed)
    d_o = torch.randn(q.shape[:3] + v.shape[-1:], generator=generator).to(torch.bfloat16)
    d_final = torch.randn(state.shape, generator=generator)
    saved = kernel._forward(q, k, v, g, b, w, state, 32 ** -0.5, None, None)[2:]
    spy = _LaunchSpy(backward._intra_backward_values_kernel)
    monkeypatch.setattr(backward, "_intra_backward_values_kernel", spy)
    runs = []
    for barrier in (False, True):
        monkeypatch.setattr(backward, "warpgroup_barrier", lambda num_warps, version=None: barrier)
        runs.append(kernel._backward(q, k, v, g, b, w, saved, d_o, d_final, 32 ** -0.5, True, None, None))
    assert [launch["WARPGROUP_BARRIER"] for launch in spy.launches] == [False, True]
    for x, y in zip(*runs):
        assert torch.equal(x, y)
    assert all(x.abs().max() > 0 for x in runs[0])


@kernel_only
def test_contraction_loads_ahead_only_with_bfloat16_inputs(seed, interpreter, monkeypatch):
    """With loads ahead asked for (``CONTRACT_STAGES`` 3), the contraction launch loads ahead with
    bfloat16 inputs and not with float32 inputs (``contract_stages``: Triton 3.6's loads-ahead
    build gave float32 d_bkd different bits between calls on the GPU); a spy reads the launches,
    and both backward passes stay within their tolerance of the spec."""
    from gdn2.torch.triton import backward

    monkeypatch.setattr(backward, "CONTRACT_STAGES", 3)
    assert backward.contract_stages(True) == 3 and backward.contract_stages(False) == 1
    case = make_case(1, 70, 1, 32, 24, seed, log_decay_range=(-3.0, 0.0))
    spy = _LaunchSpy(backward._intra_backward_contract_kernel)
    monkeypatch.setattr(backward, "_intra_backward_contract_kernel", spy)
    for dtype, tolerance, stages in (("float32", 1e-4, 1), ("bfloat16", 2e-2, backward.CONTRACT_STAGES)):
        rounded = _rounded_case(case, getattr(torch, dtype))
        spy.launches.clear()
        error, name, errors = worst_error(run_torch(rounded, dtype, path="kernel"), rounded["expected"])
        assert error <= tolerance, (seed, dtype, name, errors)
        assert spy.launches and all(launch["STAGES"] == stages for launch in spy.launches), (dtype, spy.launches)


@kernel_only
def test_backward_gradients_in_bfloat16(seed, interpreter, monkeypatch):
    """The reverse pass's gradients of the leaving states and of U stored in bfloat16
    (``GRADIENTS_IN_BFLOAT16``): the pass holds both in float32 and rounds them on the store only,
    so the initial state's gradient (and dq) is the same bit for bit as with float32 buffers, while the
    gradients of the launches that read them move (they read the rounded values) and stay within
    the bfloat16 tolerance of the spec (several chunks, a hard reset, K != V)."""
    case = make_case(1, 150, 1, 32, 24, seed, log_decay_range=(-3.0, 0.0))
    case["inputs"]["g"][0, 90, 0] = -np.inf
    case = _rounded_case(case, torch.bfloat16)
    (q, k, v, g, b, w), state = _inputs(case, torch.bfloat16)
    generator = torch.Generator().manual_seed(seed)
    d_o = torch.randn(q.shape[:3] + v.shape[-1:], generator=generator).to(torch.bfloat16)
    d_final = torch.randn(state.shape, generator=generator)
    runs = {}
    for in_bfloat16 in ((), ("d_leaving", "d_U")):
        monkeypatch.setattr(kernel, "GRADIENTS_IN_BFLOAT16", in_bfloat16)
        saved = kernel._forward(q, k, v, g, b, w, state, 32 ** -0.5, None, None)[2:]
        runs[in_bfloat16] = kernel._backward(q, k, v, g, b, w, saved, d_o, d_final, 32 ** -0.5, True, None, None)
    exact, rounded = runs[()], runs[("d_leaving", "d_U")]
    # dq reads neither (o = scale (qd S + P U)): it too is the same bit for bit
    for name, x, y in (("dq", exact[0], rounded[0]), ("d_initial", exact[-1], rounded[-1])):
        assert torch.equal(x, y) and x.abs().max() > 0, name
    for name, x, y in zip(("dk", "dv", "dg", "db", "dw"), exact[1:], rounded[1:]):
        assert torch.isfinite(x).all() and not torch.equal(x, y), name
    result = run_torch(case, "bfloat16", path="kernel")
    error, name, errors = worst_error(result, case["expected"])
    assert error <= 2e-2, (seed, name, errors)


class _LaunchSpy:
    """A kernel whose launches record their keyword arguments, then run the kernel."""

    def __init__(self, kernel_function):
        self.kernel_function, self.launches = kernel_function, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(kwargs)
            return self.kernel_function[grid](*args, **kwargs)

        return launch


@kernel_only
@pytest.mark.parametrize("gradients", [(), ("d_leaving",), ("d_leaving", "d_U")], ids=["float32", "d_leaving", "both"])
def test_intra_backward_products_on_stored_bfloat16(gradients, seed, interpreter, monkeypatch):
    """The contraction and value launches' products on bfloat16 operands as stored
    (``INTRA_BACKWARD_BFLOAT16_PRODUCTS``; with d_leaving and d_U in bfloat16 every product of the
    contraction, with float32 ones a mix) give the widened products' results up to float32
    rounding: both are exact products, summed in another order. The buffers come from the forward
    and the reverse pass (two heads, several chunks, T not a multiple of 64, K != V); spies check
    that the form asked for ran."""
    from gdn2.torch.triton import backward

    monkeypatch.setattr(kernel, "GRADIENTS_IN_BFLOAT16", gradients)
    case = make_case(1, 150, 2, 64, 48, seed, log_decay_range=(-3.0, 0.0))
    (q, k, v, g, b, w), state = _inputs(case, torch.bfloat16)
    scale = 64 ** -0.5
    qd, kd, gamma, Wk, Uw, Uw_scale, P, inverse, states, U = kernel._forward(q, k, v, g, b, w, state, scale, None,
                                                                             None)[2:]
    generator = torch.Generator().manual_seed(seed)
    d_o = torch.randn(q.shape[:3] + v.shape[-1:], generator=generator).to(torch.bfloat16)
    d_leaving, d_U = (torch.empty(x.shape, dtype=kernel._gradient_dtype(name, torch.bfloat16))
                      for name, x in (("d_leaving", states), ("d_U", U)))
    precision = kernel._dot_precision(q.device)
    backward.state_backward(qd, kd, Wk, gamma, P, d_o, None, d_leaving, d_U, None, scale, precision)
    spies = [_LaunchSpy(getattr(backward, name))
             for name in ("_intra_backward_contract_kernel", "_intra_backward_values_kernel")]
    monkeypatch.setattr(backward, "_intra_backward_contract_kernel", spies[0])
    monkeypatch.setattr(backward, "_intra_backward_values_kernel", spies[1])
    results = {}
    for stored in (False, True):
        monkeypatch.setattr(backward, "INTRA_BACKWARD_BFLOAT16_PRODUCTS", stored)
        contractions = backward.intra_backward_contract(states, U, d_o, d_leaving, d_U, inverse, scale, precision)
        values = backward.intra_backward_values(v, w, Wk, Uw, Uw_scale, inverse, U, d_o, d_U, contractions[2], scale,
                                                precision)
        results[stored] = contractions + values
    assert [[launch["STORED"] for launch in spy.launches] for spy in spies] == [[False, True]] * 2
    names = ("d_qd", "d_kd", "d_bkd", "d_gamma", "dv", "dw", "d_A", "d_P")
    tile = torch.arange(64) // 16
    written = tile[:, None] >= tile[None, :]  # d_A and d_P: the diagonal tiles and those below
    for name, widened, on_stored in zip(names, results[False], results[True]):
        if name in ("d_A", "d_P"):
            widened, on_stored = widened[..., written], on_stored[..., written]
        assert widened.abs().max() > 0, name
        if widened.dtype == torch.bfloat16:  # dv, dw: one rounding step apart at most
            widened, on_stored = widened.float(), on_stored.float()
            torch.testing.assert_close(on_stored, widened, rtol=2 ** -7, atol=0, msg=name)
        else:
            torch.testing.assert_close(on_stored, widened, rtol=1e-5, atol=1e-6 * widened.abs().max().item(), msg=name)


def test_gradients_in_bfloat16_names_its_buffers(monkeypatch):
    """``GRADIENTS_IN_BFLOAT16`` acts only with bfloat16 inputs; another name is refused by name."""
    monkeypatch.setattr(kernel, "GRADIENTS_IN_BFLOAT16", ("d_U",))
    assert kernel._gradient_dtype("d_U", torch.bfloat16) == torch.bfloat16
    assert kernel._gradient_dtype("d_leaving", torch.bfloat16) == torch.float32
    assert kernel._gradient_dtype("d_U", torch.float16) == torch.float32
    monkeypatch.setattr(kernel, "GRADIENTS_IN_BFLOAT16", ("d_S",))
    with pytest.raises(ValueError, match="GRADIENTS_IN_BFLOAT16: expected names among 'd_leaving' and 'd_U', received"):
        kernel._gradient_dtype("d_U", torch.bfloat16)


@kernel_only
def test_kernel_slow_decay_with_hard_reset(seed, interpreter):
    """Slow decay, so that A's tiles far below the diagonal count in the blocked inverse, and a
    hard reset: output, final state and every gradient against the spec in float32. The
    interpreter computes a TF32 product in float32: TF32's rounding is measured by the GPU checks
    of ``bench/triton_h200.py``."""
    case = make_case(1, 130, 2, 32, 24, seed, log_decay_range=(-1.0, 0.0))  # slow decay: A's far tiles count
    case["inputs"]["g"][0, 70, 1] = -np.inf
    _assert_float32_kernel_matches(with_expected(case), seed)


@kernel_only
@pytest.mark.parametrize("form", ["scans", "products", "stacked"])
def test_span_sums_by_products(form, seed, interpreter, monkeypatch):
    """The intra-forward's span sums as tensor-core products (``INTRA_FORWARD_SPAN_SUMS``): with a
    hard reset, a step of -1e6 and slow decay elsewhere, output, final state and every gradient
    within 1e-4 of the spec in float32; and on the inputs of ``test_intra_forward_writes_every_entry``
    (non-finite values, padded rows, K = 40) every entry the in-chunk launches fill is finite."""
    from gdn2.torch.triton import forward

    monkeypatch.setattr(forward, "INTRA_FORWARD_SPAN_SUMS", form)
    case = make_case(1, 130, 2, 32, 24, seed, log_decay_range=(-1.0, 0.0))
    case["inputs"]["g"][0, 70, 1] = -np.inf
    case["inputs"]["g"][0, 37, 0, :5] = -1e6
    _assert_float32_kernel_matches(with_expected(case), seed)
    filled, first_bad = _intra_forward_filled(True, torch.bfloat16, seed)
    assert (first_bad < 64).any() and (first_bad == 64).any()
    for name, buffer in filled.items():
        assert torch.isfinite(buffer.double()).all(), name


def _close(name, widened, other, tolerance, bfloat16, one_step_share=0.01):
    """``other``'s difference from ``widened`` within ``tolerance`` of the widened's norm, leaving
    out, with bfloat16 results, the entries one rounding step apart (a value that lands near a tie
    rounds either way, whatever its float32 difference); at most ``one_step_share`` of the entries
    above 2^-16 of the largest may be such (a difference of a tenth of a step moves about a tenth
    of them). Entries below that, a gradient near zero made of cancelling terms, move by the
    float32 rounding of their terms, which is many of their own steps (dg at g in [-20, 0], T = 70:
    4,147 of 4,480 entries below 1e-3 of the largest, 74-162 of them a step apart with w v split
    in the WY products, the whole difference 1e-9 to 6e-7 of the norm): the norm judges them."""
    ok = ~torch.isnan(widened)
    assert torch.equal(ok, ~torch.isnan(other)), name
    widened, other = widened.double()[ok], other.double()[ok]
    difference = other - widened
    if bfloat16:
        magnitude = torch.maximum(widened.abs(), other.abs()).clamp_min(1e-30)
        one_step = (difference != 0) & (difference.abs() <= 2.0 ** (torch.floor(torch.log2(magnitude)) - 7))
        counted = one_step & (magnitude > 2.0 ** -16 * magnitude.max())
        assert counted.sum() <= one_step_share * one_step.numel(), (name, counted.sum().item(), one_step.numel())
        difference = difference[~one_step]
    assert difference.norm() / widened.norm() <= tolerance, (name, (difference.norm() / widened.norm()).item())


def _bfloat16_products(monkeypatch, on: bool) -> None:
    from gdn2.torch.triton import forward

    for name in ("STATE_BFLOAT16_PRODUCTS", "OUTPUT_BFLOAT16_PRODUCT", "WY_BFLOAT16_PRODUCTS"):
        monkeypatch.setattr(forward, name, on)
    # the split form of the state pass's Wk S (the rounded state's own test: test_state_forward_rounded_state)
    monkeypatch.setattr(forward, "STATE_FORWARD_ROUNDED_STATE", False)


@kernel_only
@pytest.mark.parametrize("in_bfloat16", [None, WIDEST_BFLOAT16], ids=["default", "widest"])
def test_bfloat16_products_match_the_widened(in_bfloat16, seed, interpreter, monkeypatch):
    """The products on bfloat16 operands (the state forward's with the state and U split into two
    bfloat16 parts, the output's qd S and P U, the WY launch's on X and bkd with w v split) give
    the widened products' results up to float32 rounding (a split value is within 2^-16 of its
    float32 one): output, final state and saved buffers from several chunks on, with a hard reset
    and a NaN in v (its columns NaN from its row on); and, with the default saved set, every
    gradient (with one into the final state), which also stay within the bfloat16 tolerance of
    the spec."""
    if in_bfloat16 is not None:
        monkeypatch.setattr(kernel, "SAVED_IN_BFLOAT16", in_bfloat16)

    case = make_case(1, 140, 1, 64, 48, seed, log_decay_range=(-3.0, 0.0))
    (q, k, v, g, b, w), state = _inputs(case, torch.bfloat16)
    g[0, 70, 0] = -float("inf")
    v[0, 110, 0, 5] = float("nan")
    results = []
    for on in (False, True):
        _bfloat16_products(monkeypatch, on)
        results.append(kernel._forward(q, k, v, g, b, w, state, 64 ** -0.5, None, None))
    o = results[0][0]
    assert torch.isnan(o[0, 110:, 0, 5]).all() and not torch.isnan(o[0, :110]).any()
    for name, widened, split in zip(("o", "final_state") + kernel.SAVED, results[0], results[1]):
        # measured up to 2.6e-6 in float32
        _close(name, widened, split, 1e-4 if split.dtype == torch.bfloat16 else 2e-5, split.dtype == torch.bfloat16)

    if in_bfloat16 is not None:
        return  # the gradients through the widest saved set: test_kernel_bfloat16_saved_buffers_widest
    case = _rounded_case(make_case(1, 70, 1, 64, 48, seed, log_decay_range=(-20.0, 0.0)), torch.bfloat16)
    gradients = []
    for on in (False, True):
        _bfloat16_products(monkeypatch, on)
        gradients.append(run_torch(case, "bfloat16", path="kernel"))
    error, name, errors = worst_error(gradients[1], case["expected"])
    assert error <= 2e-2, (seed, name, errors)
    # bfloat16 gradients. Whole differences measured over 34 seeds up to 4.5e-4 (dg, a sum of
    # cancelling terms: up to 1.4e-5), and 8.1e-4 at seed 2838998214, where 9 of dg's 16,640
    # entries moved one rounding step (the largest 0.1260 against 0.1250, the spec's 0.1256) and
    # the rest 9e-10.
    for name in gradients[0]:  # o and the inputs' gradients in bfloat16; the state's and its gradient in float32
        _close(name, torch.as_tensor(np.asarray(gradients[0][name])), torch.as_tensor(np.asarray(gradients[1][name])),
               5e-4, name not in ("final_state", "dinitial_state"))


@kernel_only
def test_kernel_erase_gate_up_to_two_and_float16(seed, interpreter):
    case = make_case(1, 40, 1, 16, 16, seed, log_decay_range=(-5.0, 0.0), erase_max=2.0)
    result = run_torch(case, "float32", path="kernel")
    error, name, errors = worst_error(result, case["expected"])
    assert error <= 1e-4, (seed, name, errors)
    case = _rounded_case(case, torch.float16)
    half = run_torch(case, "float16", path="kernel")
    error, name, errors = worst_error(half, case["expected"])
    assert error <= 2e-2, (seed, name, errors)


@kernel_only
def test_keys_launch_hard_resets(seed, interpreter):
    """Every gradient against the spec: two chunks and a short one (T = 130), the log decay down to
    -20, and a hard reset (g = -inf) in the middle of a sub-block and at a sub-block's first row."""
    from gdn2.testing import with_expected

    case = make_case(1, 130, 1, 64, 32, seed, log_decay_range=(-20.0, 0.0), reference=False)
    case["inputs"]["g"][0, 37, 0] = -np.inf
    case["inputs"]["g"][0, 80, 0] = -np.inf
    case = with_expected(case)
    _assert_float32_kernel_matches(case, seed)


@kernel_only
def test_kernel_output_types_and_no_final_state(seed, interpreter):
    case = make_case(1, 9, 1, 8, 8, seed, reference=False)
    (q, k, v, g, b, w), state = _inputs(case, torch.bfloat16)
    o, final_state = chunk_gdn2(q, k, v, g, b, w, initial_state=state, path="kernel")
    assert final_state is None and o.dtype == torch.bfloat16 and o.shape == (1, 9, 1, 8)
    o, final_state = chunk_gdn2(q, k, v, g, b, w, initial_state=state, output_final_state=True, path="kernel")
    assert final_state.dtype == torch.float32 and final_state.shape == (1, 1, 8, 8)
    assert torch.isfinite(o.float()).all() and o.float().abs().max() > 0


@kernel_only
def test_kernel_non_contiguous_inputs(seed, interpreter):
    """Inputs that are views with other strides (as a layer's transposes and slices give) have the
    same output and gradients as contiguous ones: the backward reads them as contiguous."""
    case = make_case(2, 20, 1, 16, 24, seed, reference=False)
    inputs, state = _inputs(case, torch.float32)

    def gradients(tensors):
        leaves = [x.detach().requires_grad_(True) for x in tensors]
        o, _ = chunk_gdn2(*leaves, path="kernel")
        o.backward(torch.ones_like(o) + o.detach())
        return [o.detach()] + [x.grad for x in leaves]

    strided = [x.detach().transpose(0, 1).contiguous().transpose(0, 1) for x in inputs]
    assert not any(x.is_contiguous() for x in strided)
    for got, want in zip(gradients(strided), gradients(inputs)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_unsupported_chunk_size_is_a_reason(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.zeros(1, 3, 1, 8)
    assert kernel.unsupported_reason(x, x, x, x, x, x, None, 32) == "chunk_size=32; the Triton kernels use chunks of 64"
    assert "chunks of 64" in which_path(x, x, x, x, x, x, None, chunk_size=32, path="kernel").reason


def test_unsupported_reasons(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.zeros(1, 3, 1, 8)
    assert "Triton needs CUDA or TRITON_INTERPRET=1" in kernel.unsupported_reason(x, x, x, x, x, x, None, 64)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernel.unsupported_reason(x, x, x, x, x, x, None, 64) is None
    wide = torch.zeros(1, 3, 1, 300)
    assert kernel.unsupported_reason(wide, wide, x, wide, wide, x, None, 64) == "K=300 > 256"
    tall = torch.zeros(1, 3, 1, 260)
    assert kernel.unsupported_reason(x, x, tall, x, x, tall, None, 64) == "V=260 > 256"
    double = x.double()
    assert "float64" in kernel.unsupported_reason(*(double,) * 6, None, 64)
    # a batch row past 32-bit offsets (expanded views: no memory); one token less fits
    for T, reason in ((2 ** 20, "32-bit offsets"), (2 ** 20 - 1, None)):
        long_row = torch.zeros(1, 1, 1, 1).expand(1, T, 16, 128)
        got = kernel.unsupported_reason(*(long_row,) * 6, None, 64)
        assert got is None if reason is None else reason in got, (T, got)


def test_fallback_to_chunk_path_with_one_warning(seed, monkeypatch):
    """Without the interpreter on CPU, a requested kernel gives way to the chunk path, warned once."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("GDN2_PATH", raising=False)
    forget_announcements()
    case = make_case(1, 20, 1, 8, 8, seed)
    (q, k, v, g, b, w), state = _inputs(case, torch.float32)
    choice = which_path(q, k, v, g, b, w, state, path="kernel")
    assert choice.path == "chunk" and "TRITON_INTERPRET" in choice.reason
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        o1, _ = chunk_gdn2(q, k, v, g, b, w, initial_state=state, path="kernel")
        o2, _ = chunk_gdn2(q, k, v, g, b, w, initial_state=state, path="kernel")
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "requested but unavailable" in messages[0], messages
    reference, _ = chunk_gdn2(q, k, v, g, b, w, initial_state=state, path="chunk")
    # the same path; CPU products may sum in another order from one call to the next (one entry
    # in 160 once differed by 2.2e-5)
    torch.testing.assert_close(o1, reference, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(o2, reference, rtol=1e-4, atol=1e-4)


@kernel_only
def test_packed_sequences_on_the_kernel_path(interpreter, seed):
    """cu_seqlens through the Triton kernels (natively, one chunk table): equal to separate runs."""
    from gdn2.testing import packed_case, random_lengths

    case = packed_case(seed, random_lengths(seed, 4), H=1, K=16, V=8)
    assert which_path(*(torch.zeros(1, 1, 1, 16) for _ in range(6)), path="kernel").path == "kernel"
    result = run_torch(case, "float32", 64, "kernel")
    for name, value in result.items():
        error = float(np.linalg.norm(value - case["expected"][name]) / np.linalg.norm(case["expected"][name]))
        assert error <= 1e-4, (name, error, seed)


@kernel_only
def test_native_packed_sequences_across_chunks(interpreter, seed):
    """Packed sequences run natively (no padded batch): sequences of several chunks, one of
    exactly one chunk, one token, an empty one; every output and gradient, initial and final
    states per sequence, against the spec on each sequence alone."""
    from gdn2.testing import packed_case

    case = packed_case(seed, [70, 1, 64, 150, 0, 33], H=1, K=16, V=8)
    result = run_torch(case, "float32", 64, "kernel")
    for name, value in result.items():
        error = float(np.linalg.norm(value - case["expected"][name]) / max(np.linalg.norm(case["expected"][name]), 1e-30))
        assert error <= 1e-4, (name, error, seed)


@kernel_only
def test_h200_bench_checks_packed_sequences(interpreter, seed, monkeypatch):
    """``bench/triton_h200.py``'s packed check (the GPU's check of ``cu_seqlens`` on the kernel
    path) run here on the CPU at a small size: every output and gradient, each within float32's
    tolerance of the spec on each sequence alone."""
    from pathlib import Path

    from tests.bench_scripts import load_bench

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    bench = load_bench("triton_h200", "triton_h200_packed_check")
    assert all(0 in lengths for lengths, *_ in bench.PACKED_CHECK_SHAPES)  # an empty sequence at each shape
    errors = bench.check_packed([1, 20, 0, 70], 1, 16, 8, torch.float32, seed, device="cpu")
    assert set(errors) == {"o", "final_state", "dq", "dk", "dv", "dg", "db", "dw", "dinitial_state"}
    assert max(errors.values()) <= 1e-4, (errors, seed)


def test_h200_bench_repeatability(interpreter, monkeypatch):
    """``bench/triton_h200.py``'s repeatability check (the same bits in every forward+backward at
    a timing shape) on the CPU at a small size: the kernel path repeats itself, and a function
    that does not is caught."""
    from pathlib import Path

    from tests.bench_scripts import load_bench

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    bench = load_bench("triton_h200", "triton_h200_repeatability")
    shape = (1, 40, 1, 16, 8)
    result = bench.repeatability(bench.gdn2_kernel, shape, runs=2, dtype=torch.float32, device="cpu")
    assert result == dict(repeatable=True, repeat_difference=0.0)
    calls = []

    def drifting(q, k, v, g, b, w):  # a different rounding on every call
        calls.append(None)
        o, state = bench.gdn2_kernel(q, k, v, g, b, w)
        return o * (1 + 1e-3 * len(calls)), state

    result = bench.repeatability(drifting, shape, runs=2, dtype=torch.float32, device="cpu")
    assert not result["repeatable"] and result["repeat_difference"] > 0


def test_h200_bench_finds_the_launch_that_does_not_repeat(interpreter, monkeypatch):
    """``bench/triton_h200.py``'s repeat checks on the CPU at a small size: each check and each
    stage of ``launch_repeats`` repeats its bits on the kernel path, and a launch (or a function)
    that changes its results between calls is named, with the stages before it clean."""
    from pathlib import Path

    from gdn2.torch.triton import backward
    from tests.bench_scripts import load_bench

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    bench = load_bench("triton_h200", "triton_h200_launch_repeats")
    shape = (1, 40, 1, 16, 8)
    found = bench.launch_repeats(shape, torch.float32, 3, runs=2, device="cpu")
    assert found == dict(forward=[], state_backward=[], contract=[], values=[], keys=[])
    errors = bench.check(bench.gdn2_kernel, shape + ((-3.0, 0.0),), torch.float32, 3, device="cpu", runs=2)
    assert errors.pop("unrepeatable") == [] and max(errors.values()) <= 1e-4
    calls = []
    keys = backward.intra_backward_keys

    def drifting_keys(*args):  # dk off by a different rounding on every call
        calls.append(None)
        dq, dk, dg, db = keys(*args)
        return dq, dk * (1 + 1e-3 * len(calls)), dg, db

    monkeypatch.setattr(backward, "intra_backward_keys", drifting_keys)  # as launch_repeats calls it
    monkeypatch.setattr(kernel, "intra_backward_keys", drifting_keys)  # as the operator's backward does
    monkeypatch.setattr(bench, "LAUNCH_REPEAT_CASES", [(shape, torch.float32)])
    stages = backward.KEYS_STAGES
    rows = list(bench.launch_repeat_rows(dict(KEYS_STAGES=stages + 1), 3, runs=2, device="cpu"))
    assert rows == [dict(variant=dict(KEYS_STAGES=stages + 1), shape=list(shape), dtype="float32",
                         stages=dict(forward=[], state_backward=[], contract=[], values=[], keys=["dk"]))]
    assert backward.KEYS_STAGES == stages  # the variant's setting undone
    errors = bench.check(bench.gdn2_kernel, shape + ((-3.0, 0.0),), torch.float32, 3, device="cpu", runs=2)
    assert errors["unrepeatable"] == ["dk"]


def test_packed_input_reaches_the_kernels_unpadded(monkeypatch):
    """The dispatch hands packed input to the Triton backend as it is (the kernels take the
    offsets), not as a padded batch."""
    from gdn2 import paths
    from gdn2.spec import parse_cu_seqlens
    from gdn2.torch.ops import TORCH

    seen = {}

    def call(**arguments):
        seen.update(arguments)
        return arguments["v"], None

    backend = paths.KernelBackend(name="probe", unsupported_reason=lambda *a: None, call=call, failures=(),
                                  packed=True)
    x = torch.zeros(1, 9, 1, 4)
    sequences = parse_cu_seqlens(np.array([0, 4, 9]), 1, 9)
    paths.run_kernel(TORCH, backend, dict(q=x, k=x, v=x, g=x, b=x, w=x), sequences, "chunk", scale=1.0,
                     initial_state=None, output_final_state=False)
    assert seen["sequences"] is sequences and seen["q"].shape == (1, 9, 1, 4)


def _compile_case(seed):
    case = make_case(1, 20, 1, 16, 16, seed, reference=False)
    (q, k, v, g, b, w), state = _inputs(case, torch.float32)
    return [x.requires_grad_() for x in (q, k, v, g, b, w, state)]


@kernel_only
def test_kernel_operators_pass_opcheck(seed, interpreter):
    """The kernels are PyTorch custom operators: schema, autograd registration, fake (shape-only)
    implementation and AOT dispatch checked by ``torch.library.opcheck``."""
    *inputs, state = _compile_case(seed)
    result = torch.library.opcheck(torch.ops.gdn2.triton_forward.default, (*inputs, state, 0.25, None, None))
    assert set(result.values()) == {"SUCCESS"}, result
    # packed sequences: 20 tokens as sequences of 7 and 13, one state row each (the fake shapes
    # with the tables; AOT dispatch, the slow check, as above)
    from gdn2.spec import parse_cu_seqlens

    tables = kernel._packed_tables(parse_cu_seqlens(np.array([0, 7, 20]), 1, 20), "cpu")
    states = torch.randn(2, *state.shape[1:], requires_grad=True)
    result = torch.library.opcheck(torch.ops.gdn2.triton_forward.default, (*inputs, states, 0.25, *tables),
                                   test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    assert set(result.values()) == {"SUCCESS"}, result


@kernel_only
def test_kernel_path_compiles_without_graph_breaks(seed, interpreter):
    """torch.compile of a function calling the kernel path: one graph, no break, same values and
    gradients as eager."""
    torch._dynamo.reset()
    tensors = _compile_case(seed)

    def loss(q, k, v, g, b, w, state):
        o, final_state = kernel.triton_gdn2(q, k, v, g, b, w, scale=0.25, initial_state=state, output_final_state=True)
        return (o * o).sum() + final_state.sum()

    explanation = torch._dynamo.explain(loss)(*tensors)
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    eager_grads = torch.autograd.grad(loss(*tensors), tensors)
    compiled_grads = torch.autograd.grad(compiled(*tensors), tensors)
    for eager, traced in zip(eager_grads, compiled_grads):
        torch.testing.assert_close(traced, eager)


@kernel_only
def test_public_entry_on_the_kernel_path_compiles_without_graph_breaks(seed, interpreter):
    """chunk_gdn2(path="kernel") under torch.compile: validation and path choice are traced (the
    choice is logged by eager calls only), the kernels are two operators: one graph, no break."""
    tensors = _compile_case(seed)

    def loss(q, k, v, g, b, w, state):
        o, final_state = chunk_gdn2(q, k, v, g, b, w, initial_state=state, output_final_state=True, path="kernel")
        return (o * o).sum() + final_state.sum()

    eager = loss(*tensors)  # eager first: the choice is logged and the interpreter probed here
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(loss)(*tensors)
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(loss, backend="aot_eager", fullgraph=True)(*tensors), eager)


def _diagonal_tiles_reference(q, k, g, b, chunks):
    """The diagonal 16x16 tiles of P (lower, with the diagonal) and A (strictly lower) in float64,
    from the definition, with the inputs the diagonal launch reads: non-finite k and b as 0, NaN
    and +inf in g as 0. ``chunks``: (batch row, first token, length) per chunk."""
    def clean(x):
        return np.where(np.isfinite(x), x, 0.0)

    k, b = clean(k), clean(b)
    g = np.where(np.isnan(g) | (g == np.inf), 0.0, g)
    B, T, H, K = q.shape
    P = np.zeros((B, H, len(chunks), 64, 64))
    A = np.zeros((B, H, len(chunks), 64, 64))
    for n, (row, first, length) in enumerate(chunks):
        for t_i in range(first, first + length):
            i = t_i - first
            start = first + (i // 16) * 16
            for t_j in range(start, t_i + 1):
                with np.errstate(invalid="ignore"):
                    decay = np.exp(g[row, t_j + 1:t_i + 1].sum(axis=0))  # [H, K]; the empty span: 1
                kd = k[row, t_j] * decay
                P[row, :, n, i, t_j - first] = (q[row, t_i] * kd).sum(-1)
                if t_j < t_i:
                    A[row, :, n, i, t_j - first] = (b[row, t_i] * k[row, t_i] * kd).sum(-1)
    return P, A


@triton.jit
def _suffix_kernel(x, out):
    offsets = tl.arange(0, 16)[:, None] * 8 + tl.arange(0, 8)[None, :]
    tl.store(out + offsets, _exclusive_suffix(tl.load(x + offsets)))


def test_exclusive_suffix_sums_only(interpreter):
    """``_exclusive_suffix`` (the launches' sums of g after each row of a sub-block): against float64
    sums after each row, with a hard reset (-inf reaches only the rows before it) and a step of
    -1e6 whose own row and the rows after it keep every digit (a difference of sums would not)."""
    rng = np.random.default_rng(7)
    x = -rng.uniform(0.0, 3.0, (16, 8))
    x[9, 2] = -np.inf
    x[5, 4] = -1e6
    x = x.astype(np.float32)
    out = torch.empty(16, 8)
    _suffix_kernel[(1,)](torch.from_numpy(x), out)
    expected = np.zeros((16, 8))
    for i in range(16):
        expected[i] = x[i + 1:].astype(np.float64).sum(axis=0)
    got = out.numpy()
    assert np.all(got[:9, 2] == -np.inf) and np.all(np.isfinite(got[9:, 2]))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(got[finite], expected[finite], rtol=1e-6, atol=1e-5)
    assert got[5, 4] == np.float32(expected[5, 4])  # after the -1e6 step: small sums, exact to float32 rounding


@pytest.mark.parametrize("key_block", [16, 32])
@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
def test_diagonal_launch(key_block, packed, seed, interpreter, monkeypatch):
    """The diagonal launch alone against the definition in float64: hard resets
    (g = -inf on some channels in the middle of a group, at a group's first row, at a
    sub-block's first row), log decays down to -20, a NaN in g, non-finite k and b, rows past T
    (T not a multiple of 64), packed sequences (a chunk table, one sequence not a multiple of 16)."""
    from gdn2.torch.triton import forward

    monkeypatch.setattr(forward, "DIAGONAL_KEY_BLOCK", key_block)  # K = 40, 48: a partial last block
    rng = np.random.default_rng(seed)
    B, T, H, K = (1, 117, 2, 48) if packed else (2, 100, 2, 40)
    q, k, b = (rng.standard_normal((B, T, H, K)) for _ in range(3))
    b = rng.uniform(0.0, 2.0, (B, T, H, K))
    g = rng.uniform(-20.0, 0.0, (B, T, H, K)) * (rng.uniform(size=(B, T, H, K)) < 0.3)
    g[0, 6, 0, :5] = -np.inf  # the middle of a group
    g[0, 20, 1, 3:9] = -np.inf  # a group's first row
    g[B - 1, 64 + 32, 0, 10:] = -np.inf  # a sub-block's first row
    g[B - 1, 50, 1, 7] = np.nan
    g[0, 71, 0, 2] = np.inf
    k[0, 9, 1, 4] = np.inf
    k[B - 1, 35, 0, 0] = np.nan
    b[0, 12, 0, 11] = -np.inf
    if packed:  # sequences of 37 and 80 tokens
        chunks = [(0, 0, 37), (0, 37, 64), (0, 101, 16)]
        table = torch.tensor([[first, length] for _, first, length in chunks], dtype=torch.int32)
    else:
        chunks = [(row, 64 * n, min(64, T - 64 * n)) for row in range(B) for n in range(2)]
        table = None
    N = len(chunks) // B
    tensors = [torch.tensor(x, dtype=torch.float32) for x in (q, k, g, b)]

    def launch():  # the launch writes only the diagonal tiles
        P = torch.full((B, H, N, forward.TILES, 16, 16), float("nan"))
        A = torch.full((B, H, N, forward.TILES, 16, 16), float("nan"))
        forward.diagonal(*tensors, P, A, "ieee", table)
        return forward.full_chunk_matrices(P), forward.full_chunk_matrices(A)

    P, A = launch()
    inputs = [x.double().numpy() for x in tensors]
    P_expected, A_expected = _diagonal_tiles_reference(*inputs, [(row, first, length) for row, first, length in chunks])
    if not packed:  # chunks of a batch row are numbered within the row
        P_expected = P_expected.reshape(B, H, B, N, 64, 64)[np.arange(B), :, np.arange(B)]
        A_expected = A_expected.reshape(B, H, B, N, 64, 64)[np.arange(B), :, np.arange(B)]
    for I in range(4):
        tile = slice(16 * I, 16 * I + 16)
        for name, got, expected in (("P", P, P_expected), ("A", A, A_expected)):
            got_tile, expected_tile = got[..., tile, tile].double().numpy(), expected[..., tile, tile]
            assert np.isfinite(got_tile).all(), (name, I, seed)
            error = np.abs(got_tile - expected_tile).max() / np.abs(expected_tile).max()
            assert error <= 1e-5, (name, I, error, seed)


def _substitution_inverse_float32(A):
    """``(I + A)^{-1}`` of strictly lower square matrices ``A`` (float32, any leading shape) by
    forward substitution in float32, row by row: the error a float32 inversion cannot avoid."""
    n = A.shape[-1]
    X = np.broadcast_to(np.eye(n, dtype=np.float32), A.shape).copy()
    for i in range(1, n):
        X[..., i, :] = X[..., i, :] - np.einsum("...m,...mc->...c", A[..., i, :], X, dtype=np.float32)
    return X


def _compact_chunk_matrices(full: torch.Tensor) -> torch.Tensor:
    """Whole ``[..., 64, 64]`` chunk matrices as the kernels store them (``full_chunk_matrices``
    undone): ``[..., 10, 16, 16]``, the tiles on and below the diagonal, row by row."""
    return torch.stack([full[..., 16 * I:16 * I + 16, 16 * J:16 * J + 16] for I in range(4) for J in range(I + 1)], -3)


@pytest.mark.parametrize("X_dtype", [torch.float32, torch.bfloat16])
def test_inverse_launch(X_dtype, seed, interpreter):
    """The inverse launch against float64 ``(I + A)^{-1}`` of whole 64x64 chunk matrices built as
    the kernels build A (``b_i sum_c k_ic k_jc exp(G_ic - G_jc)`` below the diagonal), on keys of
    unit length and of length 3, and with a hard reset (a zero row and column): within 10x the
    error of float32 forward substitution on the same float32 A (at least 1e-6; at most a quarter
    of that over 40 seeds), bfloat16 X within its rounding. Float32 X is formed over A in its own
    buffer, as the kernel path does. (The diagonal tiles' doubling alone, on tiles with entries of
    X in the hundreds: test_doubling_inverts_a_strictly_lower_tile.)"""
    from gdn2.torch.triton import forward

    rng = np.random.default_rng(seed)
    K, chunks = 40, 6
    k = rng.standard_normal((chunks, 64, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    k[3:] *= 3.0  # longer keys: worse conditioned tiles (X's entries to about 10)
    G = np.cumsum(rng.uniform(-0.3, 0.0, (chunks, 64, K)), axis=1)
    b = rng.uniform(0.0, 1.0, (chunks, 64, 1))
    A = np.tril(np.einsum("nic,njc->nij", b * k * np.exp(G), k * np.exp(-G)), -1)
    A[2, 40, :] = A[2, :, 40] = 0.0  # a hard reset: a zero row and column
    A32 = torch.tensor(A, dtype=torch.float32)
    tiles = _compact_chunk_matrices(A32).reshape(1, 1, chunks, forward.TILES, 16, 16).contiguous()
    X = tiles if X_dtype == torch.float32 else torch.full(tiles.shape, float("nan"), dtype=X_dtype)
    forward._inverse_kernel[(chunks,)](tiles, X, PRECISION="ieee", num_warps=forward.INVERSE_WARPS, num_stages=1)
    got = forward.full_chunk_matrices(X.double())[0, 0].numpy()
    expected = np.linalg.inv(np.eye(64) + A32.double().numpy())
    substituted = _substitution_inverse_float32(A32.numpy())
    for n in range(chunks):
        scale = np.abs(expected[n]).max()
        error = np.abs(got[n] - expected[n]).max() / scale
        floor = np.abs(substituted[n] - expected[n]).max() / scale
        tolerance = max(1e-6, 10 * floor) + (2 ** -8 if X_dtype == torch.bfloat16 else 0.0)
        assert np.isfinite(got[n]).all() and error <= tolerance, (n, error, floor, scale, seed)


@pytest.mark.parametrize("packed, dtype, in_bfloat16", [
    (False, torch.float32, None), (True, torch.bfloat16, None), (False, torch.bfloat16, WIDEST_BFLOAT16)],
    ids=["batch-float32", "packed-bfloat16", "batch-bfloat16-widest"])
def test_intra_forward_writes_every_entry(packed, dtype, in_bfloat16, seed, interpreter, monkeypatch):
    """The in-chunk launches write every entry of the buffers they fill (P's ten stored tiles and
    X's), on random inputs with hard resets
    (g = -inf mid sub-block and at a sub-block's first row), a NaN in g, a non-finite k and b, a
    +inf in v and in w, padded rows and a partial last block of key columns (K = 40): buffers
    filled with NaN come back finite, first_bad marks the bad chunks and columns only. Also with
    every buffer that can be bfloat16 in bfloat16 (A then in a float32 scratch buffer, X rounded
    on its store)."""
    if in_bfloat16 is not None:
        monkeypatch.setattr(kernel, "SAVED_IN_BFLOAT16", in_bfloat16)
    filled, first_bad = _intra_forward_filled(packed, dtype, seed)
    assert (first_bad < 64).any() and (first_bad == 64).any() and (first_bad >= 0).all()
    for name, buffer in filled.items():
        assert torch.isfinite(buffer.double()).all(), name
    from gdn2.torch.triton import forward

    X = forward.full_chunk_matrices(filled["X"])
    diagonal = torch.eye(64).bool()
    assert (X[..., diagonal] == 1).all()  # the inverse of a unit lower triangular matrix
    assert (X.double().triu(1) == 0).all()


@kernel_only
def test_unwritten_entries_are_never_read(seed, interpreter, monkeypatch):
    """Every buffer the kernel path allocates filled with NaN (the value launch writes the tiles
    of dA and dP on and below the diagonal only, and a product that read another would spread its
    NaN): output, final state and every gradient equal, bit for bit, the run on buffers as
    allocated, and are finite. Two chunks, a partial last one."""
    case = make_case(1, 100, 1, 32, 24, seed, log_decay_range=(-3.0, 0.0))
    plain = run_torch(case, "float32", path="kernel")
    empty, new_empty = torch.empty, torch.Tensor.new_empty

    def filled(tensor):
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: filled(empty(*a, **kw)))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **kw: filled(new_empty(self, *a, **kw)))
    poisoned = run_torch(case, "float32", path="kernel")
    for name, value in plain.items():
        assert np.isfinite(value).all(), name
        assert np.array_equal(value, poisoned[name]), name


def _intra_forward_filled(packed, dtype, seed):
    """The buffers ``intra_forward`` fills (each first filled with NaN: every entry must be
    written) and ``first_bad``, on the inputs of ``test_intra_forward_writes_every_entry``."""
    from gdn2.spec import parse_cu_seqlens
    from gdn2.torch.triton import forward

    rng = np.random.default_rng(seed)
    B, T, H, K, V = (1, 150, 2, 48, 24) if packed else (2, 130, 2, 40, 24)
    q, k, v = (torch.tensor(rng.standard_normal(shape), dtype=torch.float32) for shape in
               ((B, T, H, K), (B, T, H, K), (B, T, H, V)))
    g = torch.tensor(rng.uniform(-3.0, 0.0, (B, T, H, K)), dtype=torch.float32)
    b = torch.tensor(rng.uniform(0.0, 1.0, (B, T, H, K)), dtype=torch.float32)
    w = torch.tensor(rng.uniform(0.0, 1.0, (B, T, H, V)), dtype=torch.float32)
    g[0, 37, 0] = -np.inf  # a hard reset mid sub-block, on every channel
    g[0, 80, 1, :5] = -np.inf  # at a sub-block's first row, on some channels
    g[0, 100, 0, 3] = np.nan
    k[B - 1, 20, 1, 7] = np.inf
    b[B - 1, 90, 0, 2] = np.nan
    v[0, 70, 1, 5] = np.inf
    w[B - 1, 5, 0, 0] = -np.inf
    q, k, v, g, b, w = (x.to(dtype) for x in (q, k, v, g, b, w))
    if packed:
        chunk_table, _ = kernel._packed_tables(parse_cu_seqlens(np.array([0, 70, 71, 135, T]), 1, T), "cpu")
        N = chunk_table.shape[0]
    else:
        chunk_table, N = None, -(-T // 64)
    buffers = [torch.full(shape, float("nan"), dtype=dtype)  # every entry must be written
               for shape, dtype in zip(kernel._saved_shapes(B, N, H, K, V), kernel._saved_dtypes(q.dtype))]
    qd, kd, gamma, Wk, Uw, Uw_scale, P, X, _, _ = buffers
    filled = dict(qd=qd, kd=kd, Wk=Wk, Uw=Uw, Uw_scale=Uw_scale, gamma=gamma, P=P, X=X)  # in intra_forward's order
    first_bad = torch.full((B, H, N, V), -1, dtype=torch.int32)
    forward.intra_forward(q, k, v, g, b, w, *filled.values(), first_bad, "ieee", chunk_table)
    return filled, first_bad


def test_precision_study_default_is_the_operators():
    """bench/saved_precision.py names its default set literally (its workers import the operator
    only after setting TRITON_INTERPRET); it must be the operator's."""
    from bench_scripts import load_bench

    study = load_bench("saved_precision")
    assert study.DEFAULT == kernel.SAVED_IN_BFLOAT16
    assert study.CONFIGS["default"] == dict(SAVED_IN_BFLOAT16=kernel.SAVED_IN_BFLOAT16)


def test_state_pass_widens_its_products_without_loads_ahead():
    """The state pass's split bfloat16 products only run with its loads issued ahead: Triton 3.6
    builds them without that wrong for the H200 (an illegal memory access at K = 256, which loads
    nothing ahead, and an invalid shared memory read over a single chunk, N = 1, which Triton
    compiles as a constant; the widened products are right there, bench/RESULTS.md). At K <= 128
    over more than one chunk they run (the form the H200 checks time), two chunks ahead; the
    widened form one chunk ahead (two would take more shared memory than an H100 block may)."""
    from gdn2.torch.triton import forward

    for BK, N in ((256, 1), (256, 2), (256, 64), (16, 1), (64, 1), (128, 1)):
        for bfloat16 in (True, False):
            assert forward.state_stages(BK, N, bfloat16) == 1, (BK, N)
            assert not forward.state_split_products(bfloat16, forward.state_stages(BK, N, bfloat16))
    for BK in (16, 64, 128):
        for N in (2, 3, 64):
            assert forward.state_stages(BK, N, True) == 3
            assert forward.state_split_products(True, forward.state_stages(BK, N, True))
            assert forward.state_stages(BK, N, False) == 2
            assert not forward.state_split_products(False, forward.state_stages(BK, N, False))


@kernel_only
def test_state_forward_rounded_state(seed, interpreter, monkeypatch):
    """``STATE_FORWARD_ROUNDED_STATE`` (the default): ``Wk S`` on the state rounded to bfloat16 in
    the state pass's split form (a spy checks that it reached the kernel, and only there). o moves
    (by about 1e-4 of its norm: one rounding of S), the final state barely; every error against
    the spec, o's and every gradient's, stays within 10% (plus 1e-4) of the split state's (three
    chunks, a hard reset). o is bfloat16: at some draws no entry of it crosses a rounding step
    (seed 701980805), so only the float32 final state must move (2.7e-5 to 1.1e-4 of its norm at
    three seeds)."""
    from gdn2.torch.triton import forward

    case = _rounded_case(make_case(1, 130, 1, 32, 16, seed, log_decay_range=(-3.0, 0.0)), torch.bfloat16)
    case["inputs"]["g"][0, 90, 0] = -np.inf
    spy = _LaunchSpy(forward._state_forward_kernel)
    monkeypatch.setattr(forward, "_state_forward_kernel", spy)
    runs, errors = [], []
    for rounded in (False, True):
        monkeypatch.setattr(forward, "STATE_FORWARD_ROUNDED_STATE", rounded)
        spy.launches.clear()
        runs.append(run_torch(case, "bfloat16", path="kernel"))
        errors.append(worst_error(runs[-1], case["expected"])[2])
        split = [launch["ROUNDED_STATE"] for launch in spy.launches if launch["SPLIT"]]
        assert split and set(split) == {rounded}
        assert not any(launch["ROUNDED_STATE"] for launch in spy.launches if not launch["SPLIT"])
    for name, least in (("o", 0.0), ("final_state", 1e-7)):
        exact, rounded = (torch.as_tensor(np.asarray(run[name], dtype=np.float64)) for run in runs)
        difference = (rounded - exact).norm() / exact.norm()
        assert least <= difference < 1e-3, (seed, name, difference.item())
    for name, error in errors[1].items():
        assert error <= 1.1 * errors[0][name] + 1e-4, (seed, name, error, errors[0][name])


def test_state_backward_loads_ahead_only_where_built_right(monkeypatch):
    """With its loads ahead on (``STATE_BACKWARD_STAGES``, ``STATE_BACKWARD_ROUNDED_STAGES`` in the
    rounded loop), the reverse state pass loads chunks ahead only with bfloat16 saved buffers
    (float32 ones gave non-finite results on the H200 with Triton 3.6), at K <= 64 in the TF32 loop
    (at 128 it was slower) and K <= 128 in the rounded loop, over more than one chunk, and two
    chunks ahead only on devices with the shared memory for them."""
    from gdn2.torch.triton import backward

    monkeypatch.setattr(backward, "STATE_BACKWARD_STAGES", 2)
    monkeypatch.setattr(backward, "STATE_BACKWARD_ROUNDED_STAGES", 3)
    for K in (16, 40, 64, 65, 128, 256):
        for rounded, stages, most in ((False, 2, 64), (True, 3, 128)):
            assert backward.state_backward_stages(K, 2, True, rounded) == (stages if K <= most else 1), (K, rounded)
            assert backward.state_backward_stages(K, 1, True, rounded) == 1
            assert backward.state_backward_stages(K, 64, False, rounded) == 1
    # two chunks ahead (217 KiB at K = V = 128) only where a block may take that much shared memory
    hopper, ampere = 227 * 1024, 163 * 1024
    assert backward.state_backward_stages(128, 2, True, True, hopper) == 3
    assert backward.state_backward_stages(128, 2, True, True, ampere) == 2
    assert backward.state_backward_stages(64, 2, True, False, ampere) == 2
    assert backward.state_backward_stages(128, 1, True, True, ampere) == 1
    from gdn2.torch.triton import forward

    assert forward._shared_per_block(torch.device("cpu")) is None


def test_state_value_block_fits_small_shared_memory():
    """The state pass's value block: ``value_block``'s, except that its widened form loading ahead
    at BK > 64 takes at most 32 columns on devices whose blocks may take less than 113 KiB of
    shared memory (sm_89's 99 KiB: 113 KiB at 64 columns, bench/kernel_resources.py --arch 89)."""
    from gdn2.torch.triton import forward

    ada, ampere, hopper = 99 * 1024, 163 * 1024, 227 * 1024
    many = 512  # heads enough for value blocks of 64 columns
    assert forward.value_block(128, many, forward.STATE_MIN_PROGRAMS) == 64
    assert forward.state_value_block(128, many, 128, False, 2, ada) == 32
    for limit in (ampere, hopper, None):
        assert forward.state_value_block(128, many, 128, False, 2, limit) == 64
    assert forward.state_value_block(128, many, 128, True, 3, ada) == 64  # split form: 74 KiB on sm_89
    assert forward.state_value_block(128, many, 128, False, 1, ada) == 64  # nothing loaded ahead
    assert forward.state_value_block(64, many, 64, False, 2, ada) == 64  # 80.8 KiB at K = V = 64
    assert forward.state_value_block(128, 4, 128, False, 2, ada) == 16  # few heads: 16 columns anyway
    # programs enough: 256 in the widened form, 128 in the split form (16 and 32 columns at B=2 H=16)
    assert forward.state_value_block(128, 32, 128, False, 2, None) == 16
    assert forward.state_value_block(128, 32, 128, True, 3, None) == 32


@kernel_only
def test_state_forward_in_narrower_value_blocks_on_small_shared_memory(seed, interpreter, monkeypatch):
    """float32 inputs at K = 128 on a device with 99 KiB of shared memory a block: the state pass
    loads ahead in value blocks of 32 columns (a spy records the launch) and output, final state
    and every gradient match the spec."""
    from gdn2.torch.ops import interpreter_problem
    from gdn2.torch.triton import forward

    assert interpreter_problem() is None  # its one probe of the kernels runs before the spy
    monkeypatch.setattr(forward, "STATE_MIN_PROGRAMS", 1)  # one head: value blocks of 64 columns otherwise
    monkeypatch.setattr(forward, "_shared_per_block", lambda device: 99 * 1024)
    spy = _LaunchSpy(forward._state_forward_kernel)
    monkeypatch.setattr(forward, "_state_forward_kernel", spy)
    case = make_case(1, 66, 1, 128, 64, seed, log_decay_range=(-3.0, 0.0))  # two chunks: loads ahead
    result = run_torch(case, "float32", path="kernel")
    error, name, errors = worst_error(result, case["expected"])
    assert error <= 1e-4, (seed, name, errors)
    assert [(launch["BV"], launch["STAGES"], launch["SPLIT"]) for launch in spy.launches] == [(32, 2, False)]


@kernel_only
def test_state_backward_form_by_dtype(seed, interpreter, monkeypatch):
    """The reverse pass as the operator launches it at K = 128 by default: bfloat16 inputs (qd, kd,
    Wk saved in bfloat16, dO bfloat16) take the rounded loop (``STATE_BACKWARD_ROUNDED``), the
    state's gradient split for kd dS, in blocks of 64 key rows loading a chunk ahead; float32
    inputs the TF32 loop in one block of 128 rows without loads ahead. Output, final state and
    every gradient against the spec (bfloat16 on the rounded inputs); a spy records the launches.
    Above ``STATE_BACKWARD_ROUNDED_MAX_K`` (128) the rounded loop never runs (its split form made
    an illegal memory access at K = 256 on an H100), nor with the setting off."""
    from gdn2.torch.ops import interpreter_problem
    from gdn2.torch.triton import backward

    assert interpreter_problem() is None  # its one probe of the kernels runs before the spy
    passes = _LaunchSpy(backward._state_backward_kernel)
    monkeypatch.setattr(backward, "_state_backward_kernel", passes)
    for dtype, tolerance in ((torch.bfloat16, 2e-2), (torch.float32, 1e-4)):
        case = make_case(1, 66, 1, 128, 16, seed, log_decay_range=(-3.0, 0.0))  # two chunks: loads ahead
        if dtype == torch.bfloat16:
            case = _rounded_case(case, dtype)
        result = run_torch(case, str(dtype).removeprefix("torch."), path="kernel")
        error, name, errors = worst_error(result, case["expected"])
        assert error <= tolerance, (seed, dtype, name, errors)
    forms = [(launch["ROUNDED"], launch["SPLIT_DS"], launch["KB"], launch["STAGES"]) for launch in passes.launches]
    assert forms == [(True, True, 64, 3), (False, True, 128, 1)], forms  # two chunks ahead, none
    assert backward.state_backward_rounded(True, torch.bfloat16, 128, 2)
    assert not backward.state_backward_rounded(True, torch.bfloat16, 128, 1)  # one chunk: the TF32 loop
    assert not backward.state_backward_rounded(True, torch.bfloat16, 129, 2)
    assert not backward.state_backward_rounded(True, torch.float32, 64, 2)
    assert not backward.state_backward_rounded(False, torch.bfloat16, 64, 2)
    monkeypatch.setattr(backward, "STATE_BACKWARD_ROUNDED_STAGES", 1)  # no loads ahead: the TF32 loop
    assert not backward.state_backward_rounded(True, torch.bfloat16, 128, 2)
    monkeypatch.setattr(backward, "STATE_BACKWARD_ROUNDED_STAGES", 3)
    monkeypatch.setattr(backward, "STATE_BACKWARD_ROUNDED", False)
    assert not backward.state_backward_rounded(True, torch.bfloat16, 64, 2)


def test_register_caps_name_launches():
    """Every launch ``MAX_REGISTERS`` caps is a launch that asks for its cap (a misspelt name would
    cap nothing, silently), and the caps are ones ptxas takes (24 to 255 registers)."""
    import inspect
    import re

    from gdn2.torch.triton import backward, forward

    asked = set(re.findall(r'register_cap\("(\w+)"\)', inspect.getsource(forward) + inspect.getsource(backward)))
    assert {"diagonal", "intra_forward", "inverse", "wy", "state_forward", "output", "state_backward",
            "intra_backward_contract", "intra_backward_values", "intra_backward_keys", "gate_gradient",
            "local_values_gradient"} == asked
    assert set(forward.MAX_REGISTERS) <= asked
    assert all(isinstance(cap, int) and 24 <= cap <= 255 for cap in forward.MAX_REGISTERS.values())


@triton.jit
def _doubling_inverse(A, X):
    r = tl.arange(0, 16)
    entries = r[:, None] * 16 + r[None, :]
    for i in tl.static_range(4):
        tl.store(X + 256 * i + entries, _doubled_inverse(tl.load(A + 256 * i + entries), "ieee"))


def test_doubling_inverts_a_strictly_lower_tile(seed, interpreter):
    """``_doubled_inverse`` against float64 inverses of ``I + A`` for four random
    strictly lower 16x16 matrices, one with entries up to 3 (its inverse's entries in the
    hundreds), one with a zero row and column (a hard reset)."""
    rng = np.random.default_rng(seed)
    A = np.tril(rng.uniform(-1.0, 1.0, (4, 16, 16)), -1)
    A[1] *= 3.0
    A[2, 7, :] = 0.0
    A[2, :, 7] = 0.0
    A_t = torch.tensor(A, dtype=torch.float32)
    X_t = torch.empty_like(A_t)
    _doubling_inverse[(1,)](A_t, X_t, num_warps=1)
    expected = np.linalg.inv(np.eye(16) + A)
    for i in range(4):
        error = np.abs(X_t[i].double().numpy() - expected[i]).max() / np.abs(expected[i]).max()
        assert error < 1e-5, (i, error)


def _state_backward_reference(qd, kd, Wk, gamma, P, d_o, d_final, scale, spans):
    """The reverse state pass in float64 on whole chunk matrices: per sequence (its chunks
    ``spans``: (first chunk, end chunk, batch row) and its tokens), ``d_leaving``, ``d_U`` and
    the gradient of the initial state."""
    from gdn2.torch.triton.forward import full_chunk_matrices

    P = full_chunk_matrices(P.double())
    qd, kd, Wk, gamma, d_o = (x.double() for x in (qd, kd, Wk, gamma, d_o))
    H, K, V = qd.shape[1], qd.shape[-1], d_o.shape[-1]
    d_leaving = torch.zeros(qd.shape[0], H, P.shape[2], K, V, dtype=torch.float64)
    d_U = torch.zeros(qd.shape[0], H, P.shape[2] * 64, V, dtype=torch.float64)
    d_initial = torch.zeros(len(spans), H, K, V, dtype=torch.float64)
    for s, (chunk_first, chunk_end, row, tokens) in enumerate(spans):
        for h in range(H):
            d_state = d_final[s, h].double().clone()
            for n in reversed(range(chunk_first, chunk_end)):
                d_leaving[row, h, n] = d_state
                first, length = tokens[n - chunk_first]
                d_out = torch.zeros(64, V, dtype=torch.float64)
                d_out[:length] = d_o[row, first:first + length, h] * scale
                rows = slice(64 * n, 64 * n + 64)
                dU = P[row, h, n].T @ d_out + kd[row, h, rows] @ d_state
                d_U[row, h, rows] = dU
                d_state = gamma[row, h, n][:, None] * d_state + qd[row, h, rows].T @ d_out - Wk[row, h, rows].T @ dU
            d_initial[s, h] = d_state
    return d_leaving, d_U, d_initial


@pytest.mark.parametrize("K, V, key_block, bfloat16", [
    (128, 64, 128, False), (128, 64, 64, False), (200, 24, 128, False), (200, 24, 64, False), (40, 40, 32, False),
    (40, 40, 128, False), (128, 64, 128, True), (200, 24, 64, True), (64, 48, 128, True), (48, 16, 64, True)],
    ids=lambda x: str(x))
@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
def test_state_backward_key_blocks(K, V, key_block, bfloat16, packed, seed, interpreter, monkeypatch):
    """The reverse state pass alone, the state's gradient in one block of key rows or in two and
    four (``STATE_BACKWARD_KEY_BLOCK``, K not a multiple of the block: a partial last one), qd,
    kd, Wk and dO float32 or bfloat16 (widened where read; bfloat16 at K <= 64 in the form that
    loads a chunk ahead, the default), against the recurrence in float64 on the same values: the
    gradient of the state leaving each chunk, of U, and of the initial state; a partial last
    chunk, packed sequences (a chunk table) with one of a single chunk."""
    _check_state_backward(K, V, key_block, bfloat16, packed, seed, monkeypatch)


@pytest.mark.parametrize("K, V", [(128, 64), (100, 24), (48, 16)], ids=lambda x: str(x))
@pytest.mark.parametrize("local, rounded, split", [(True, False, False), (False, True, False), (True, True, False),
                                                   (False, True, True)],
                         ids=["local_dU", "rounded", "local_dU_rounded", "rounded_split_dS"])
def test_state_backward_local_and_rounded_forms(K, V, local, rounded, split, seed, interpreter, monkeypatch):
    """The reverse pass's variants: ``STATE_BACKWARD_LOCAL_DU`` (scale P^T dO made by a launch of
    its own into d_U first) against the float64 recurrence as tightly as the default, and
    ``STATE_BACKWARD_ROUNDED`` (bfloat16 operands: the state's gradient and dU rounded for the
    products, as flash-linear-attention's pass) within bfloat16's rounding (2^-8: a missing or
    halved term is far outside it; P rounded too where it is read in the loop; with
    ``STATE_BACKWARD_SPLIT_DS`` kd dS on the state's gradient in two bfloat16 parts), in key
    blocks of 64 rows, batch and packed. Spies check that each form reached the kernels, and the
    rounded form's error shows its rounding (the TF32 loop's, exact here, is below 1e-5)."""
    from gdn2.torch.triton import backward

    passes = _LaunchSpy(backward._state_backward_kernel)
    local_launches = _LaunchSpy(backward._local_values_gradient_kernel)
    monkeypatch.setattr(backward, "_state_backward_kernel", passes)
    monkeypatch.setattr(backward, "_local_values_gradient_kernel", local_launches)
    monkeypatch.setattr(backward, "STATE_BACKWARD_SPLIT_DS", split)
    for packed in (False, True):
        _check_state_backward(K, V, 64, True, packed, seed, monkeypatch, local=local, rounded=rounded)
    assert [(launch["LOCAL_DU"], launch["ROUNDED"], launch["SPLIT_DS"]) for launch in passes.launches] == [
        (local, rounded, split)] * 2
    assert len(local_launches.launches) == (2 if local else 0)


def _check_state_backward(K, V, key_block, bfloat16, packed, seed, monkeypatch, local=False, rounded=False):
    from gdn2.torch.triton import backward

    monkeypatch.setattr(backward, "STATE_BACKWARD_KEY_BLOCK", key_block)
    monkeypatch.setattr(backward, "STATE_BACKWARD_ROUNDED_KEY_BLOCK", key_block)
    monkeypatch.setattr(backward, "STATE_BACKWARD_LOCAL_DU", local)
    monkeypatch.setattr(backward, "STATE_BACKWARD_ROUNDED", rounded)
    rng = np.random.default_rng(seed)
    H, scale = 2, 0.3
    if packed:  # sequences of 100 and 30 tokens: chunks (0, 64), (64, 36), (100, 30)
        B, T, N = 1, 130, 3
        table = torch.tensor([[0, 64], [64, 36], [100, 30]], dtype=torch.int32)
        sequence_chunks = torch.tensor([0, 2, 3], dtype=torch.int32)
        spans = [(0, 2, 0, [(0, 64), (64, 36)]), (2, 3, 0, [(100, 30)])]
    else:
        B, T, N = 2, 150, 3
        table = sequence_chunks = None
        spans = [(0, N, row, [(0, 64), (64, 64), (128, 22)]) for row in range(B)]
    saved = lambda *shape: torch.tensor(rng.standard_normal(shape) * 0.5, dtype=torch.float32)  # noqa: E731
    qd, kd, Wk = (saved(B, H, N * 64, K) for _ in range(3))
    for x in (qd, kd, Wk):  # padded rows are zero, as the forward leaves them
        x[:, :, 64 * (N - 1) + (30 if packed else 22):] = 0.0
    gamma = torch.tensor(rng.uniform(0.0, 1.0, (B, H, N, K)), dtype=torch.float32)
    P = saved(B, H, N, 10, 16, 16)
    d_o = saved(B, T, H, V)
    if bfloat16:
        qd, kd, Wk, d_o = (x.to(torch.bfloat16) for x in (qd, kd, Wk, d_o))
    d_final = saved(len(spans), H, K, V)
    d_leaving = torch.full((B, H, N, K, V), float("nan"))
    d_U = torch.full((B, H, N * 64, V), float("nan"))
    d_initial = torch.full((len(spans), H, K, V), float("nan"))
    backward.state_backward(qd, kd, Wk, gamma, P, d_o, d_final, d_leaving, d_U, d_initial, scale, "ieee", table,
                            sequence_chunks)
    tolerance = 1e-2 if rounded else 1e-5
    expected = _state_backward_reference(qd, kd, Wk, gamma, P, d_o, d_final, scale, spans)
    errors = []
    for name, got, want in zip(("d_leaving", "d_U", "d_initial"), (d_leaving, d_U, d_initial), expected):
        error = (got.double() - want).abs().max() / want.abs().max()  # NaN (an entry not written) fails
        assert error < tolerance, (name, error)
        errors.append(error)
    if rounded:  # the products' operands were rounded: the exact form's error is far below this
        assert max(errors) > 1e-4, errors
