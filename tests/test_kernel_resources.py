"""``bench/kernel_resources.py --instructions``: SASS instruction counts of kernels compiled for
sm_90a without a GPU. The compiling runs in a subprocess without ``TRITON_INTERPRET`` (conftest.py
sets it for this process, and ``triton.jit`` then makes interpreted functions that cannot be
compiled)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from bench_scripts import load_bench

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "bench" / "kernel_resources.py"


def _compiled_mode_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def _tool_module():
    return load_bench("kernel_resources", "kernel_resources_under_test")


def _run_script(tmp_path, name: str, template: str) -> str:
    """Run ``template`` (formatted with the bench folder) as a script of its own, compiled mode;
    its standard output. ``triton.jit`` reads a function's source from its file."""
    script = tmp_path / name
    script.write_text(template.format(bench=str(ROOT / "bench")))
    run = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=_compiled_mode_env(), capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


# A made-up disassembly: a backward branch closes a loop of three instructions; the branch to
# itself after EXIT is the kernel's end, not a loop.
SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
.L_x_0:
        /*0020*/                   FFMA R2, R0, R0, R2 ;
        /*0030*/               @P0 LDG.E R3, desc[UR4][R4.64] ;
        /*0040*/               @P1 BRA `(.L_x_0) ;
        /*0050*/                   MUFU.EX2 R2, R2 ;
        /*0060*/                   HMMA.16816.F32.BF16 R8, R12, R16, R8 ;
        /*0070*/                   STG.E [R4.64], R2 ;
        /*0080*/                   EXIT ;
.L_x_1:
        /*0090*/                   BRA `(.L_x_1);
"""


def test_parse_sass_classes_loops_and_dynamic_estimate():
    tool = _tool_module()
    parsed = tool.parse_sass(SASS)
    assert parsed.opcodes == ["MOV", "S2R", "FFMA", "LDG", "BRA", "MUFU", "HMMA", "STG", "EXIT", "BRA"]
    assert parsed.loops == [(2, 4)]
    counts = tool.count_classes(parsed.opcodes)
    assert (counts["MMA"], counts["FP32"], counts["MUFU"], counts["LDG"], counts["STG"]) == (1, 1, 1, 1, 1)
    assert counts["CONTROL"] == 3 and counts["MOVE"] == 2
    assert tool.dynamic_estimate(parsed, [10]) == 7 + 3 * 10
    assert tool.dynamic_estimate(parsed, []) == 10  # a loop without a trip count counts once
    assert tool.dynamic_classes(parsed, [10])["FP32"] == 10


SMALL_KERNEL = textwrap.dedent("""
    import sys
    sys.path.insert(0, {bench!r})
    import triton
    import triton.language as tl
    import kernel_resources as tool

    @triton.jit
    def scaled_sum(x, y, n, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        total = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, n, BLOCK):
            total += tl.exp(tl.load(x + start + offsets, mask=start + offsets < n, other=0.0))
        tl.store(y + offsets, total)

    compiled = tool.build(scaled_sum, dict(x="fp32", y="fp32"), {{}}, dict(BLOCK=128), 4, disassemble=True)
    parsed = tool.parse_sass(compiled.sass)
    counts = tool.count_classes(parsed.opcodes)
    print("instructions", len(parsed.opcodes), "loops", len(parsed.loops), "MUFU", counts["MUFU"],
          "LDG", counts["LDG"], "STG", counts["STG"])
    print("dynamic", tool.dynamic_estimate(parsed, [8]), tool.dynamic_estimate(parsed, [1]))
    print(tool.instruction_report(compiled.sass, [8], 4, programs=10))
""")


def test_small_kernel_compiles_and_counts(tmp_path):
    """One small kernel with a loop, compiled and disassembled: positive counts, one loop, and a
    dynamic estimate that grows with the loop's trip count."""
    out = _run_script(tmp_path, "small_kernel.py", SMALL_KERNEL)
    m = re.search(r"instructions (\d+) loops (\d+) MUFU (\d+) LDG (\d+) STG (\d+)", out)
    assert m, out
    instructions, loops, mufu, ldg, stg = map(int, m.groups())
    assert instructions > 0 and mufu > 0 and ldg > 0 and stg > 0
    assert loops >= 1
    dynamic = re.search(r"dynamic ([\d.]+) ([\d.]+)", out)
    assert float(dynamic.group(1)) > float(dynamic.group(2)) >= instructions
    assert "dynamic per launch: 10 programs" in out


