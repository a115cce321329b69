"""Modules imported at their first use.

The op registry's reference semantics are torch code, but reading the registry (shapes, aliases,
addressing: what the parser and the verifier need) uses none of it. The op modules name torch
through `LazyModule`, so `fusec verify` and the `.fir` / schedule readers do not pay torch's
~2 s import; the first reference call imports it.
"""
from __future__ import annotations

import importlib


class LazyModule:
    """Stands for the module `name`; the first attribute access imports it (then cached)."""

    def __init__(self, name: str):
        self.__dict__["_name"] = name

    def __getattr__(self, attr: str):
        mod = self.__dict__.get("_mod")
        if mod is None:
            mod = self.__dict__["_mod"] = importlib.import_module(self.__dict__["_name"])
        return getattr(mod, attr)

    def __repr__(self) -> str:
        return f"<lazy module {self.__dict__['_name']!r}>"
