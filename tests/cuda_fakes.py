"""CPU stand-ins for the CUDA pieces of the deferred step checks (pinned host copies, events),
so their bookkeeping is tested without a GPU."""
from __future__ import annotations

import torch


class FakeEvent:
    """torch.cuda.Event on the CPU: work is done when issued, so there is nothing to wait for."""

    def record(self):
        pass

    def synchronize(self):
        pass


def fake_events_and_pinning(monkeypatch) -> None:
    """Events as FakeEvent and `pin_memory` as a plain CPU copy, for this test."""
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: t.clone())
