"""`mem_instr` (the tile pass's fast LOAD / STORE constructor) makes exactly what the frozen
dataclass's own constructor makes."""
import dataclasses
import pickle

import pytest

from fusec.ir.schedule import Instr, InstrKind, Region, mem_instr


@pytest.mark.parametrize("kind,addr", [(InstrKind.LOAD, None), (InstrKind.LOAD, "ids"), (InstrKind.STORE, None)])
def test_mem_instr_is_the_dataclass_instr(kind, addr):
    r = Region("x", ((0, 4), (8, 16)))
    fast, slow = mem_instr(kind, r, addr), Instr(kind, r, addressed_by=addr)
    assert type(fast) is Instr
    assert vars(fast) == vars(slow)                       # every field, in the same order
    assert list(vars(fast)) == [f.name for f in dataclasses.fields(Instr)]
    assert fast == slow and hash(fast) == hash(slow) and repr(fast) == repr(slow)
    assert pickle.loads(pickle.dumps(fast)) == slow
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.region = None
    assert dataclasses.replace(fast, peer=1) == dataclasses.replace(slow, peer=1)
