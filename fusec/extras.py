"""Optional parts of fusec that need an extra installed (`pip install 'fusec[cute]'`).

The CuTe DSL (`cutlass`, `cuda.bindings`) is imported lazily inside backends/cute, so a plain
install never needs it; without this check, asking for the CuTe backend anyway fails deep in the
pipeline with `ModuleNotFoundError: cuda`, which tells a user nothing about what to install.
"""
from __future__ import annotations

import importlib.util

# What backends/cute imports from the DSL.
CUTE_MODULES = ("cutlass", "cuda.bindings.driver")


class MissingExtraError(ImportError):
    """A feature was asked for whose optional dependencies are not installed."""


def require_cute() -> None:
    """Raise MissingExtraError (one line: what to install) unless the CuTe DSL is installed.

    Only looks the modules up, without importing cutlass: importing it reads the CUTE_DSL_*
    environment, which backends/cute/emit.py sets just before its own import.
    """
    for name in CUTE_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):   # a missing parent package; a module blanked in sys.modules
            found = False
        if not found:
            raise MissingExtraError(f"the CuTe backend needs the cute extra (nvidia-cutlass-dsl): "
                                    f"pip install 'fusec[cute]' (no module named '{name}')")
