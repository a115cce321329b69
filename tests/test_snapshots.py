"""Golden snapshots (syrupy): the canonical .fir of K3 tiny and slice4 and the compile summary
of full K3. They change only with `pytest --snapshot-update`, reviewed as a diff."""
from fusec.cli import main
from fusec.ir.printer import print_graph
from fusec.models import kimi_k3


def test_k3_tiny_fir(snapshot):
    assert print_graph(kimi_k3.build_graph("tiny")) == snapshot


def test_k3_slice4_fir(snapshot):
    assert print_graph(kimi_k3.build_graph("slice4")) == snapshot


def test_k3_full_compile_summary(snapshot, tmp_path, capsys):
    assert main(["compile", "models/kimi_k3.py", "--emit", "fir", "-o", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    # keep only the stable part: drop the lines naming the temporary folder and the time taken
    summary = "\n".join(l for l in out.splitlines() if not l.startswith(("wrote ", "done in ")))
    assert summary == snapshot


def _tiny_schedule_text(ranks: int) -> str:
    from fusec.compiler import lower
    from fusec.passes.options import Options
    from fusec.ir.schedule_text import print_schedule
    prog = lower(kimi_k3.build_graph("tiny"), Options(ranks=ranks, batch=1, max_len=64))
    return print_schedule(prog.schedule)


def test_k3_tiny_schedule_r1(snapshot):
    assert _tiny_schedule_text(1) == snapshot


def test_k3_tiny_schedule_r2(snapshot):
    assert _tiny_schedule_text(2) == snapshot
