"""`fusec report` on K3 tiny: every section is present with figures that agree with independent
sources (the model's graph, the compile's own outputs), and the page renders in a real headless
Chromium with the network off: every section visible, every plot decoded, no request leaves
the file. A full-page screenshot is kept in test-artifacts/ (git-ignored)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fusec.cli import main
from fusec.loader import load_graph
from fusec.models import kimi_k3
from fusec.report import SECTION_IDS

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = Path(os.environ.get("FUSEC_TEST_ARTIFACTS", ROOT / "test-artifacts"))
CHROMIUM = "/usr/bin/chromium"
TITLES = {"model": "Model", "fusion": "Fusion", "sharding": "Sharding and collectives", "schedule": "Schedule",
          "proof": "Proof", "numerics": "Numerics", "speed": "Speed", "versions": "Versions and commands"}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "k3_tiny"
    assert main(["report", kimi_k3.__file__, "--config", "tiny", "-o", str(out)]) == 0
    data = json.loads((out / "report.json").read_text())
    return out, data, {s["id"]: s for s in data["sections"]}


def test_every_section_in_order(report):
    _, data, _ = report
    assert [s["id"] for s in data["sections"]] == list(SECTION_IDS)
    assert all(s["lead"] for s in data["sections"])


def test_model_figures_match_the_graph(report):
    _, _, sec = report
    g, _ = load_graph(kimi_k3.__file__, "tiny")
    d = sec["model"]["data"]
    assert sum(d["ops"].values()) == len(g.ops)
    assert d["params"] == sum(v.type.numel({}) for v in g.weights())
    assert d["layers"] == {"KDA + MoE": 5, "KDA + dense": 1, "MLA + MoE": 3}


def test_fusion_lists_groups_and_refusals_with_reasons(report):
    _, _, sec = report
    d = sec["fusion"]["data"]
    assert d["groups"] > 0
    # K3 tiny's routers cannot join their GEMV's tile: the tile pass says so for each MoE layer
    routers = [r for r in d["refusals"] if "router %l" in r and "is not an epilogue" in r]
    assert len(routers) == 8, d["refusals"]


def test_proof_counts_every_rule_and_runs_orders(report):
    _, _, sec = report
    d = sec["proof"]["data"]
    rules = {r["rule"]: r for r in d["rules"]}
    assert {"S1", "S2", "S3", "S4", "V1+V2", "V3", "V4", "V5", "V6", "V7"} <= set(rules)
    assert all(r["violations"] == 0 for r in rules.values())
    # K3 tiny reads expert weights and cache rows by run-time ids: V3 has loads to check
    assert rules["V3"]["count"] > 0 and rules["V1+V2"]["count"] > 0 and rules["V6"]["count"] > 0
    ro = d["random_orders"]
    assert ro["numeric"] and ro["ran"] >= 1 and all(r["ok"] for r in ro["results"])
    assert d["prefetch"]["not_static_weight"] == 0 and d["prefetch"]["loads_before_waits"] > 0


def test_numerics_and_speed_say_what_ran_on_a_cpu(report):
    _, _, sec = report
    n = sec["numerics"]
    assert n["data"]["ran"] and "reference executor in bf16 against itself in fp32" in n["lead"]
    cells = n["data"]["verdict"]["cells"]
    assert {c["batch"] for c in cells} == {1, 4} and {c["step"] for c in cells} == set(range(8))
    assert "not measured" in sec["speed"]["lead"]


def test_versions_name_the_command(report):
    out, _, sec = report
    cmds = sec["versions"]["data"]["commands"]
    assert cmds["this report"].startswith("fusec report ") and "--config tiny" in cmds["this report"]


def test_page_renders_offline_in_headless_chromium(report):
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is not installed (apt-get install chromium; .ci/run installs it)")
    from playwright.sync_api import sync_playwright
    out, data, _ = report
    page_url = (out / "report.html").resolve().as_uri()
    requests = []
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "report_k3_tiny.png"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM,
                                    args=["--headless", "--no-sandbox", "--disable-background-networking"])
        try:
            ctx = browser.new_context(offline=True, viewport={"width": 1280, "height": 900})
            page = ctx.new_page()
            page.on("request", lambda r: requests.append(r.url))
            page.goto(page_url, wait_until="load")
            for sid in SECTION_IDS:
                sec = page.locator(f"section#{sid}")
                assert sec.count() == 1, sid
                assert sec.locator("h2").inner_text() == TITLES[sid]
                assert sec.locator("p.lead").inner_text().strip(), sid
            # plots: the timeline and per-SM load (schedule), the error per step (numerics), the bytes
            # per op kind (model); each one decoded by the browser
            for sid in ("model", "schedule", "numerics"):
                assert page.locator(f"section#{sid} img").count() >= 1, sid
            imgs = page.evaluate("Array.from(document.images).map(i => [i.complete, i.naturalWidth])")
            assert len(imgs) == sum(len(s["images"]) for s in data["sections"]) >= 4, imgs
            assert all(done and w > 0 for done, w in imgs), imgs
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    # the page and its inline plots (data: URLs) only: nothing fetched from a network
    assert all(u == page_url or u.startswith("data:") for u in requests), requests
    assert shot.stat().st_size > 10_000
