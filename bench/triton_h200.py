"""gdn2's Triton kernel path against flash-linear-attention's ``chunk_gdn2`` on one GPU.

One run does, in order (every result goes to the JSON file as soon as it exists):

1. correctness on the GPU against the float64 spec (``gdn2.spec``) at small shapes, for gdn2's
   kernel path (and flash-linear-attention's with ``--check-fla``), with float32 and bfloat16
   inputs: output, final state and every gradient (a nonzero gradient flows into the final state);
   and gdn2's on packed sequences (``cu_seqlens``) against the spec on each sequence alone; each
   gdn2 check runs three times, free memory scrambled between, and names the quantities whose
   bits changed (``repeated``);
   optionally (``--launch-repeats``) each launch rerun on the same inputs, for the default and
   each of ``--variants``, naming the first whose bits change (``launch_repeats``);
2. timing, side by side on the same inputs: forward and forward+backward in bfloat16 at the
   three shapes, and the peak memory of one forward+backward; for gdn2 also whether three
   forward+backward passes there give the same bits (``repeatability``: its kernels use no
   atomics, so a difference is a race that the small check shapes can miss);
3. optionally (``--profile``) per-kernel GPU times from ``torch.profiler`` at the first timed shape
   (flash-linear-attention's where it is timed); optionally (``--recheck``) gdn2's checks again;
4. optionally (``--variants``) other launch settings of gdn2's kernels, each compared with the
   default settings on the same bf16 inputs (``AGREEMENT_SHAPES``), checked against the spec and
   timed (at every timed shape, else the first timing shape).

Usage (on the GPU machine)::

    python bench/triton_h200.py --profile --json results.json

``--no-fla`` times gdn2 alone (flash-linear-attention needs ``fla`` importable: ``fla-core`` and
``flash-linear-attention`` 0.6.0); ``--fla-shapes 0`` times it at the first shape only (it
autotunes for minutes per new shape in a fresh process; ``TRITON_CACHE_AUTOTUNING=1`` with a kept
``TRITON_CACHE_DIR`` saves that in later runs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import time
import warnings

import numpy as np
import torch

from gdn2.testing import cuda_kernel_times, make_case, packed_case, run_torch, torch_gradients, worst_error
from gdn2.paths import forget_announcements
from gdn2.torch import chunk_gdn2, which_path
from gdn2.torch.triton.forward import MAX_REGISTERS
from kernel_resources import set_launch  # bench/, next to this script

TIMING_SHAPES = [(8, 4096, 16, 128, 128), (2, 16384, 16, 128, 128), (16, 2048, 32, 64, 64)]
# (B, T, H, K, V, log decay range): head sizes 16 to 256, T not a multiple of 64, K != V.
# The first two are "the small shape" at which both implementations' errors are compared.
CHECK_SHAPES = [
    (2, 300, 2, 128, 128, (-3.0, 0.0)),
    (1, 200, 2, 128, 128, (-20.0, 0.0)),
    (1, 130, 2, 64, 64, (-20.0, 0.0)),
    (1, 77, 2, 256, 96, (-20.0, 0.0)),
    (1, 1, 2, 48, 80, (-20.0, 0.0)),
    (2, 100, 2, 16, 16, (-20.0, 0.0)),
    (1, 700, 2, 256, 256, (-3.0, 0.0)),  # K = 256 over many chunks (the state pass without loads ahead)
    (1, 64, 2, 128, 128, (-20.0, 0.0)),  # one whole chunk at K = 128 (the passes' one-chunk builds)
]
# (sequence lengths, H, K, V): packed in one row (cu_seqlens), g in [-20, 0], an initial and a
# final state per sequence: sequences shorter than, as long as and longer than a chunk, one token,
# an empty one.
PACKED_CHECK_SHAPES = [
    ([1, 63, 64, 65, 200, 0, 130, 17], 2, 128, 128),
    ([300, 5, 0, 77], 2, 64, 64),
]
# Each gdn2 check runs this many times, free memory scrambled between (``repeated``).
CHECK_RUNS = 3
# (B, T, H, K, V, dtype) at which ``--launch-repeats`` looks for the launch whose bits change: on an
# H100, float32 inputs at K = V = 64 gave different dk, dg and db from one call to the next (at B=1
# T=382 H=2, packed or not; db's error against the spec 1.5e-3 to 4.2e-2 on one draw), where
# packed K = V = 128 and the bfloat16 timing shapes repeated their bits: the contraction's loads
# ahead (``contract_stages`` in backward.py).
LAUNCH_REPEAT_CASES = [((1, 382, 2, 64, 64), torch.float32), ((1, 382, 2, 64, 64), torch.bfloat16),
                       ((1, 382, 2, 128, 128), torch.float32), ((16, 190, 32, 64, 64), torch.float32)]
# (B, T, H, K, V): shapes at which a variant's bf16 results are compared with the default's on
# the same inputs, chosen for the value blocks the sequential passes take (16, 32 and 64 columns
# at K = V = 128: value_block shrinks them for few heads; 32 and 64 at K = V = 64), T not a
# multiple of 64.
AGREEMENT_SHAPES = [(1, 700, 2, 128, 128), (4, 520, 16, 128, 128), (8, 300, 16, 128, 128), (8, 190, 16, 64, 64),
                    (16, 190, 32, 64, 64)]
# Launch-setting variants of gdn2 go here (module constants of its kernel launchers, e.g.
# ``dict(STATE_WARPS=8)``), timed at every timed shape and checked (``--variants``); the
# ones timed before are in bench/RESULTS.md.
VARIANTS: list[dict] = [
    # the state pass's and the output's products widened to float32 (TF32): the form before
    dict(STATE_BFLOAT16_PRODUCTS=False, OUTPUT_BFLOAT16_PRODUCT=False),
    # U saved in float32 (the default before 2026-12-03; o's bf16 error 3.68e-3 against 3.89e-3)
    dict(SAVED_IN_BFLOAT16=("states", "qd", "kd", "Wk", "P", "inverse")),
    # Uw in bfloat16 too (the bf16 check's worst gradient 5.03e-3 -> 6.10e-3, db)
    dict(SAVED_IN_BFLOAT16=("states", "qd", "kd", "Wk", "U", "P", "inverse", "Uw")),
    # every buffer that can be bfloat16, b k exp(G) in Wk's buffer, the WY products on bfloat16 X and bkd
    dict(SAVED_IN_BFLOAT16=("states", "qd", "kd", "Wk", "Uw", "U", "inverse", "P"), DECAYED_ERASE_KEYS_IN_WK=True),
    # b k exp(G) in a float32 scratch buffer, the WY products in TF32 (the default before
    # 2026-12-06's fourth run: since, in Wk's bfloat16 buffer)
    dict(DECAYED_ERASE_KEYS_IN_WK=False),
    # the inverse launch without its register cap (146 registers) and at two warps: 1.962 and 1.976 against 1.942 ms
    dict(MAX_REGISTERS={launch: cap for launch, cap in MAX_REGISTERS.items() if launch != "inverse"}),
    dict(INVERSE_WARPS=2),
    # 7-10, the reverse pass's TF32 loop (the default with float32 buffers or K > 128;
    # STATE_BACKWARD_ROUNDED off): the state's gradient in blocks of 64 key rows (sm_90a, Triton 3.6:
    # 1,310 instructions a chunk, 344 B of spills, against 1,224 and 64 B; H200 2026-12-05:
    # forward+backward 8.705 / 8.157 ms against 8.547 / 8.153)
    dict(STATE_BACKWARD_ROUNDED=False, STATE_BACKWARD_KEY_BLOCK=64),
    # the reverse state pass loading a chunk ahead at K = 128 too (bf16 saved buffers), in blocks
    # of 64 key rows (sm_90a: 104.5 KiB of shared memory, 516 B of spills; H200 2026-12-05:
    # forward+backward 8.656 ms against 8.554 at the first shape) or in one block of 128 (120.5
    # KiB, one program a multiprocessor: 9.215)
    dict(STATE_BACKWARD_ROUNDED=False, STATE_BACKWARD_MAX_STAGED_K=128, STATE_BACKWARD_KEY_BLOCK=64),
    dict(STATE_BACKWARD_ROUNDED=False, STATE_BACKWARD_MAX_STAGED_K=128),
    # without loads ahead at K <= 64 (the default before 2026-12-05's fifth run: 7.586 against
    # 7.547 ms forward+backward at the third shape, bit-identical)
    dict(STATE_BACKWARD_ROUNDED=False, STATE_BACKWARD_STAGES=1),
    # the default before 2026-12-05's run: d_leaving in float32 and the in-chunk backward's
    # products widened (H200: forward+backward 8.327 / 7.952 ms against the default's 8.027 /
    # 7.720 at the first and third shapes); d_U in bfloat16 too (every contraction product on
    # stored operands; db's error up to 1.9x beside fla, a speed reference; H100 2026-12-06: its
    # three forward+backward passes at each timed shape gave different bits, the contraction's
    # d_bkd: its S and dS copied over while products read them, since mended, contract_stages);
    # the products with d_leaving in float32 (8.131 / 7.862 against that process's 8.284 / 7.912)
    dict(GRADIENTS_IN_BFLOAT16=(), INTRA_BACKWARD_BFLOAT16_PRODUCTS=False),
    dict(GRADIENTS_IN_BFLOAT16=("d_leaving", "d_U")),
    dict(GRADIENTS_IN_BFLOAT16=()),
    # Uw saved in float32 (the default before UW_IN_FLOAT16: float16 over its largest magnitude per
    # chunk and value column)
    dict(UW_IN_FLOAT16=False),
    # the in-chunk backward's loops without loads ahead, or fewer (suspects for the float32 K = V = 64
    # launches whose bits change between calls: LAUNCH_REPEAT_CASES; the value and keys launches
    # repeated theirs on the H200, the contraction did not, at two stages or three)
    dict(VALUES_STAGES=1),
    # the contraction loading no value block or one ahead with bfloat16 inputs (the default, 3,
    # between 2026-12-05's seventh and eighth runs 1: H200 forward+backward 8.539 / 7.906 ms against
    # 8.197 / 7.828 with three; float32 inputs never load ahead, contract_stages in backward.py)
    dict(CONTRACT_STAGES=1),
    dict(CONTRACT_STAGES=2),
    dict(KEYS_STAGES=1),
    # the contraction and value launches at one warpgroup (4 warps) instead of two: Triton's wait for
    # asynchronous tensor-core products did not synchronise the warpgroups of a program
    # (triton-lang/triton#11047); sm_90a at float32 K = V = 64: the value launch spills 264 B
    dict(INTRA_BACKWARD_WARPS=4),
    # the value launch without its warpgroup barrier (the default with Triton < 3.9 at 8 warps has
    # it: warpgroup_barrier in backward.py): what the barrier costs, and whether bits then change
    dict(VALUES_WARPGROUP_BARRIER=False),
    # Tried on the H200 (2026-12-05) and removed: the reverse pass in value blocks of 32
    # (STATE_BACKWARD_MIN_PROGRAMS=512; 240 registers, no spills, two waves at the first shape):
    # 8.822 ms forward+backward against 8.535, with loads a chunk ahead at K = 128 8.929;
    # the reverse pass at 8 warps capped at 128
    # registers; the state forward at 8 warps, capped at 128 registers or not (bit-identical at
    # the five agreement shapes, then non-finite at B=1 T=200 H=2 K=V=128 and an illegal memory
    # access); the reverse pass's products on bfloat16 operands beside TF32 ones (dU, P and dS
    # rounded in part: illegal memory accesses); the diagonal tiles made by the intra-forward launch
    # (forward 2.57 against 1.87 ms); L2 prefetches in the reverse pass (slower). Triton 3.6.
    # Tried on an H100 (2026-12-05) and removed, no faster: the intra-forward launch over the heads
    # in reverse order (2.076 / 2.083 against 2.085 / 2.087 ms forward, first shape, two processes).
    # Tried on an H100 (2026-12-06), no faster: the output launch's qd S over key blocks of 128
    # (OUTPUT_KEY_BLOCK=128: one step at K = 128, 72 registers against 84) or 32: forward 2.025 /
    # 2.021 and 2.019 / 2.021 ms against the default's 2.014 / 2.013 at the first shape (two
    # processes), 2.006 / 2.005 and 2.040 / 2.037 against 2.011 / 2.006 at the third. The rounded
    # reverse pass in smaller value blocks (STATE_BACKWARD_MIN_PROGRAMS=1024: 32 columns at the
    # third shape, 16 at the first): the pass 0.389 -> 0.427 and 0.50 -> 1.20 ms. The output
    # launch over all 128 value columns a program (one read of qd and P a chunk): the launch 0.239
    # ms against 0.246, the forward no faster (1.965 / 1.970 against 1.958 / 1.975 ms at the first
    # shape); at eight warps 1.986 / 1.991. The state forward at 128 programs at least
    # one chunk ahead (32 value columns at the second shape, one wave): forward 2.108 against 2.077
    # ms there (two chunks ahead with it is the default since). At the second shape with 128 programs, the reverse pass's scale P^T dO
    # by a launch of its own (variants 23, 24): forward+backward 8.597 against 8.436 ms, and with
    # two chunks ahead 8.389 against 8.228 (the launch 0.163 ms, the pass no faster).
    # 21: the reverse pass's TF32 loop, the default before 2026-12-06 (since: the rounded loop,
    # every product on bfloat16 operands, the state's gradient split for kd dS; H100 0.739 ->
    # 0.499 ms at the first shape)
    dict(STATE_BACKWARD_ROUNDED=False),
    # 22: the rounded loop with the state's gradient rounded once for kd dS (H200 2026-12-06: the
    # pass 0.43 ms, right in three processes; its worst gradient error rose above fla's on one
    # draw, on the CPU and on the GPU)
    dict(STATE_BACKWARD_SPLIT_DS=False),
    # 23-25: scale P^T dO made first by a launch of its own into d_U (STATE_BACKWARD_LOCAL_DU; H100
    # 2026-12-05, with dS rounded once: the loop 0.743 -> 0.503 ms, the launch 0.23 ms); at three
    # stages (225 KiB); with d_U in bfloat16
    dict(STATE_BACKWARD_LOCAL_DU=True),
    dict(STATE_BACKWARD_LOCAL_DU=True, STATE_BACKWARD_STAGES=3),
    dict(STATE_BACKWARD_LOCAL_DU=True, GRADIENTS_IN_BFLOAT16=("d_leaving", "d_U")),
    # 26: the state forward's Wk S on the state split in two bfloat16 parts, the default before
    # 2026-12-06 (since: on the state rounded once, STATE_FORWARD_ROUNDED_STATE; sm_90a: 1,160
    # instructions a chunk against 851; H100, four processes: forward 2.025 against 2.012 ms at
    # the first shape)
    dict(STATE_FORWARD_ROUNDED_STATE=False),
    # 27: the default before 2026-12-06's fourth run: P and the inverse saved in float32, b k exp(G)
    # in a float32 scratch buffer, the WY products in TF32
    dict(SAVED_IN_BFLOAT16=("states", "qd", "kd", "Wk", "U"), DECAYED_ERASE_KEYS_IN_WK=False),
    # 28, 29: the steps between 27 and the default: P in bfloat16 alone; and b k exp(G) in Wk's
    # buffer (the inverse in float32: the WY products in TF32)
    dict(SAVED_IN_BFLOAT16=("states", "qd", "kd", "Wk", "U", "P"), DECAYED_ERASE_KEYS_IN_WK=False),
    dict(SAVED_IN_BFLOAT16=("states", "qd", "kd", "Wk", "U", "P")),
    # 30: the rounded reverse pass loading one chunk ahead instead of two (the default before
    # 2026-12-06's fifth run: H100, forward+backward 8.396 / 7.685 ms against 8.179 / 7.671 at
    # the second and third shapes, bit-identical); 31: at 256 programs at least (16 value columns
    # a program at the second shape, two waves: the pass 1.128 against 0.722 ms)
    dict(STATE_BACKWARD_ROUNDED_STAGES=2),
    dict(STATE_BACKWARD_MIN_PROGRAMS=256),
    # 32: the state forward's split form one chunk ahead at 256 programs at least (the default
    # before 2026-12-06's sixth run: H100, forward 2.080 / 1.882 / 1.883 ms against 1.965 / 1.869 /
    # 1.892 at the three shapes, bit-identical); 33: three chunks ahead (154.2 KiB at the second
    # shape, as fla's pass there: 32 columns, four stages; then forward 1.937 and 1.901 ms at the
    # second and first shapes)
    dict(STATE_SPLIT_STAGES=2, STATE_SPLIT_MIN_PROGRAMS=256),
    dict(STATE_SPLIT_STAGES=4),
    # the contraction loading ahead with float32 states too (one stage: contract_stages)
    dict(CONTRACT_FLOAT32_STAGES=2),
    dict(CONTRACT_FLOAT32_STAGES=3),
    # Tried on an H100 (2026-12-06) and removed, no faster: the diagonal launch capped at 144
    # registers (sm_90a: no spills, 21.9% occupancy against 168 registers' 18.8%), the launch
    # 0.302 -> 0.306 ms at the first shape, 0.346 -> 0.353 at the third; at 128 (56 B of spills,
    # 25%) 0.365 and 0.409. Timed on the H200 (2026-12-06) and removed: the keys launch's pair
    # loop two steps a trip (Triton's loop_unroll_factor; sm_90a: 310 instructions a step against
    # 333, 236 B of spills against 204), bit-identical, forward+backward 7.629 -> 7.761 ms at the
    # first shape, 7.398 -> 7.656 at the third (the launch 3.604 -> 3.738 ms).
    # 36, 37: the intra-forward's span sums as tensor-core products in place of scans
    # (INTRA_FORWARD_SPAN_SUMS; sm_90a, K = V = 128: no shuffles in the key loop, 0.270 and 0.240 G
    # warp-instructions a launch against 0.237, 192 and 148 B of spills against none)
    dict(INTRA_FORWARD_SPAN_SUMS="products"),
    dict(INTRA_FORWARD_SPAN_SUMS="stacked"),
]


def gdn2_kernel(q, k, v, g, b, w, initial_state=None, output_final_state=False):
    return chunk_gdn2(q, k, v, g, b, w, initial_state=initial_state, output_final_state=output_final_state, path="kernel")


def fla_function():
    from fla.ops.gdn2 import chunk_gdn2 as fla_chunk_gdn2

    def fla(q, k, v, g, b, w, initial_state=None, output_final_state=False):
        return fla_chunk_gdn2(q, k, v, g, b, w, initial_state=initial_state, output_final_state=output_final_state)

    return fla


def fla_state_pass_configs() -> dict:
    """The configurations flash-linear-attention's autotuner chose in this process for its two
    sequential state passes (what ``bench/kernel_resources.py --fla`` compiles), as text."""
    from fla.ops.common import chunk_delta_h

    chosen = {}
    for name in ("chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64"):
        kernel = getattr(chunk_delta_h, name)
        while kernel is not None and getattr(kernel, "best_config", None) is None:
            kernel = getattr(kernel, "fn", None)  # under fla's heuristics and autotuner wrappers
        chosen[name] = str(kernel.best_config) if kernel is not None else None
    return chosen


def scramble_free_memory(device="cuda"):
    """Random bits into the memory PyTorch's caching allocator holds free (512 MiB), where the
    next buffers come from: a kernel that reads what it did not write then sees other values."""
    if device == "cuda":
        noise = torch.empty(2 ** 27, device=device).normal_()
        del noise


def repeated(run, runs=1, device="cuda"):
    """``run()``'s outputs (a dict of numpy arrays) and the names of those that came out different
    in any of ``runs - 1`` more calls, free memory scrambled before each (gdn2's kernels use no
    atomics: a difference is a race or a read of memory no launch wrote)."""
    first = run()
    differ = set()
    for _ in range(runs - 1):
        scramble_free_memory(device)
        again = run()
        differ |= {name for name in first if not np.array_equal(first[name], again[name], equal_nan=True)}
    return first, sorted(differ)


def check(function, shape, dtype, seed, device="cuda", runs=1):
    """Relative errors against the float64 spec of o, final state and every gradient (a nonzero
    gradient flows into the final state); with ``runs`` > 1 also ``unrepeatable``: the names of
    those whose bits changed over ``runs`` calls (``repeated``)."""
    B, T, H, K, V, decay = shape
    case = make_case(B, T, H, K, V, seed, log_decay_range=decay)
    return _errors(lambda: torch_gradients(case, str(dtype).rsplit(".", 1)[-1], function, device), case["expected"],
                   runs, device)


def check_packed(lengths, H, K, V, dtype, seed, device="cuda", runs=1):
    """Relative errors of gdn2's kernel path on sequences packed in one row (``cu_seqlens``)
    against the float64 spec on each sequence alone: o, the final states and every gradient (a
    nonzero gradient flows into every final state); ``runs`` as in ``check``."""
    case = packed_case(seed, lengths, H=H, K=K, V=V)
    return _errors(lambda: run_torch(case, str(dtype).rsplit(".", 1)[-1], 64, "kernel", device=device),
                   case["expected"], runs, device)


def _errors(run, expected, runs, device):
    """``run()``'s relative errors against ``expected``; with ``runs`` > 1 also ``unrepeatable``
    (``repeated``)."""
    result, differ = repeated(run, runs, device)
    errors = worst_error(result, expected)[2]
    return errors if runs == 1 else dict(errors, unrepeatable=differ)


def launch_repeats(shape, dtype, seed, runs=3, device="cuda"):
    """Which of gdn2's launches give different bits on the same inputs: the forward (its outputs
    and saved buffers) called ``runs`` times, then each stage of the backward (the reverse state
    pass, the contractions, the value launch, the keys and gate-gradient launches) called ``runs``
    times on the first call's results of the stages before it, free memory scrambled before each
    call. Returns ``{stage: [names of outputs that differed]}``; the first stage with a name is
    where the difference starts."""
    import gdn2.torch.triton as kernel
    from gdn2.torch.triton import backward

    B, T, H, K, V = shape
    case = make_case(B, T, H, K, V, seed, log_decay_range=(-20.0, 0.0), reference=False)
    q, k, v, g, b, w = (torch.tensor(case["inputs"][n], dtype=dtype, device=device) for n in "qkvgbw")
    state = torch.tensor(case["inputs"]["initial_state"], dtype=torch.float32, device=device)
    d_o = torch.tensor(case["d_o"], dtype=dtype, device=device)
    d_final = torch.tensor(case["d_final_state"], dtype=torch.float32, device=device)
    scale = K ** -0.5
    precision = kernel._dot_precision(q.device)
    tile = torch.arange(64, device=device) // 16
    block_lower = tile[:, None] >= tile[None, :]  # the tiles of dA and dP the value launch writes

    def numpy(tensors):
        return {name: x.detach().double().cpu().numpy() for name, x in tensors.items()}

    found, outputs = {}, {}

    def stage(name, run):
        kept = []  # the first call's tensors, which feed the later stages

        def call():
            tensors = run()
            if not kept:
                kept.append(tensors)
            return numpy(tensors)

        found[name] = repeated(call, runs, device)[1]
        outputs[name] = kept[0]

    stage("forward", lambda: dict(zip(("o", "final_state") + kernel.SAVED,
                                      kernel._forward(q, k, v, g, b, w, state, scale, None, None))))
    saved = outputs["forward"]

    def reverse():
        d_leaving, d_U = (torch.empty(saved[buffer].shape, device=device, dtype=kernel._gradient_dtype(name, dtype))
                          for name, buffer in (("d_leaving", "states"), ("d_U", "U")))
        d_initial = torch.empty(state.shape, dtype=torch.float32, device=device)
        backward.state_backward(saved["qd"], saved["kd"], saved["Wk"], saved["gamma"], saved["P"], d_o, d_final,
                                d_leaving, d_U, d_initial, scale, precision)
        return dict(d_leaving=d_leaving, d_U=d_U, d_initial=d_initial)

    stage("state_backward", reverse)
    r = outputs["state_backward"]
    stage("contract", lambda: dict(zip(("d_qd", "d_kd", "d_bkd", "d_gamma"), backward.intra_backward_contract(
        saved["states"], saved["U"], d_o, r["d_leaving"], r["d_U"], saved["inverse"], scale, precision))))
    c = outputs["contract"]

    def values():
        dv, dw, d_A, d_P = backward.intra_backward_values(v, w, saved["Wk"], saved["Uw"], saved["Uw_scale"],
                                                          saved["inverse"], saved["U"], d_o, r["d_U"], c["d_bkd"],
                                                          scale, precision)
        return dict(dv=dv, dw=dw, d_A=torch.where(block_lower, d_A, 0.0), d_P=torch.where(block_lower, d_P, 0.0))

    stage("values", values)
    a = outputs["values"]
    # d_qd is overwritten by the keys launch: each call gets its own copy
    stage("keys", lambda: dict(zip(("dq", "dk", "dg", "db"), backward.intra_backward_keys(
        q, k, g, b, c["d_qd"].clone(), c["d_kd"], c["d_bkd"], c["d_gamma"], a["d_A"], a["d_P"], saved["gamma"],
        precision))))
    return found


def launch_repeat_rows(variant, seed, runs=3, device="cuda"):
    """``launch_repeats`` under the launch settings ``variant`` at each of ``LAUNCH_REPEAT_CASES``,
    each row printed as it comes (an exception's message in place of a row's stages)."""
    previous = set_launch(variant)
    try:
        for shape, dtype in LAUNCH_REPEAT_CASES:
            try:
                with no_fallback():
                    found = launch_repeats(shape, dtype, seed, runs, device)
            except Exception as error:  # report, keep going
                found = {"error": f"{type(error).__name__}: {error}"[:300]}
            name = str(dtype).rsplit(".", 1)[-1]
            print(f"launch repeats {variant or 'default'} {shape} {name}: {found}", flush=True)
            yield dict(variant=variant, shape=list(shape), dtype=name, stages=found)
    finally:
        set_launch(previous)


def agreement(variant, shape, seed, device="cuda"):
    """The largest relative difference, over o, the final state and every gradient, between gdn2's
    kernels under ``variant`` and under the default settings, on the same bf16 inputs (random
    initial state and upstream gradients)."""
    B, T, H, K, V = shape
    case = make_case(B, T, H, K, V, seed, log_decay_range=(-20.0, 0.0), reference=False)
    default = torch_gradients(case, "bfloat16", gdn2_kernel, device)
    previous = set_launch(variant)
    try:
        with no_fallback():
            changed = torch_gradients(case, "bfloat16", gdn2_kernel, device)
    finally:
        set_launch(previous)
    return worst_error(changed, default)[2]


def timing_inputs(B, T, H, K, V, dtype, seed=0, device="cuda"):
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape):
        return torch.rand(*shape, device=device, generator=gen)

    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=device, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=device, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, device=device, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, device=device, generator=gen))
    b, w = rand(B, T, H, K), rand(B, T, H, V)
    return [x.to(dtype).requires_grad_() for x in (q, k, v, g, b, w)]


def repeatability(function, shape, runs=3, dtype=torch.bfloat16, device="cuda"):
    """Whether ``runs`` forward+backward passes on the same inputs give bit-identical o and
    gradients (gdn2's kernels use no atomics: a difference is a race, which checks at small shapes
    can miss), and the largest absolute difference from the first run. At the timing shapes: every
    multiprocessor full, as when timed."""
    inputs = timing_inputs(*shape, dtype, seed=1, device=device)
    d_o = torch.randn(inputs[2].shape, generator=torch.Generator(device=device).manual_seed(2), device=device).to(dtype)
    results = []
    for _ in range(runs):
        for x in inputs:
            x.grad = None
        o, _ = function(*inputs)
        o.backward(d_o)
        results.append([o.detach().clone()] + [x.grad.clone() for x in inputs])
    difference = max((a.float() - b.float()).abs().max().item() for later in results[1:] for a, b in zip(results[0], later))
    same = all(torch.equal(a, b) for later in results[1:] for a, b in zip(results[0], later))
    return dict(repeatable=same, repeat_difference=difference)


def bench_ms(fn, rep_ms=400):
    import triton

    return float(triton.testing.do_bench(fn, warmup=100, rep=rep_ms, return_mode="median"))


@contextlib.contextmanager
def no_fallback():
    """A kernel that gives way to the chunk path warns once (a RuntimeWarning): inside this, the
    once-only log is emptied and that warning raises."""
    forget_announcements()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        yield


def time_one(function, shape, dtype=torch.bfloat16, strict=False):
    """Forward and forward+backward median ms and the peak memory of one forward+backward.
    ``strict`` (gdn2's kernel path): a fallback to the chunk path in the warm-up call is an error,
    so that the chunk path's time is never reported as the kernels'."""
    inputs = timing_inputs(*shape, dtype)
    d_o = torch.randn_like(inputs[2])

    def forward():
        with torch.no_grad():
            function(*inputs)

    def forward_backward():
        for x in inputs:
            x.grad = None
        o, _ = function(*inputs)
        o.backward(d_o)

    forward_backward()  # compile / autotune outside the timing
    torch.cuda.synchronize()
    if strict:
        with no_fallback():
            forward_backward()
    fwd = bench_ms(forward)
    fwd_bwd = bench_ms(forward_backward)
    for x in inputs:
        x.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    forward_backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    result = dict(fwd_ms=fwd, fwd_bwd_ms=fwd_bwd, peak_gib=peak / 2**30, peak_over_inputs_gib=(peak - base) / 2**30)
    if strict:  # gdn2's: the same bits in every run at this shape, on the kernels (no fallback)
        del inputs, d_o
        torch.cuda.empty_cache()
        with no_fallback():
            result.update(repeatability(function, shape))
    return result


def profile_one(function, shape, iterations=5, dtype=torch.bfloat16):
    """Per-kernel GPU time (ms per forward+backward) from torch.profiler."""
    inputs = timing_inputs(*shape, dtype)
    d_o = torch.randn_like(inputs[2])

    def step():
        for x in inputs:
            x.grad = None
        o, _ = function(*inputs)
        o.backward(d_o)

    return cuda_kernel_times(step, iterations)


def profile(result, implementations, save, shape):
    result["profile"] = {"shape": list(shape)}
    for name, function in implementations.items():
        try:
            result["profile"][name] = profile_one(function, shape)
        except Exception as error:
            result["profile"][name] = [{"error": f"{type(error).__name__}: {error}"[:300]}]
        print(f"profile {name} {shape} (ms per fwd+bwd):", flush=True)
        for r in result["profile"][name]:
            print("   ", r, flush=True)
        save()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="triton_h200.json")
    parser.add_argument("--no-fla", action="store_true")
    parser.add_argument("--fla-shapes", default="0,1,2", help="timing shapes at which flash-linear-attention runs")
    parser.add_argument("--check-fla", action="store_true", help="also check flash-linear-attention's errors")
    parser.add_argument("--profile", action="store_true",
                        help="per-kernel GPU times at the first timed shape, and of each variant at each timed shape")
    parser.add_argument("--variants", nargs="?", const="all", default=None, metavar="INDICES",
                        help="time and check gdn2 launch-setting variants: all, or these indices into VARIANTS "
                             "(comma separated: one process per risky variant keeps a crash from ending the run)")
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument("--launch-repeats", action="store_true",
                        help="after the checks, find the launches whose bits change between calls (launch_repeats) at "
                             "LAUNCH_REPEAT_CASES, for the default and each of --variants (which are then not timed)")
    parser.add_argument("--recheck", action="store_true",
                        help="after the timing (and flash-linear-attention's autotuning), run gdn2's checks again "
                             "(recheck): results that change with what the process ran before")
    parser.add_argument("--shapes", default="0,1,2", help="indices into the timing shapes")
    parser.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    args = parser.parse_args()
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, seed=args.seed,
                  dot=os.environ.get("GDN2_TRITON_DOT", "tf32"))
    import triton

    result["triton"] = triton.__version__
    implementations = {"gdn2": gdn2_kernel}
    if not args.no_fla:
        import fla

        result["fla"] = fla.__version__
        implementations["fla"] = fla_function()
    fla_shapes = {int(s) for s in args.fla_shapes.split(",") if s}

    def save():
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)

    def checked_errors(name, dtype, label, row, errors_of):
        """The row of one check: ``errors_of()``'s errors (an exception's message instead)."""
        try:
            with no_fallback():  # a fallback is never reported as the kernel's accuracy
                errors = errors_of()
        except Exception as error:  # report, keep going
            errors = {"error": f"{type(error).__name__}: {error}"[:300]}
        unrepeatable = errors.pop("unrepeatable", None)
        worst = max((v for v in errors.values() if isinstance(v, float)), default=math.inf)
        row = dict(impl=name, dtype=str(dtype).rsplit(".", 1)[-1], **row, errors=errors, worst=worst,
                   unrepeatable=unrepeatable)
        repeats = "" if unrepeatable is None else (
            f", {CHECK_RUNS} runs the same bits" if not unrepeatable else f", NOT REPEATABLE: {', '.join(unrepeatable)}")
        print(f"check {name:5s} {row['dtype']:9s} {label}: o {errors.get('o', math.nan):.2e} "
              f"worst {worst:.2e} ({max(errors, key=lambda n: errors[n] if isinstance(errors[n], float) else 0)})"
              f"{repeats}", flush=True)
        return row

    def checked(name, function, dtype, index):
        shape = CHECK_SHAPES[index]
        return checked_errors(name, dtype, f"{shape[:5]} g{shape[5]}", dict(shape=list(shape[:5]), log_decay=list(shape[5])),
                              lambda: check(function, shape, dtype, args.seed + index,
                                            runs=CHECK_RUNS if name == "gdn2" else 1))

    def checked_packed(dtype, index):
        lengths, H, K, V = PACKED_CHECK_SHAPES[index]
        return checked_errors("gdn2", dtype, f"packed {lengths} H={H} K={K} V={V} g(-20.0, 0.0)",
                              dict(packed=lengths, shape=[1, sum(lengths), H, K, V], log_decay=[-20.0, 0.0]),
                              lambda: check_packed(lengths, H, K, V, dtype, args.seed + 100 + index, runs=CHECK_RUNS))

    probe = [torch.zeros(1, 1, 1, 8, device="cuda")] * 6
    result["path"] = str(which_path(*probe, path="kernel"))
    print("gdn2 path:", result["path"], flush=True)

    def run_checks(key, checked_implementations):
        """Every check of ``checked_implementations`` into ``result[key]``."""
        result[key] = []
        for name, function in checked_implementations.items():
            for dtype in (torch.float32, torch.bfloat16):
                for index in range(len(CHECK_SHAPES)):
                    if name == "fla" and index > 1:
                        continue  # both at the two small shapes (and strong decay); gdn2 also at the others
                    result[key].append(checked(name, function, dtype, index))
                    save()
                if name == "gdn2":
                    for index in range(len(PACKED_CHECK_SHAPES)):
                        result[key].append(checked_packed(dtype, index))
                        save()

    if not args.no_check:
        run_checks("check", {name: f for name, f in implementations.items() if name == "gdn2" or args.check_fla})

    chosen = [] if not args.variants else (
        VARIANTS if args.variants == "all" else [VARIANTS[int(i)] for i in args.variants.split(",")])
    if args.launch_repeats:
        result["launch_repeats"] = []
        for variant in [{}] + chosen:
            for row in launch_repeat_rows(variant, args.seed + 300):
                result["launch_repeats"].append(row)
                save()
        chosen = []

    result["timing"] = []
    for index in (int(s) for s in args.shapes.split(",") if s):
        shape = TIMING_SHAPES[index]
        row = dict(shape=list(shape))
        for name, function in implementations.items():
            if name == "fla" and index not in fla_shapes:
                continue
            start = time.time()
            try:
                row[name] = time_one(function, shape, strict=name == "gdn2")
            except Exception as error:
                row[name] = {"error": f"{type(error).__name__}: {error}"[:300]}
            print(f"time {name:5s} {shape}: {row[name]} ({time.time() - start:.0f} s)", flush=True)
            if name == "fla":
                row["fla_state_pass_configs"] = fla_state_pass_configs()
                print("fla's state passes chose", row["fla_state_pass_configs"], flush=True)
            torch.cuda.empty_cache()
        if "fla" in row and "fwd_ms" in row.get("fla", {}) and "fwd_ms" in row["gdn2"]:
            row["ratio"] = {key: row["gdn2"][key] / row["fla"][key] for key in ("fwd_ms", "fwd_bwd_ms", "peak_gib")}
        result["timing"].append(row)
        save()
        if args.profile and "profile" not in result:
            profile(result, {name: f for name, f in implementations.items() if name == "gdn2" or index in fla_shapes},
                    save, shape)

    if args.recheck:
        print("gdn2's checks again, after the timing:", flush=True)
        run_checks("recheck", {"gdn2": gdn2_kernel})

    if chosen:
        timed = [int(s) for s in args.shapes.split(",") if s] or [0]
        result["variants"] = []
        for variant in chosen:
            previous = None
            try:
                checks = {}
                for index, shape in enumerate(AGREEMENT_SHAPES):  # the same results as the default
                    differences = agreement(variant, shape, args.seed + 200 + index)
                    checks[f"agreement_{index}"] = max(differences.values())
                    print(f"variant {variant} against the default at {shape}, bf16: "
                          + " ".join(f"{n} {e:.1e}" for n, e in differences.items()), flush=True)
                previous = set_launch(variant)
                for dtype in (torch.float32, torch.bfloat16):  # and right against the spec
                    checks[f"worst_{str(dtype).rsplit('.', 1)[-1]}"] = checked("gdn2", gdn2_kernel, dtype, 1)["worst"]
                for index in timed:
                    shape = TIMING_SHAPES[index]
                    timing = dict(time_one(gdn2_kernel, shape, strict=True), **checks)
                    if args.profile:  # the variant's own launches, ms per forward+backward
                        timing["profile"] = profile_one(gdn2_kernel, shape)
                    result["variants"].append(dict(variant=variant, shape=list(shape), **timing))
                    print("variant", variant, shape, timing, flush=True)
                    save()
            except Exception as error:
                result["variants"].append(dict(variant=variant, error=f"{type(error).__name__}: {error}"[:300]))
                print("variant", variant, result["variants"][-1]["error"], flush=True)
                save()
            if previous is not None:
                set_launch(previous)

    print("\n| shape B,T,H,K=V | gdn2 fwd ms | fla fwd ms | ratio | gdn2 fwd+bwd ms | fla fwd+bwd ms | ratio "
          "| gdn2 peak GiB | fla peak GiB | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in result["timing"]:
        gd, fl, ra = row.get("gdn2", {}), row.get("fla", {}), row.get("ratio", {})

        def f(d, key, digits=3):
            return f"{d[key]:.{digits}f}" if key in d else "-"

        print(f"| {','.join(map(str, row['shape'][:4]))} | {f(gd, 'fwd_ms')} | {f(fl, 'fwd_ms')} | {f(ra, 'fwd_ms', 2)} "
              f"| {f(gd, 'fwd_bwd_ms')} | {f(fl, 'fwd_bwd_ms')} | {f(ra, 'fwd_bwd_ms', 2)} "
              f"| {f(gd, 'peak_gib', 2)} | {f(fl, 'peak_gib', 2)} | {f(ra, 'peak_gib', 2)} |")
    save()


if __name__ == "__main__":
    main()
