"""benchmarks/ncu_sass_summary.py on a hand-made four-instruction source-counter CSV.

A loop of three instructions executed 10 times (an LDG, a guarded LOP3 and a LOP3) and one
instruction executed once. Samples: 8 long scoreboard + 2 wait on the second LOP3, 5 selected on
the LDG, 5 barrier on the one-off instruction: 20 in all, so long_sb 40%, selected 25%, barrier
25%, wait 10%; the loop's mix is LOP3.LUT 2, LDG.E.128 1; its hottest line is the second LOP3
(10 samples, 50% of all, long_sb 80% of its own).
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import ncu_sass_summary  # noqa: E402

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
          '"stall_barrier","stall_long_sb","stall_selected","stall_wait",'
          '"stall_long_sb (Not Issued)"')
LINES = [
    '"Kernel Name","k",',
    HEADER,
    '"0x10","LDG.E.128 R4, desc[UR4][R2.64]","5","10","0","0","5","0","0"',
    '"0x20","@P0 LOP3.LUT R0, R4, 0xff, RZ, 0xc0, !PT","0","10","0","0","0","0","0"',
    '"0x30","LOP3.LUT R1, R5, 0x81c081c0, RZ, 0xc0, !PT","10","10","0","8","0","2","8"',
    '"0x40","BAR.SYNC.DEFER_BLOCKING 0x0","5","1","5","0","0","0","0"',
]


def test_summary_of_a_hand_made_csv():
    text = ncu_sass_summary.summarize(LINES)
    lines = text.splitlines()
    assert lines[0] == "stall samples 20, by reason:"
    shares = {ln.split()[0]: ln.split()[1] for ln in lines[1:5]}
    assert shares == {"long_sb": "40.0%", "selected": "25.0%", "barrier": "25.0%", "wait": "10.0%"}
    assert "the most-executed loop (3 SASS instructions, executed 10 times):" in text
    assert "  LOP3.LUT 2, LDG.E.128 1" in lines
    assert lines[-1] == ("its most-sampled instruction: LOP3.LUT R1, R5, 0x81c081c0, RZ, 0xc0, !PT "
                         "(50.0% of all samples, long_sb 80% of its own)")
