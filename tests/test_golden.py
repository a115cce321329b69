"""`fusec golden record/check` and fusec.testing.golden: a record of K3 tiny checks clean, a weight
changed by 1% fails naming the first diverging step, a record of another config is refused, a
record is replaced only with --update, and the near-tie rule tells a routing flip at a tie from
one at a clear margin (on a synthetic step whose routing and logits the test sets)."""
from __future__ import annotations

import json
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

from fusec.cli import main
from fusec.models import kimi_k3
from fusec.testing import golden
from fusec.weights import random_weights
from fusec.ir.registry import get_op

ROUTER = get_op("router")   # the fake steps' router ops carry its registry entry (OpDef.route)

MODEL = kimi_k3.__file__
STEPS = 4


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    d = tmp_path_factory.mktemp("golden") / "k3_tiny"
    assert main(["golden", "record", MODEL, "--config", "tiny", "--batch", "1", "--batch", "2",
                 "--steps", str(STEPS), "-o", str(d)]) == 0
    return d


def test_record_holds_prompts_greedy_tokens_logits_and_routing(recorded):
    meta = json.loads((recorded / "golden.json").read_text())
    assert meta["batches"] == [1, 2] and meta["steps"] == STEPS and meta["config"] == "tiny"
    assert meta["weights"] == {"seed": 0, "drawn_on": "cpu"}
    run = load_file(str(recorded / "b2.safetensors"))
    assert run["logits"].shape == (STEPS, 2, 4096) and run["logits"].dtype == torch.float32
    # the prompt is fed for prompt_len steps, then each step's input is the previous greedy token
    p = meta["prompt_len"]
    assert torch.equal(run["inputs"][p:], run["greedy"][p - 1:-1])
    assert torch.equal(run["greedy"], run["logits"].argmax(-1).to(torch.int32))
    # the same sequence in every batch size: batch 1's row is batch 2's row 0
    b1 = load_file(str(recorded / "b1.safetensors"))
    assert torch.equal(b1["inputs"][:p, 0], run["inputs"][:p, 0])
    routers = meta["routers"]
    assert len(routers) == 8        # K3 tiny: layers 1..8 are MoE
    assert run[f"route.{routers[0]}.ids"].shape == (STEPS, 2, 4)
    assert bool((run[f"route.{routers[0]}.margin"] >= 0).all())


