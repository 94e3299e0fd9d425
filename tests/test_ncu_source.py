"""bench/ncu_source.py on a small file in the layout of Nsight Compute's SASS source page."""

import pytest
from bench_scripts import load_bench

HEADER = ('"Address","Source","Instructions Executed","Warp Stall Sampling (All Samples)",'
          '"Warp Stall Sampling (Not-issued Samples)","stall_long_sb","stall_long_sb (Not Issued)","stall_wait"')
ROWS = [
    '"0x10","LDC R1, c[0x0][0x28]","8","0","0","0","0","0"',
    '"0x20","@P0 LDG.E.64 R4, desc[UR4][R2.64]","1,024","10","10","2","2","8"',
    '"0x30","FMUL R6, R4, R5","1024","70","60","63","55","7"',
    '"0x40","HMMA.16816.F32 R8, R4, R6, R8","512","20","5","-","-","20"',
    '"0x50","EXIT","8","0","0","0","0","0"',
]


@pytest.fixture
def ncu_source():
    return load_bench("ncu_source")


def test_report_of_a_small_source_page(ncu_source, tmp_path):
    path = tmp_path / "sass.csv"
    path.write_text("==PROF== Connected to process 1\n" + HEADER + "\n" + "\n".join(ROWS) + "\n")
    reasons, instructions = ncu_source.read(str(path))
    assert reasons == ["stall_long_sb", "stall_wait"]
    assert [ncu_source.opcode(entry["Source"]) for entry in instructions] == ["LDC", "LDG", "FMUL", "HMMA", "EXIT"]
    assert instructions[1]["Instructions Executed"] == 1024.0 and instructions[3]["stall_long_sb"] == 0.0
    text = ncu_source.report(reasons, instructions, window=2, top=2)
    lines = text.splitlines()
    assert lines[0] == "5 instructions, 100 samples, 2576 warp instructions executed"
    assert lines[1].split() == ["stall_long_sb", "65.0%"] and lines[2].split() == ["stall_wait", "35.0%"]
    window_lines = lines[lines.index("by window of 2 instructions (share of samples, executed, commonest opcodes):") + 1:][:3]
    assert [line.split()[:3] for line in window_lines] == [["[", "0]", "10.0%"], ["[", "2]", "90.0%"], ["[", "4]", "0.0%"]]
    assert "70.0%" in lines[-2] and "FMUL R6, R4, R5" in lines[-2] and "stall_long_sb 90%" in lines[-2]
    assert "20.0%" in lines[-1] and "stall_wait 100%" in lines[-1]


def test_a_file_without_the_source_page_is_refused(ncu_source, tmp_path):
    path = tmp_path / "other.csv"
    path.write_text('"ID","Kernel Name"\n"0","k"\n')
    with pytest.raises(ValueError, match="Address"):
        ncu_source.read(str(path))
