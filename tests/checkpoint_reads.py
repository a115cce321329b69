"""Test helper: count the tensor bytes a loader reads from safetensors files.

`ReadCounter().safe_open` replaces `safe_open` in a module (fusec.checkpoint; `monkeypatch`, or
`install` in a spawned worker) by a wrapper whose handles count, per checkpoint tensor name, the bytes of every tensor they hand
out: `get_tensor(name)` and `get_slice(name)[...]` (header calls, `keys`, `get_shape`,
`get_dtype`, read nothing and count nothing). A loader that reads data any other way fails
loudly (the wrapper exposes nothing else), so a count of 0 means the tensor was not read.
"""
from __future__ import annotations

import collections

from safetensors import safe_open as _real_safe_open


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


class _Slice:
    def __init__(self, sl, name, counts):
        self._sl, self._name, self._counts = sl, name, counts

    def get_shape(self):
        return self._sl.get_shape()

    def get_dtype(self):
        return self._sl.get_dtype()

    def __getitem__(self, idx):
        t = self._sl[idx]
        self._counts[self._name] += _nbytes(t)
        return t


class _Handle:
    def __init__(self, f, counts):
        self._f, self._counts = f, counts

    def __enter__(self):
        self._f.__enter__()
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)

    def keys(self):
        return self._f.keys()

    def metadata(self):
        return self._f.metadata()

    def get_slice(self, name):
        return _Slice(self._f.get_slice(name), name, self._counts)

    def get_tensor(self, name):
        t = self._f.get_tensor(name)
        self._counts[name] += _nbytes(t)
        return t


class ReadCounter:
    """`counts[tensor name]`: bytes handed out so far; `safe_open`: the counting replacement."""

    def __init__(self):
        self.counts: collections.Counter = collections.Counter()

    def safe_open(self, path, framework="pt", device="cpu"):
        return _Handle(_real_safe_open(path, framework=framework, device=device), self.counts)

    def total(self) -> int:
        return sum(self.counts.values())

    def clear(self) -> None:
        self.counts.clear()


def install(module) -> ReadCounter:
    """Replace `module.safe_open` by a counting one for the rest of this process (spawned test
    workers); tests use monkeypatch with `ReadCounter().safe_open` instead."""
    c = ReadCounter()
    module.safe_open = c.safe_open
    return c
