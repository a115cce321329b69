"""pytest plugin: pin a model's outputs in an engine's test suite (docs/golden.md).

Loaded automatically wherever fusec is installed (the `pytest11` entry point in pyproject.toml);
`pytest_plugins = ["fusec.testing.pytest_plugin"]` in a conftest.py does the same by hand.

    def test_k3_is_pinned(fusec_golden):
        fusec_golden("tests/golden/k3_tiny", "models/kimi_k3.py", config="tiny")

The fixture checks the compiled step against the golden folder and fails the test with the
one-screen verdict. A missing folder fails too, saying how to record it: golden files are
written only when pytest runs with `--fusec-update-golden`, never silently. `--fusec-backend`
and `--fusec-device` pick what is checked (default: the reference executor in fp32 on the CPU;
`--fusec-backend cute --fusec-device cuda` checks the megakernel).
"""
from __future__ import annotations

from pathlib import Path

import pytest


def pytest_addoption(parser):
    g = parser.getgroup("fusec", "fusec golden outputs")
    g.addoption("--fusec-update-golden", action="store_true",
                help="record (or re-record) the golden folders the fusec_golden fixture is given")
    g.addoption("--fusec-backend", default="reference", choices=["reference", "cute"],
                help="backend the fusec_golden fixture checks (default reference)")
    g.addoption("--fusec-device", default=None, help="device for fusec_golden (default cpu; cuda for cute)")


class GoldenPin:
    """The `fusec_golden` fixture: call it with a golden folder and the model it pins."""

    def __init__(self, config):
        self.update = config.getoption("--fusec-update-golden")
        self.backend = config.getoption("--fusec-backend")
        self.device = config.getoption("--fusec-device") or ("cuda" if self.backend == "cute" else "cpu")

    def __call__(self, golden_dir, model, config: str | None = None, *, overrides: dict | None = None,
                 weights=None, batches=None, steps: int | None = None, backend: str | None = None,
                 device: str | None = None, precision: str | None = None):
        """Check `model` against `golden_dir`; returns the Verdict. With --fusec-update-golden,
        record it first (fp32 reference, on the CPU unless `device` says otherwise)."""
        from . import golden
        path = Path(golden_dir)
        backend = backend or self.backend
        device = device or self.device
        if self.update:
            rec = golden.record(model, config, overrides=overrides, weights=weights,
                                batches=batches or golden.DEFAULT_BATCHES, steps=steps or golden.DEFAULT_STEPS,
                                device="cpu" if backend == "reference" else device,
                                command="pytest --fusec-update-golden")
            rec.save(path, update=True)
        elif not (path / golden.GOLDEN_FILE).is_file():
            pytest.fail(f"no golden record in {path}: run pytest with --fusec-update-golden once to record it",
                        pytrace=False)
        try:
            v = golden.check(golden.Golden.load(path), backend=backend, device=device, precision=precision,
                             model=model, config=config, overrides=overrides, weights=weights, batches=batches)
        except golden.GoldenError as e:
            pytest.fail(f"fusec golden: {e}", pytrace=False)
        if not v.ok:
            pytest.fail(v.text(), pytrace=False)
        return v


@pytest.fixture
def fusec_golden(request) -> GoldenPin:
    """Pin a model: `fusec_golden(golden_dir, model, config=...)` (see the module docstring)."""
    return GoldenPin(request.config)
