"""passes/split_reduce.py: all-reduces cut into column parts (docs/passes.md). The multi-rank
numerics (bit-identical with the split on and off) are in tests/test_cute_ranks.py."""
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
