"""passes/split_reduce.py: all-reduces cut into column parts (docs/passes.md). The multi-rank
numerics (bit-identical with the split on and off) are in tests/test_cute_ranks.py."""
import re

import pytest

from fusec.compiler import lower
from fusec.ir.schedule_text import print_schedule
from fusec.models import kimi_k3, llama
from fusec.passes.manager import PIPELINES, parse_pipeline
from fusec.passes.options import Options

OFF = "-split_reduce"


def test_minus_list_drops_the_pass_from_the_default():
    assert parse_pipeline(OFF) == [p for p in PIPELINES["default"] if p != "split_reduce"]
    assert "split_reduce" in PIPELINES["default"]


def test_one_rank_is_unchanged():
    g = kimi_k3.build_graph("tiny")
    on = lower(g, Options(ranks=1, max_len=64))
    off = lower(g, Options(ranks=1, max_len=64), passes=OFF)
    assert print_schedule(on.schedule) == print_schedule(off.schedule)


def test_refusals_and_splits_are_logged(capsys):
    lower(kimi_k3.build_graph("tiny"), Options(ranks=2, max_len=64, log=frozenset({"overlap"})))
    err = capsys.readouterr().err
    assert "%out.logits.all_gather not split: all_gather is not a per-column collective" in err
    assert "%l1.combine.all_reduce not split" in err and "output too narrow to split: 1 tile(s)" in err
    assert "split_reduce: %l1.resid_ffn.all_reduce split into 2 all-reduces over columns [0:256], [256:512]" in err


def test_parts_wait_only_for_their_own_producer_tasks():
    """Part k's push waits for the producer's part k alone, the consumers for every local part;
    the producer's parts are column windows that together are the whole operand."""
    s = lower(llama.build_graph("tiny"), Options(ranks=2, max_len=16)).schedule
    by = {f.name: f for f in s.families}
    push = by["l0.o_proj.all_reduce.part1.push"]
    assert push.deps == ("l0.o_proj.part1",)
    wins = [s.tasks[t].tile[-1] for k in (0, 1) for t in by[f"l0.o_proj.part{k}"].task_ids]
    assert wins[0][0] == 0 and all(a[1] == b[0] for a, b in zip(wins, wins[1:]))
    users = [f for f in s.families if "l0.o_proj.all_reduce.part0" in f.deps and not f.collective]
    assert users and all("l0.o_proj.all_reduce.part1" in f.deps for f in users)


# -- the cost gate ------------------------------------------------------------------------------
# Llama tiny at R = 2 with few SMs: on 2 SMs each o_proj / down_proj half is a whole wave and
# the split costs a second wave's overhead plus one more push and reduce; on 4 the halves run
# side by side and the split only shortens the reduces. The referee is the schedule pass's
# predicted step of the whole program (not the gate's local prediction).

def _llama(sms: int, mode: str = "gated", passes: str = "default", log=frozenset()):
    return lower(llama.build_graph("tiny"), Options(ranks=2, max_len=16, sms=sms, split_reduce=mode, log=log),
                 passes=passes).schedule


def _step(s) -> float:
    return float(s.meta["predicted_step_us"])


def test_gate_refuses_where_the_split_loses(capsys):
    gated = _llama(2, log=frozenset({"overlap"}))
    err = capsys.readouterr().err
    forced, off = _llama(2, "forced"), _llama(2, passes=OFF)
    assert _step(forced) > _step(off)                    # the whole step: splitting loses here
    assert not [f for f in gated.families if ".part" in f.name]
    assert print_schedule(gated) == print_schedule(off)
    for y in ("l0.o_proj.all_reduce", "l0.down_proj.all_reduce", "l1.o_proj.all_reduce"):
        line = next(l for l in err.splitlines() if f"%{y} not split" in l)
        whole, split = map(float, re.search(r"predicted ([\d.]+) us whole, ([\d.]+) us split", line).groups())
        assert "no gain" in line and split >= whole


def test_gate_splits_where_the_split_wins(capsys):
    gated = _llama(4, log=frozenset({"overlap"}))
    err = capsys.readouterr().err
    forced, off = _llama(4, "forced"), _llama(4, passes=OFF)
    assert _step(forced) < _step(off)                    # the whole step: splitting wins here
    assert print_schedule(gated) == print_schedule(forced)
    assert "not split: no gain" not in err
    assert {f.name for f in gated.families} >= {"l0.o_proj.all_reduce.part0", "l1.down_proj.all_reduce.part1"}


def test_gate_decides_per_all_reduce():
    """K3 tiny at R = 2 on 4 SMs: some all-reduces gain from the split and some lose; the gated
    step is shorter than both every one cut and none cut."""
    def run(mode, passes="default"):
        return lower(kimi_k3.build_graph("tiny"), Options(ranks=2, max_len=64, sms=4, split_reduce=mode),
                     passes=passes).schedule
    gated, forced, off = run("gated"), run("forced"), run("gated", OFF)
    cut = {f.name for f in gated.families if ".part" in f.name}
    assert cut and cut < {f.name for f in forced.families if ".part" in f.name}
    assert _step(gated) < min(_step(forced), _step(off))


def test_forced_mode_from_options_and_environment(monkeypatch):
    monkeypatch.setenv("FUSEC_SPLIT_REDUCE", "forced")
    assert Options.from_env(ranks=2).split_reduce == "forced"
    monkeypatch.delenv("FUSEC_SPLIT_REDUCE")
    assert Options.from_env(ranks=2).split_reduce == "gated"
    with pytest.raises(ValueError, match="split_reduce must be one of"):
        Options(split_reduce="on")
    assert [f for f in _llama(2, "forced").families if ".part" in f.name]
