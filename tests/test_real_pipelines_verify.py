"""The memory-order verifier accepts every schedule the real pipelines produce (K3 tiny and
slice4, Llama tiny and 1B at R = 1, 2, 8; full K3 is covered by benchmarks/pipeline_speed.py
and benchmarks/stress_random_order.py --full, too slow for CI)."""
import pytest

from fusec.compiler import lower
from fusec.passes.options import Options
from fusec.loader import load_graph
from fusec.passes.memory_order import check_schedule

CASES = [(m, c, r) for m, c in [("kimi_k3", "tiny"), ("kimi_k3", "slice4"), ("llama", "tiny"),
                                ("llama", "llama-3.2-1b")] for r in (1, 2, 8)]


@pytest.mark.parametrize("model,config,ranks", CASES, ids=[f"{m}-{c}-R{r}" for m, c, r in CASES])
def test_pipeline_schedule_verifies(model, config, ranks):
    g, _ = load_graph(model, config)
    prog = lower(g, Options(ranks=ranks, verify_each_pass=False))
    rep = check_schedule(prog.schedule)
    assert rep.ok, rep.first_error()
    assert prog.schedule.ranks == ranks and len(prog.schedule.tasks) > 0
