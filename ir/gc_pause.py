"""Pausing Python's cyclic garbage collector around work that builds many long-lived objects.

Reading, lowering, verifying and printing a full model's schedule each build ~10^6 small
objects (tasks, instructions, boxes, memo tables) and free almost none: every full collection
would rescan all of them for nothing (the tile pass took 6.2 s with it, 2.8 s without; the table
verifier spent 3/4 of its time there on slice4). Reference counting still frees what is dropped;
the collector is set back as it was afterwards.
"""
from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def gc_paused():
    """Pause the cyclic collector (nests: only the outermost pause switches it back on)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            if gc.get_freeze_count() == 0:
                # What was made meanwhile moves to the oldest generation unscanned, as if it had
                # survived the collections: else the first allocation after enable() scans all
                # of it at once (0.65 s after a full K3 compile), for the same nothing. (Only when
                # nobody else froze objects: unfreeze() would thaw theirs too.)
                gc.freeze()
                gc.unfreeze()
            gc.enable()
