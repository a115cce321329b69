"""benchmarks/critical_path.py's event walk on a hand-made profile of a 5-row table.

Two CTAs: CTA 0 runs rows 0 (GEMV, signals event 0) and 1 (EW, signals event 1); CTA 1 runs
rows 2 (NOP), 3 (EW, waits on event 1) and 4 (ARGMAX, waits on event 0). The step ends with
row 4; its start was gated by row 3 ending (same CTA), row 3's by event 1 (row 1's end), row
1's by row 0 (same CTA). So the path is 4 <- 3 <- 1 <- 0 with one cross-CTA hop (row 1's end
at 9 us to row 3's body at 11 us) and two same-CTA gaps (row 0 -> 1: 1 us, row 3 -> 4: 0.5 us).
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from fusec.backends.cute.plan import Opcode, TaskRow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import critical_path  # noqa: E402


def _profile(tmp_path, tasks, stamps, ctas):
    rows = torch.tensor([[t.task_id, int(t.opcode), 0, 0, 1, 7] for t in tasks])
    prof = torch.tensor([[int(1000 * (10 + x)) for x in s] for s in stamps], dtype=torch.int64)
    path = tmp_path / "p.pt"
    torch.save({"prof": prof, "rows": rows, "cta": torch.tensor(ctas)}, path)
    return str(path)


def test_walk_follows_the_tables_events(tmp_path):
    tasks = [TaskRow(Opcode.GEMV_BF16, 0, signal_event=0), TaskRow(Opcode.EW, 1, signal_event=1),
             TaskRow(Opcode.NOP, 2), TaskRow(Opcode.EW, 3, wait_event=1, wait_per_step=1),
             TaskRow(Opcode.ARGMAX, 4, wait_event=0, wait_per_step=1)]
    stamps = [(0, 0, 5), (5.5, 6, 9), (0, 0, 0.1), (0.2, 11, 12), (12.2, 12.5, 14)]
    path = _profile(tmp_path, tasks, stamps, [0, 0, 1, 1, 1])
    body, hops, hop_us, gap_us, span, _, medians = critical_path.walk_events(path, tasks, None)
    assert span == pytest.approx(14)
    assert body == pytest.approx({"ARGMAX/0/k7": 1.5, "EW/0/k7": 4.0, "GEMV_BF16/0/k7": 5.0})
    assert hops == 1 and hop_us == pytest.approx(2.0)
    assert gap_us == pytest.approx(1.0 + 0.5)
    # row 3: released at 9, waited from 0.2, body at 11 -> 2.0; row 4: released at 5, waited from
    # 12.2, body at 12.5 -> 0.3
    assert medians == pytest.approx({"EW": 2.0, "ARGMAX": 0.3})


def test_walk_refuses_another_tables_profile(tmp_path):
    tasks = [TaskRow(Opcode.GEMV_BF16, 0, signal_event=0), TaskRow(Opcode.EW, 1, wait_event=0, wait_per_step=1)]
    path = _profile(tmp_path, tasks, [(0, 0, 1), (1, 1, 2)], [0, 1])
    other = [TaskRow(Opcode.GEMV_BF16, 0, signal_event=0), TaskRow(Opcode.ARGMAX, 1, wait_event=0, wait_per_step=1)]
    with pytest.raises(SystemExit, match="does not match"):
        critical_path.walk_events(path, other, None)


def test_streaming_gaps_counts_time_without_weight_streams(tmp_path):
    """Rows 0 (GEMV on CTA 0, 0-5 us) and 3 (GEMV on CTA 1, 3-6 us) stream; EW rows run 6-9 and
    9.5-10 us. Streaming: one CTA for 3 + 1 us, two for 2 us; none from 6 to 10 us, which is one
    stretch of 4 us with both EW rows in it."""
    tasks = [TaskRow(Opcode.GEMV_BF16, 0), TaskRow(Opcode.EW, 1), TaskRow(Opcode.NOP, 2),
             TaskRow(Opcode.GEMV_BF16, 3), TaskRow(Opcode.EW, 4)]
    stamps = [(0, 0, 5), (5, 6, 9), (0, 0, 0.1), (0.2, 3, 6), (6, 9.5, 10)]
    path = _profile(tmp_path, tasks, stamps, [0, 0, 1, 1, 1])
    hist, gaps = critical_path.streaming_gaps(path)
    assert sum(us for _, _, us in hist) == pytest.approx(10)
    by_band = {(lo, hi): us for lo, hi, us in hist}
    assert by_band[(0, 0)] == pytest.approx(4.0)
    assert sum(us for (lo, hi), us in by_band.items() if lo <= 1 <= hi) == pytest.approx(4.0)
    assert sum(us for (lo, hi), us in by_band.items() if lo <= 2 <= hi) == pytest.approx(2.0)
    assert len(gaps) == 1 and gaps[0][0] == pytest.approx(6) and gaps[0][1] == pytest.approx(4)
    assert gaps[0][2] == {"EW/0": 2}