def test_instructions_option_runs():
    """The command line with ``--instructions`` on two kernels of the operator."""
    run = subprocess.run([sys.executable, str(TOOL), "--K", "64", "--V", "64", "--instructions",
                          "--only", "intra_backward_keys", "gate_gradient"],
                         cwd=ROOT, env=_compiled_mode_env(), capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert "failed" not in out, out
    for name in ("intra_backward_keys", "gate_gradient"):
        assert re.search(rf"^{name}\s+\d+ warps, shared .* registers, .*occupancy", out, re.M), out
    counts = [int(n) for n in re.findall(r"SASS (\d+) instructions", out)]
    assert len(counts) == 2 and min(counts) > 0, out
    mma = re.search(r"SASS \d+ instructions: MMA (\d+)", out)  # the key launch multiplies on tensor cores
    assert mma and int(mma.group(1)) > 0, out
    assert re.search(r"loop 2 .*trips 16", out), out
    assert re.search(r"dynamic per launch: [\d,]+ programs", out), out


@pytest.mark.parametrize("kernel, dtype, heads, guard", [
    ("state_backward", "bfloat16", "4", "STATE_BACKWARD_ROUNDED_STAGES_SHARED"),  # two chunks ahead
    ("state_forward", "float32", "128", "STATE_WIDE_BLOCK_SHARED"),  # value blocks of 64 columns
])
def test_state_passes_fit_a_99_kib_gpu_only_with_their_guards(kernel, dtype, heads, guard):
    """Compiled for sm_89 (RTX 4090, L40: 99 KiB of shared memory a block) at K = V = 128, each
    sequential pass takes the form its guard chooses there and fits; with the guard off (the
    H100's form on any device) it does not, so that its launch there would fail with
    OutOfResources."""
    def compile_for_sm89(*variant):
        run = subprocess.run([sys.executable, str(TOOL), "--arch", "89", "--K", "128", "--V", "128", "--B", "1", "--H",
                              heads, "--dtype", dtype, "--only", kernel, *variant], cwd=ROOT,
                             env=_compiled_mode_env(), capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        return run.stdout

    guarded = compile_for_sm89()
    assert re.search(rf"^{kernel} .* fits sm_89's 99\.0 KiB a block$", guarded, re.M), guarded
    unguarded = compile_for_sm89("--variant", f"{guard}=0")
    assert re.search(rf"^{kernel} .* DOES NOT FIT sm_89's 99\.0 KiB a block$", unguarded, re.M), unguarded


def test_interpreter_refused():
    env = _compiled_mode_env()
    env["TRITON_INTERPRET"] = "1"
    run = subprocess.run([sys.executable, str(TOOL), "--only", "gate_gradient"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "TRITON_INTERPRET is set" in run.stderr


def test_every_h200_variant_names_launch_constants(monkeypatch):
    """Each of ``bench/triton_h200.py``'s ``VARIANTS`` sets launch constants that exist (a
    misspelt name would fail on the GPU, after the machine's start-up), and setting them back
    restores the defaults."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    bench = load_bench("triton_h200", "triton_h200_under_test")
    tool = _tool_module()
    from gdn2.torch.triton import forward

    defaults = dict(vars(forward))
    assert bench.VARIANTS
    for variant in bench.VARIANTS:
        previous = tool.set_launch(variant)
        assert set(previous) == set(variant)
        tool.set_launch(previous)
    assert all(vars(forward)[name] is value for name, value in defaults.items() if name.isupper())
    with pytest.raises(ValueError, match="NO_SUCH_CONSTANT"):
        tool.set_launch({"NO_SUCH_CONSTANT": 1})


def test_fla_option_needs_fla():
    """``--fla`` (flash-linear-attention's reverse state pass, for comparison) says what it needs
    when fla is not importable."""
    try:
        import fla  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("flash-linear-attention is installed here: --fla would compile its kernel instead")
    run = subprocess.run([sys.executable, str(TOOL), "--fla"], cwd=ROOT, env=_compiled_mode_env(),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "--fla needs flash-linear-attention 0.6.0 importable" in run.stderr, run.stderr


def test_fla_state_pass_configs_read_the_autotuners_choice(monkeypatch):
    """``bench/triton_h200.py`` reports the configuration fla's autotuner chose for each state
    pass: found under its wrappers (``fn``), None before it ran."""
    import types

    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    bench = load_bench("triton_h200", "triton_h200_under_test")
    tuned = types.SimpleNamespace(best_config="BV: 32, num_warps: 4", fn=None)
    untuned = types.SimpleNamespace(best_config=None, fn=types.SimpleNamespace(fn=None))
    module = types.ModuleType("fla.ops.common.chunk_delta_h")
    module.chunk_gated_delta_rule_fwd_kernel_h_blockdim64 = untuned
    module.chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64 = types.SimpleNamespace(fn=tuned)  # a heuristics wrapper
    names = ("fla", "fla.ops", "fla.ops.common")
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setattr(sys.modules["fla.ops.common"], "chunk_delta_h", module, raising=False)
    monkeypatch.setitem(sys.modules, "fla.ops.common.chunk_delta_h", module)
    assert bench.fla_state_pass_configs() == {"chunk_gated_delta_rule_fwd_kernel_h_blockdim64": None,
                                              "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64": "BV: 32, num_warps: 4"}


def test_stores_after_a_warpgroup_wait_are_counted():
    """``stores_after_wait`` counts a shared-memory store after ``wgmma.wait_group`` with no
    barrier between (the store a second warpgroup's products may still read under), and not one
    after a barrier."""
    tool = _tool_module()
    racy = """
        wgmma.mma_async.sync.aligned.m64n32k8.f32.tf32.tf32 {%r1}, %rd1, %rd2, 1, 1, 1;
        wgmma.commit_group.sync.aligned;
        wgmma.wait_group.sync.aligned 0;
        ld.shared.v2.b32 {%r2, %r3}, [%r4+73728];
        st.shared.v2.b32 [%r5+98304], {%r2, %r3};
        st.shared.v2.b32 [%r5+98560], {%r2, %r3};
    """
    assert tool.stores_after_wait(racy) == 1
    assert tool.stores_after_wait(racy.replace("ld.shared", "bar.sync 0;\n        ld.shared")) == 0
    assert tool.stores_after_wait("st.shared.v2.b32 [%r5], {%r2, %r3};") == 0  # no wait before it


def test_ptx_probe_adds_one_fence_before_each_unfenced_wgmma():
    """``bench/ptx_probe.py``'s ``add_fences``: a proxy fence before each ``wgmma.fence`` that has
    none just before it (comments between count as nothing), none added twice."""
    from bench_scripts import load_bench

    probe = load_bench("ptx_probe")
    ptx = """
	cp.async.wait_group 	5;
	bar.sync 	0;
	wgmma.fence.sync.aligned;
	wgmma.commit_group.sync.aligned;
	fence.proxy.async.shared::cta;
	// a comment
	wgmma.fence.sync.aligned;
	wgmma.wait_group.sync.aligned 0;
	wgmma.fence.sync.aligned;
"""
    fenced, added = probe.add_fences(ptx)
    assert added == 2
    lines = [line.strip() for line in fenced.splitlines() if line.strip()]
    assert lines.count("fence.proxy.async.shared::cta;") == 3
    for index, line in enumerate(lines):
        if line == "wgmma.fence.sync.aligned;":
            previous = [x for x in lines[:index] if not x.startswith("//")][-1]
            assert previous == "fence.proxy.async.shared::cta;"
    assert probe.add_fences(fenced) == (fenced, 0)


# A pipelined loop as Triton's GPU IR has it (trimmed): B's buffer is read by an asynchronous
# product that the wait leaves in flight, and the copy of the step two ahead goes into B's slot
# ``(insert + 1) mod depth``; with two slots that is the slot being read, with three it is not.
PIPELINED_LOOP = """
    %c0_i32 = arith.constant 0 : i32 loc(#loc1)
    %c1_i32 = arith.constant 1 : i32 loc(#loc1)
    %c-1_i32 = arith.constant -1 : i32 loc(#loc1)
    %c{depth}_i32 = arith.constant {depth} : i32 loc(#loc1)
    %c64_i32 = arith.constant 64 : i32 loc(#loc1)
    %c16_i32 = arith.constant 16 : i32 loc(#loc1)
    %A_1 = ttg.local_alloc : () -> !ttg.memdesc<3x64x16xbf16, #shared, #smem, mutable> loc(#loc2)
    %B_2 = ttg.local_alloc : () -> !ttg.memdesc<{depth}x16x16xbf16, #shared, #smem, mutable> loc(#loc3)
    %acc:4 = scf.for %i = %c0_i32 to %c64_i32 step %c16_i32 iter_args(%acc_3 = %cst, %extract = %c-1_i32, %insert = %c1_i32, %x = %cst_0) -> (tensor<64x16xf32, #mma>, i32, i32, tensor<16xf32>)  : i32 {{
      %e_4 = arith.addi %extract, %c1_i32 : i32 loc(#loc4)
      %e_5 = arith.cmpi sge, %e_4, %c{depth}_i32 : i32 loc(#loc4)
      %e_6 = arith.select %e_5, %c0_i32, %e_4 : i32 loc(#loc4)
      %A_7 = ttg.memdesc_index %A_1[%e_6] : !ttg.memdesc<3x64x16xbf16, #shared, #smem, mutable> -> !ttg.memdesc<64x16xbf16, #shared, #smem, mutable> loc(#loc2)
      %B_8 = ttg.memdesc_index %B_2[%e_6] : !ttg.memdesc<{depth}x16x16xbf16, #shared, #smem, mutable> -> !ttg.memdesc<16x16xbf16, #shared, #smem, mutable> loc(#loc3)
      %B_9 = ttg.memdesc_trans %B_8 {{order = array<i32: 1, 0>}} : !ttg.memdesc<16x16xbf16, #shared, #smem, mutable> -> !ttg.memdesc<16x16xbf16, #shared1, #smem, mutable> loc(#loc3)
      %acc_10 = ttng.warp_group_dot %A_7, %B_9, %acc_3 {{inputPrecision = 0 : i32, isAsync = true}} : !ttg.memdesc<64x16xbf16, #shared, #smem, mutable> * !ttg.memdesc<16x16xbf16, #shared1, #smem, mutable> -> tensor<64x16xf32, #mma> loc(#loc5)
      %acc_11:3 = ttng.warp_group_dot_wait %acc_10, %A_7, %B_9 {{pendings = {pendings} : i32}} : tensor<64x16xf32, #mma>, !ttg.memdesc<64x16xbf16, #shared, #smem, mutable>, !ttg.memdesc<16x16xbf16, #shared1, #smem, mutable> loc(#loc5)
      %r = "tt.reduce"(%y) <{{axis = 1 : i32}}> ({{
      ^bb0(%p: f32 loc(#loc1), %q: f32 loc(#loc1)):
        %s = arith.addf %p, %q : f32 loc(#loc1)
        tt.reduce.return %s : f32 loc(#loc1)
      }}) : (tensor<16x16xf32>) -> tensor<16xf32> loc(#loc6)
      %n_12 = arith.addi %insert, %c1_i32 : i32 loc(#loc4)
      %n_13 = arith.cmpi sge, %n_12, %c{depth}_i32 : i32 loc(#loc4)
      %n_14 = arith.select %n_13, %c0_i32, %n_12 : i32 loc(#loc4)
      %B_15 = ttg.memdesc_index %B_2[%n_14] : !ttg.memdesc<{depth}x16x16xbf16, #shared, #smem, mutable> -> !ttg.memdesc<16x16xbf16, #shared, #smem, mutable> loc(#loc3)
      %B_16 = ttg.async_copy_global_to_local %ptr, %B_15 mask %m other %cst_1 : tensor<16x16x!tt.ptr<bf16>> -> <16x16xbf16, #shared, #smem, mutable> loc(#loc3)
      %B_17 = ttg.async_commit_group tokens %B_16 loc(#loc3)
      scf.yield %acc_11#0, %e_6, %n_14, %r : tensor<64x16xf32, #mma>, i32, i32, tensor<16xf32> loc(#loc7)
    }} {{tt.num_stages = 3 : i32}} loc(#loc7)
"""


@pytest.mark.parametrize("depth, pendings, overwritten", [(2, 1, ["B"]), (3, 1, []), (2, 0, [])])
def test_overwritten_while_read_follows_the_slots(depth, pendings, overwritten):
    """The copy two steps ahead lands in the slot the product in flight reads with two slots, not
    with three, and not once the wait leaves no product in flight."""
    tool = _tool_module()
    assert tool.overwritten_while_read(PIPELINED_LOOP.format(depth=depth, pendings=pendings)) == overwritten


DOT_AND_SUM = textwrap.dedent("""
    import re
    import sys
    sys.path.insert(0, {bench!r})
    import triton
    import triton.language as tl
    import kernel_resources as tool

    @triton.jit
    def dot_and_sum(a, b, out, sums, n):
        rows = tl.arange(0, 64)
        cols = tl.arange(0, 32)
        acc = tl.zeros((64, 32), dtype=tl.float32)
        total = tl.zeros((32,), dtype=tl.float32)
        for start in tl.range(0, n, 32, num_stages=3):
            a_tile = tl.load(a + rows[:, None] * n + start + cols[None, :])
            b_tile = tl.load(b + (start + cols[:, None]) * 32 + cols[None, :])
            acc = tl.dot(a_tile, b_tile, acc)
            total += tl.sum(b_tile.to(tl.float32), 0)  # registers read B's buffer too
        tl.store(out + rows[:, None] * 32 + cols[None, :], acc)
        tl.store(sums + cols, total)

    compiled = tool.build(dot_and_sum, dict(a="bf16", b="bf16", out="fp32", sums="fp32"), {{}}, {{}}, 4,
                          sizes=("n",))
    depth = re.search(r"%b_tile\\w* = ttg.local_alloc : \\(\\) -> !ttg.memdesc<(\\d+)x", compiled.ttgir)
    print("depth", depth.group(1) if depth else None, "overwritten", tool.overwritten_while_read(compiled.ttgir))
""")


def test_overwritten_while_read_on_the_compilers_own_loop(tmp_path):
    """A loop whose loaded tile both an asynchronous product and registers read, compiled by the
    installed Triton for sm_90a: the check names that tile exactly when Triton gave it fewer
    slots than the loop's three stages (Triton 3.6 to 3.9 give it two)."""
    out = _run_script(tmp_path, "dot_and_sum.py", DOT_AND_SUM)
    m = re.search(r"depth (\d+) overwritten (\[.*\])", out)
    assert m, out
    assert (m.group(2) == "['b_tile']") == (int(m.group(1)) < 3), out


@pytest.mark.parametrize("dtype, size, variant", [
    ("bfloat16", "128", ()),
    ("bfloat16", "64", ("GRADIENTS_IN_BFLOAT16=('d_leaving','d_U')",)),
    ("float32", "64", ("CONTRACT_FLOAT32_STAGES=3",)),
])
def test_no_launch_overwrites_what_its_products_read(dtype, size, variant):
    """Every kernel compiled for sm_90a: no loop copies into a slot that an asynchronous product
    still reads (the contraction did, with d_U in bfloat16 or float32 inputs at more than one
    stage, before gamma's gradient had loads of its own)."""
    run = subprocess.run([sys.executable, str(TOOL), "--K", size, "--V", size, "--dtype", dtype,
                          *(("--variant", *variant) if variant else ())],
                         cwd=ROOT, env=_compiled_mode_env(), capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "failed" not in run.stdout and "RACE" not in run.stdout, run.stdout
    assert run.stdout.count(" warps, shared ") >= 11, run.stdout