def test_check_of_the_record_passes(recorded, capsys):
    assert main(["golden", "check", str(recorded)]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and f"compared sharply: {3 * STEPS} of {3 * STEPS}" in out


def test_a_weight_changed_by_one_percent_fails_naming_the_first_step(recorded):
    g = kimi_k3.build_graph("tiny")
    w = random_weights(g, 0, kimi_k3.WEIGHT_INIT)
    w["layers.1.self_attn.o_proj.weight"] = (w["layers.1.self_attn.o_proj.weight"].float() * 1.01).to(torch.bfloat16)
    v = golden.check(golden.Golden.load(recorded), weights=w)
    assert not v.ok
    f = v.first_failure
    assert f.step == 0 and "logits differ from the record" in f.note
    assert "first diverging step: step 0" in v.text()


def test_a_changed_step_is_named(recorded, tmp_path, capsys):
    """The record's logits of step 2 (batch 1) moved by 1%: the check names step 2, exit 1."""
    d = tmp_path / "tampered"
    d.mkdir()
    (d / "golden.json").write_text((recorded / "golden.json").read_text())
    (d / "b2.safetensors").write_bytes((recorded / "b2.safetensors").read_bytes())
    run = load_file(str(recorded / "b1.safetensors"))
    run["logits"][2] *= 1.01
    save_file(run, str(d / "b1.safetensors"))
    assert main(["golden", "check", str(d)]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "first diverging step: step 2 (batch 1, sequence 0)" in out


@pytest.mark.parametrize("extra", [[MODEL, "--config", "slice4"], [MODEL, "--config", "tiny", "--set", "layers=8"]])
def test_a_record_of_another_config_is_refused(recorded, extra, capsys):
    assert main(["golden", "check", str(recorded), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fusec: error: golden record is for kimi_k3_tiny"), err


def test_record_is_replaced_only_with_update(recorded, capsys):
    before = {p.name: p.read_bytes() for p in recorded.iterdir()}
    assert main(["golden", "record", MODEL, "--config", "tiny", "--steps", "1", "-o", str(recorded)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already holds a golden record" in err[0] and "--update" in err[0]
    assert {p.name: p.read_bytes() for p in recorded.iterdir()} == before


def test_update_replaces_the_record(tmp_path):
    d = tmp_path / "g"
    assert main(["golden", "record", MODEL, "--config", "tiny", "--batch", "1", "--steps", "1", "-o", str(d)]) == 0
    assert main(["golden", "record", MODEL, "--config", "tiny", "--batch", "2", "--steps", "2", "-o", str(d),
                 "--update"]) == 0
    meta = json.loads((d / "golden.json").read_text())
    assert meta["batches"] == [2] and meta["steps"] == 2
    assert sorted(p.name for p in d.iterdir()) == ["b2.safetensors", "golden.json"]


def test_missing_or_malformed_golden_is_one_line(tmp_path, capsys):
    assert main(["golden", "check", str(tmp_path / "none")]) == 2
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "golden.json").write_text("{")
    assert main(["golden", "check", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(e.startswith("fusec: error: ") for e in err), err


# -- the near-tie rule, on a synthetic step ---------------------------------------------------------
class _FakeRunner:
    """Looks like the reference executor to the route tap: `run(..., hook)` calls the hook on one
    router op and returns the logits the test scripted for this step."""

    def __init__(self, op, logits, ids):
        self.op, self.logits, self.ids, self.k, self.last_env = op, logits, ids, 0, None

    def run(self, tokens, positions, hook=None):
        ids = self.ids[self.k]
        hook(self.op, [torch.zeros(ids.shape[0], 4), torch.zeros(4)], [torch.ones_like(ids, dtype=torch.float32), ids])
        out = self.logits[self.k]
        self.k += 1
        return [out, out.argmax(-1)]


class _FakeStep:
    def __init__(self, runner, op):
        self.runner, self.graph = runner, types.SimpleNamespace(ops=[op])

    def __call__(self, tokens, positions):
        logits, nxt = self.runner.run(tokens, positions)
        return types.SimpleNamespace(logits=logits, next_tokens=nxt)

    def check(self):
        pass


def _synthetic(margins, cand_ids, cand_offsets):
    """Check a scripted candidate against a scripted record (fp32 tolerance 1e-4, near-tie 1e-3):
    {(step, row): Cell}, Verdict."""
    op = types.SimpleNamespace(opname="router", opdef=ROUTER, attrs={"topk": 1, "scale": 1.0}, outputs=[types.SimpleNamespace(name="r.w"),
                                                         types.SimpleNamespace(name="r")])
    steps, rows = len(margins), len(margins[0])
    logits = torch.randn(steps, rows, 16, generator=torch.Generator().manual_seed(0))
    run = {"inputs": torch.zeros(steps, rows, dtype=torch.int32), "logits": logits,
           "greedy": logits.argmax(-1).to(torch.int32), "top2_gap": torch.zeros(steps, rows),
           "route.r.ids": torch.zeros(steps, rows, 1, dtype=torch.int32),
           "route.r.margin": torch.tensor(margins, dtype=torch.float32)}
    meta = {"steps": steps, "routers": ["r"], "batches": [rows]}
    runner = _FakeRunner(op, [logits[s] + cand_offsets[s] for s in range(steps)], cand_ids)
    v = golden.Verdict(meta, "fake", "cpu", "fp32", 1e-4, 1e-3)
    golden._check_batch(run, meta, _FakeStep(runner, op), rows, v)
    return {(c.step, c.row): c for c in v.cells}, v


def test_near_tie_is_reported_apart_and_a_clear_flip_fails():
    same, other = torch.tensor([0]), torch.tensor([3])
    # rows: 0 flips at step 1 where the record's margin is 1e-5 (a tie); 1 flips at step 1 at
    # margin 0.5 (a clear choice); 2 never flips but its logits move at step 2
    margins = [[0.5, 0.5, 0.5], [1e-5, 0.5, 0.5], [0.5, 0.5, 0.5]]
    ids = [torch.stack([same, same, same]), torch.stack([other, other, same]), torch.stack([other, same, same])]
    big = torch.zeros(3, 16)
    big[0] += 5.0                       # row 0 after its near-tie: far off, but reported apart
    drift = torch.zeros(3, 16)
    drift[2, 0] += 0.1                  # row 2 at step 2: a real error
    cells, v = _synthetic(margins, ids, [torch.zeros(3, 16), big, big + drift])
    assert cells[(0, 0)].status == cells[(0, 1)].status == cells[(0, 2)].status == "ok"
    assert cells[(1, 0)].status == "near-tie" and "margin 1.0e-05" in cells[(1, 0)].note
    assert cells[(2, 0)].status == "apart"
    assert cells[(1, 1)].status == "FAIL" and "clear margin" in cells[(1, 1)].note
    assert cells[(2, 2)].status == "FAIL" and "logits differ" in cells[(2, 2)].note
    assert (v.first_failure.step, v.first_failure.row) == (1, 1)


# -- the pytest plugin, as an engine's suite uses it ------------------------------------------------
ENGINE_TEST = f'''
def test_k3_is_pinned(fusec_golden):
    fusec_golden("golden/k3", {MODEL!r}, config="tiny", batches=[1], steps=2)
'''


def _pytest(cwd, *args):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_engine.py", *args],
                       cwd=cwd, capture_output=True, text=True, timeout=600)
    return r.returncode, r.stdout + r.stderr


def test_pytest_plugin_pins_a_model(tmp_path):
    """The fixture comes with the installed package (pytest11 entry point): a missing record fails
    and says how to make one; --fusec-update-golden records it and checks; a changed record fails
    naming the step."""
    (tmp_path / "test_engine.py").write_text(ENGINE_TEST)
    rc, out = _pytest(tmp_path)
    assert rc == 1 and "no golden record in golden/k3: run pytest with --fusec-update-golden" in out, out
    rc, out = _pytest(tmp_path, "--fusec-update-golden")
    assert rc == 0 and (tmp_path / "golden/k3/golden.json").is_file(), out
    run = load_file(str(tmp_path / "golden/k3/b1.safetensors"))
    run["logits"][1] *= 1.01
    save_file(run, str(tmp_path / "golden/k3/b1.safetensors"))
    rc, out = _pytest(tmp_path)
    assert rc == 1 and "first diverging step: step 1 (batch 1, sequence 0)" in out, out


def test_the_megakernel_routes_are_read_from_its_arena():
    """For the cute backend the tap reads each router's ids from the arena after the step (the
    runner has no executor hook); routers the lowered graph lacks are left out."""
    op = types.SimpleNamespace(opname="router", opdef=ROUTER, attrs={"topk": 1, "scale": 1.0}, outputs=[types.SimpleNamespace(name="l1.w"),
                                                         types.SimpleNamespace(name="l1.ids")])
    gone = types.SimpleNamespace(opname="router", opdef=ROUTER, attrs={"topk": 1, "scale": 1.0}, outputs=[types.SimpleNamespace(name="l2.w"),
                                                           types.SimpleNamespace(name="l2.ids")])
    arena = {"l1.ids": torch.tensor([[5, 2], [1, 7]], dtype=torch.int32)}
    runner = types.SimpleNamespace(mem=types.SimpleNamespace(tensor=arena.__getitem__),
                                   program=types.SimpleNamespace(graph=types.SimpleNamespace(ops=[op])))
    tap = golden._RouteTap(types.SimpleNamespace(runner=runner, graph=types.SimpleNamespace(ops=[op, gone])))
    assert tap.observable and tap.kind == "arena"
    got = tap.take()
    assert list(got) == ["l1.ids"] and got["l1.ids"][0].tolist() == [[2, 5], [1, 7]]
