"""Counted cost of the Metal kernels (FLOP, bytes, launches) and an ESTIMATED time on an Apple GPU.

Everything here is counted from the kernels' loops, not measured: no Mac was available. The time
model is ``sum over kernels of max(FLOP / (peak * efficiency), bytes / bandwidth) + launches *
overhead``, with the efficiencies below as assumptions (``bench/ops.py --framework mlx`` on a Mac
measures the real numbers). It serves two purposes: the cost lines in the kernel modules'
docstrings and ``bench/RESULTS.md``, and the automatic choice between the scan and the chunked
kernels (``choose``), which only needs the model to rank the two.

FLOP counts a multiply-add as 2. Bytes count each array once per kernel that reads or writes it
(re-reads by other threadgroups are assumed to hit the GPU caches).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GPU", "M3_MAX", "Cost", "scan_cost", "chunked_cost", "estimate_seconds", "choose"]


@dataclass(frozen=True)
class GPU:
    name: str
    fp32_flops: float  # peak, FMA counted as 2
    bandwidth: float  # bytes / s
    launch_seconds: float = 10e-6
    matrix_efficiency: float = 0.5  # 8x8 simdgroup_matrix products (assumed)
    scalar_efficiency: float = 0.5  # plain FMA and exp code with barriers (assumed)
    scan_efficiency: float = 0.22  # the scan: two simd_sum (~14 cycles) per column and step
    scan_step_seconds: float = 0.1e-6  # latency of one scan step (two simd_sum, FMA chain, staging)
    chunk_step_seconds: float = 3e-6  # latency of one chunk in the sequential chunked kernels


M3_MAX = GPU("M3 Max (40-core GPU)", 14.2e12, 400e9)


@dataclass
class Cost:
    """One kernel launch: FLOP on matrix tiles, scalar FLOP, device bytes."""

    name: str
    matrix_flop: float = 0.0
    scalar_flop: float = 0.0
    bytes: float = 0.0
    scan_flop: float = 0.0  # FLOP of the per-column scan (its own efficiency)
    scan_steps: int = 0  # sequential scan steps of one threadgroup
    chunk_steps: int = 0  # sequential chunks of one threadgroup


def _round8(x: int) -> int:
    return -(-x // 8) * 8


def scan_cost(B: int, T: int, H: int, K: int, V: int, itemsize: int = 2, backward: bool = True,
              interval: int = 64) -> list[Cost]:
    """The scan: forward 3 multiply-adds per state element and step (erase read, update, output
    read); the vjp reruns it with checkpoints, then per chunk of C = ``interval`` steps and value
    tile replays (2 multiply-adds a step) up to the last segment's start, storing the start
    states of the segments between, replays each segment's first R - 1 steps again into
    registers and applies the adjoint walking back (about 10)."""
    tokens = B * T * H
    inputs = tokens * (4 * K + 2 * V) * itemsize
    forward = Cost("scan forward", scan_flop=6.0 * K * V * tokens, bytes=inputs + tokens * V * itemsize, scan_steps=T)
    costs = [forward]
    if backward:
        from .scan import backward_geometry  # the kernel's tile and segment length

        geometry = backward_geometry(K, V)
        segments = -(-interval // geometry.segment)
        replayed = ((segments - 1) * geometry.segment + interval - segments) / interval  # replay steps per step
        stored = max(0, segments - 2) / interval  # segment start states written and read back per step
        checkpoints = B * H * -(-T // interval) * K * V * 4
        costs.append(Cost("scan forward (checkpoints)", scan_flop=forward.scan_flop,
                          bytes=forward.bytes + checkpoints, scan_steps=T))
        costs.append(Cost("scan backward", scan_flop=(20.0 + 4.0 * replayed) * K * V * tokens,
                          bytes=inputs + tokens * V * itemsize * 3 + tokens * K * itemsize * 4 + checkpoints
                          + 8.0 * K * V * tokens * stored,
                          scan_steps=round(T * (1 + replayed)) * -(-V // geometry.tile)))  # tile after tile
    return costs


def chunked_cost(B: int, T: int, H: int, K: int, V: int, itemsize: int = 2, backward: bool = True,
                 chunk: int = 32, value_tile: int = 32) -> list[Cost]:
    """The chunked kernels, per chunk and head (C = chunk, Kp, Vp rounded up to 8; the
    sequential kernels cover Vt = value tiles * value_tile columns and redo the key-side staging
    per value tile)."""
    C, NT = chunk, chunk // 8
    Kp, Vp = _round8(K), _round8(V)
    tiles = -(-Vp // value_tile)
    Vt = tiles * value_tile
    heads, N = B * H, -(-T // C)
    chunks = heads * N
    pairs, right_rows = NT * (NT - 1) // 2, 4 * NT * (NT - 1)
    key_in = C * Kp * 4 * itemsize  # q, k, g, b of one chunk
    value_in = C * Vp * 2 * itemsize  # v, w
    matrices = 2 * C * C * 4  # P and the inverse
    intra = Cost(
        "chunk INTRA",
        matrix_flop=chunks * (2 * pairs * 64 * Kp * 2 + NT * 64 * 8 * 2),  # A, P tiles; the inverse's rounds
        scalar_flop=chunks * (NT * 36 * Kp * 8 + Kp * (C + right_rows) * 4 + NT * 8 * 28 * 2),
        bytes=chunks * (key_in + matrices),
    )
    staging = 2 * tiles * C * Kp * 8  # per chunk: two stagings per value tile, ~8 FLOP per element
    sequential_matrix = 2 * (3 * C * Kp * Vt + C * C * Vt)
    forward = Cost("chunk FORWARD", matrix_flop=chunks * sequential_matrix, scalar_flop=chunks * staging,
                   bytes=chunks * (key_in + matrices + value_in + C * Vp * itemsize), chunk_steps=N)
    costs = [intra, forward]
    if not backward:
        return costs
    states = Kp * Vp * 4  # one state per chunk
    costs.append(Cost("chunk INTRA (backward)", intra.matrix_flop, intra.scalar_flop, intra.bytes))
    costs.append(Cost("chunk FORWARD (saving states, U)", forward.matrix_flop, forward.scalar_flop,
                      forward.bytes + chunks * (states + C * Vp * 4), chunk_steps=N))
    costs.append(Cost("chunk STATE_BACKWARD", matrix_flop=chunks * sequential_matrix, scalar_flop=chunks * staging,
                      bytes=chunks * (key_in + matrices + value_in + C * Vp * itemsize * 3 + states + C * Vp * 4),
                      chunk_steps=N))
    costs.append(Cost(
        "chunk BACKWARD",
        matrix_flop=chunks * 2 * (2 * NT * (NT + 1) // 2 * 64 * Vp  # dP, dA
                                  + 3 * C * Kp * Vp  # d(q e^G), d(b k e^G), d(k e^{G_last - G})
                                  + 24 * 64 * Kp),  # the pair adjoints' off-diagonal tiles
        scalar_flop=chunks * (C * Kp * (2 * 8 * 6 + 40) + Kp * (2 * NT + 2) * C * 2 + Kp * Vp * 2),
        bytes=chunks * (key_in + C * Vp * itemsize + 2 * states + 2 * C * Vp * 4 + C * Kp * 4 * itemsize),
    ))
    return costs


def estimate_seconds(costs: list[Cost], gpu: GPU = M3_MAX) -> float:
    """ESTIMATED time of a list of launches on ``gpu`` (see the module docstring)."""
    total = 0.0
    for cost in costs:
        compute = (cost.matrix_flop / (gpu.fp32_flops * gpu.matrix_efficiency)
                   + cost.scalar_flop / (gpu.fp32_flops * gpu.scalar_efficiency)
                   + cost.scan_flop / (gpu.fp32_flops * gpu.scan_efficiency))
        chain = cost.scan_steps * gpu.scan_step_seconds + cost.chunk_steps * gpu.chunk_step_seconds
        total += max(compute, cost.bytes / gpu.bandwidth, chain) + gpu.launch_seconds
    return total


def choose(B: int, T: int, H: int, K: int, V: int, itemsize: int = 2, gpu: GPU = M3_MAX,
           memory_budget: float | None = None, chunked_memory: float = 0.0, scan_memory: float = 0.0):
    """("scan" or "chunked", reason): decode (T == 1) runs the scan; otherwise the lower estimated
    forward+backward time, unless the chunked kernels' training buffers exceed ``memory_budget``
    where the scan's do not."""
    if T == 1:
        return "scan", "decode (T == 1)"
    scan_time = estimate_seconds(scan_cost(B, T, H, K, V, itemsize), gpu)
    chunked_time = estimate_seconds(chunked_cost(B, T, H, K, V, itemsize), gpu)
    if memory_budget is not None and chunked_memory > memory_budget >= scan_memory:
        return "scan", (f"the chunked kernels' training buffers ({chunked_memory / 2**30:.1f} GiB) exceed the "
                        f"memory budget ({memory_budget / 2**30:.1f} GiB)")
    estimate = f"estimated fwd+bwd {chunked_time * 1e3:.3g} ms chunked vs {scan_time * 1e3:.3g} ms scan on an {gpu.name}"
    if chunked_time <= scan_time:
        return "chunked", estimate
    return "scan", estimate
