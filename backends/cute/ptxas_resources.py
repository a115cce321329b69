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
import struct
import subprocess
import tempfile


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


def text_bytes(cubin: bytes) -> int:
    """Bytes of machine code in a cubin (an ELF64 file): the summed sizes of its `.text.*`
    sections (one per kernel). A short reader of the section headers, not a dependency: the
    layout is the ELF64 standard's (e_shoff at 0x28, e_shentsize / e_shnum / e_shstrndx at
    0x3a..0x3f; per section sh_name at 0, sh_offset at 0x18, sh_size at 0x20)."""
    if cubin[:5] != b"\x7fELF\x02":
        raise ValueError("not an ELF64 cubin")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3a)
    def section(i):
        base = shoff + i * shentsize
        name, = struct.unpack_from("<I", cubin, base)
        off, size = struct.unpack_from("<QQ", cubin, base + 0x18)
        return name, off, size
    _, stroff, _ = section(shstrndx)
    total = 0
    for i in range(shnum):
        name, _, size = section(i)
        end = cubin.index(b"\0", stroff + name)
        if cubin[stroff + name:end].startswith(b".text"):
            total += size
    return total


def ptxas_code_bytes(ptx_path: str | os.PathLike, arch: str = "sm_90a", ptxas: str | None = None) -> int:
    """Bytes of SASS the kernel in the PTX file compiles to (`ptxas -arch=<arch>`, then text_bytes)."""
    ptxas = ptxas or find_ptxas()
    if ptxas is None:
        raise FileNotFoundError("ptxas (CUDA toolkit) not found on PATH or in /usr/local/cuda*/bin")
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "k.cubin")
        res = subprocess.run([ptxas, f"-arch={arch}", os.fspath(ptx_path), "-o", out], capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"ptxas failed on {ptx_path}: {res.stderr.strip()[-400:]}")
        with open(out, "rb") as f:
            return text_bytes(f.read())


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
