"""Registers and spills of a compiled megakernel, from the CUDA toolkit's `ptxas -v`.

The megakernel is one function: at 512 threads ptxas caps it at 128 registers, and a body that
needs more spills to local memory (L1, then L2) inside its loops. The CuTe DSL keeps the PTX
(`--keep-ptx`) but reports no register counts, and no SASS disassembler ships with it, so this
runs the toolkit's ptxas on that PTX. `benchmarks/ptxas_bodies.py` uses it per body;
tests/test_cute_codegen.py guards the bodies that must not spill.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import re
import shutil
import subprocess


@dataclasses.dataclass(frozen=True)
class Resources:
    registers: int
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int

    def __str__(self) -> str:
        return (f"{self.registers} regs, stack {self.stack_bytes} B, spill stores {self.spill_store_bytes} B / "
                f"loads {self.spill_load_bytes} B")


def find_ptxas() -> str | None:
    """ptxas on PATH, else the newest /usr/local/cuda*/bin/ptxas; None without a CUDA toolkit."""
    return shutil.which("ptxas") or next(iter(sorted(glob.glob("/usr/local/cuda*/bin/ptxas"), reverse=True)), None)


def ptxas_resources(ptx_path: str | os.PathLike, arch: str = "sm_90a", ptxas: str | None = None) -> Resources:
    """Resources of the (single) kernel in the PTX file, as `ptxas -v -arch=<arch>` reports them."""
    ptxas = ptxas or find_ptxas()
    if ptxas is None:
        raise FileNotFoundError("ptxas (CUDA toolkit) not found on PATH or in /usr/local/cuda*/bin")
    res = subprocess.run([ptxas, "-v", f"-arch={arch}", os.fspath(ptx_path), "-o", os.devnull],
                         capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"ptxas failed on {ptx_path}: {res.stderr.strip()[-400:]}")
    regs = re.findall(r"Used (\d+) registers", res.stderr)
    stack = re.findall(r"(\d+) bytes stack frame", res.stderr)
    spill = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", res.stderr)
    if not (regs and stack and spill):
        raise RuntimeError(f"unexpected ptxas -v output for {ptx_path}: {res.stderr.strip()[-400:]}")
    return Resources(int(regs[-1]), int(stack[-1]), int(spill[-1][0]), int(spill[-1][1]))
