"""The line-oriented schedule reader against the lark reader (the grammar is the spec): same
Schedule, same verdict, same errors; texts outside the printed layout go to lark."""
from __future__ import annotations

from pathlib import Path

import pytest

from fusec.ir.parser import parse_fir
from fusec.ir.schedule_text import (_HEADER, ScheduleSyntaxError, _FastReader, parse_schedule,
                                    parse_schedule_file, print_schedule)
from fusec.passes.memory_order import check_schedule

HERE = Path(__file__).parent / "schedules"
FILES = sorted(HERE.glob("*.sched"))


def fast_only(text: str):
    """The fast reader alone (None where it gives up)."""
    m = _HEADER.search(text)
    return _FastReader(parse_fir(text[:m.start()])).read(text[m.start():].split("\n"))


def same(a, b) -> bool:
    return (print_schedule(a) == print_schedule(b) and a.tasks == b.tasks and a.events == b.events
            and a.queues == b.queues and a.meta == b.meta and a.buffers == b.buffers and a.dims == b.dims
            and a.families == b.families
            and (a.ranks, a.sms, a.replicated) == (b.ranks, b.sms, b.replicated))


def verdict(s) -> list[str]:
    return [str(e) for e in check_schedule(s).errors]


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_fast_reader_matches_lark(path):
    text = path.read_text()
    fast, slow = fast_only(text), parse_schedule(text, str(path), fast=False)
    assert fast is not None, "the fast reader gave up on a printed schedule"
    assert same(fast, slow)
    assert same(parse_schedule_file(path), slow)        # the streaming file reader
    assert verdict(fast) == verdict(slow)


@pytest.fixture(scope="module")
def k3_tiny_texts():
    from fusec.passes.options import Options
    from fusec.models import kimi_k3
    from fusec.passes.manager import PIPELINES, Program, run_pipeline
    g = kimi_k3.build_graph("tiny")
    return {R: print_schedule(run_pipeline(Program(g.copy(), Options(ranks=R, batch=2, max_len=16, sms=16,
                                                                     verify_each_pass=False)),
                                           PIPELINES["default"]).schedule) for R in (1, 2)}


@pytest.mark.parametrize("ranks", [1, 2])
def test_fast_reader_k3_tiny_round_trip(k3_tiny_texts, ranks):
    text = k3_tiny_texts[ranks]
    fast, slow = fast_only(text), parse_schedule(text, "k3.sched", fast=False)
    assert fast is not None
    assert print_schedule(fast) == text
    assert fast.families and same(fast, slow)            # the task families read back by both readers
    if ranks > 1:                                         # collectives: pre / post / named events
        assert any(f.pre for f in fast.families) and any(f.named_events for f in fast.families)
    assert same(fast, slow)
    assert verdict(fast) == verdict(slow)


def _edits(text: str):
    """Texts the grammar reads but the printed layout does not have (the fast reader gives up)."""
    yield text.replace("    compute\n", "    compute  # a trailing comment\n", 1)
    yield text.replace("  task ", "  task  ", 1)
    yield text.replace("\n    compute\n", " compute\n", 1)                  # two statements on one line
    yield text.replace(" {\n    ", " {\n\n\t  ", 1)                         # other whitespace (fine for both)
    yield text.replace("compute", "compute compute", 1)                    # two instructions on one line


def _broken(text: str):
    """Texts with an error: both readers must give the same message."""
    yield text.replace("load %", "load %nosuch", 1)
    yield text.replace("task 1 ", "task 7 ", 1)
    yield text.replace("  queue 0 0 :", "  queue 0 0 :\n  queue 0 0 :", 1)
    yield text.replace(" acquire ", " acquired ", 1)
    yield text.rstrip().rstrip("}")                                        # no closing brace
    yield text + "task\n"
    yield text.replace("ops(%", "ops(%zz", 1)


@pytest.mark.parametrize("name", ["ok_mini.sched", "ok_allreduce.sched", "ok_mini_r2.sched"])
def test_fast_reader_gives_up_to_lark(name):
    text = (HERE / name).read_text()
    slow = parse_schedule(text, "t", fast=False)
    for t in _edits(text):
        assert t != text
        assert same(parse_schedule(t, "t"), parse_schedule(t, "t", fast=False))
    for t in _broken(text):
        assert t != text
        assert fast_only(t) is None, t
        with pytest.raises(ScheduleSyntaxError) as fast_err:
            parse_schedule(t, "bad.sched")
        with pytest.raises(ScheduleSyntaxError) as slow_err:
            parse_schedule(t, "bad.sched", fast=False)
        assert str(fast_err.value) == str(slow_err.value)
    assert same(parse_schedule(text, "t"), slow)


# -- the .fir part: ir/parser.py's line reader against lark -----------------------------------------
FIRS = sorted((HERE.parent).glob("**/*.fir"))


def _fir_outcome(text: str, fast: bool):
    """Everything a graph holds (or the error), to compare the two readers."""
    from fusec.ir.printer import print_graph
    try:
        g = parse_fir(text, "t.fir", fast=fast)
    except Exception as e:
        return type(e).__name__, str(e)
    return (g.name, g.dims, print_graph(g), [(v.name, v.type) for v in g.params], g.param_attrs,
            [(o.opname, o.attrs, o.group, [v.name for v in o.inputs], [(v.name, v.type) for v in o.outputs])
             for o in g.ops], {k: v.name for k, v in g.updates.items()}, [v.name for v in g.outputs])


def test_fast_fir_reader_matches_lark(k3_tiny_texts):
    from fusec.ir.parser import _fast_fir
    texts = [p.read_text() for p in FIRS] + [t[:_HEADER.search(t).start()] for t in k3_tiny_texts.values()]
    taken = 0
    for text in texts:
        assert _fir_outcome(text, True) == _fir_outcome(text, False)
        taken += _fast_fir(text) is not None
    assert taken >= len(texts) - len(list((HERE.parent / "fir_invalid").glob("*.fir")))   # every valid file


def test_fast_fir_reader_random_edits():
    """Seeded random edits (deleted and inserted characters, digits changed, lines repeated): the
    two readers give the same graph or the same error on every one."""
    import random
    from fusec.ir.parser import _fast_fir
    rng = random.Random(11)
    taken = 0
    alpha = list(" \t\n%#{}[]()=,:@\"\\-.e0123456789aBLxyz") + ["true", "false", "1.5", "-3", "1e5", '"s"',
                                                               " @g", " {eps = 1.0}", "[]", "[1, 2]", "nan"]
    valid = [p.read_text() for p in FIRS if p.parent.name != "fir_invalid"]
    for _ in range(800):
        text = rng.choice(valid)
        for _ in range(rng.randint(1, 3)):
            k, op = rng.randrange(len(text)), rng.random()
            if op < 0.2:
                text = text[:k] + text[k + rng.randint(1, 4):]
            elif op < 0.5 and text[k].isdigit():
                text = text[:k] + rng.choice("0123456789") + text[k + 1:]
            elif op < 0.8:
                text = text[:k] + rng.choice(alpha) + text[k:]
            else:
                lines = text.split("\n")
                lines.insert(rng.randrange(len(lines)), rng.choice(lines))
                text = "\n".join(lines)
        assert _fir_outcome(text, True) == _fir_outcome(text, False), text
        taken += _fast_fir(text) is not None
    assert taken >= 20          # edited texts the fast reader took itself (the rest went to lark)
