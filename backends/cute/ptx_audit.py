"""PTX audit of the generated megakernel's memory ordering (design rule V6, in the emitted code).

Compile on the CPU (CUTE_DSL_ARCH=sm_90a, `--keep-ptx --dump-dir D`), then read the PTX in
program-text order, function by function:

  P1 every spin-wait load is an acquire (`ld.acquire.gpu` / `ld.global.acquire`), or a strong
     relaxed/volatile load followed by `fence.acq_rel` / `fence.sc` before the next ordinary
     global load or asynchronous copy from global memory (`cp.async`, `cp.async.bulk`: the
     first load that could read produced data);
  P2 every atomic (`atom.*`, `red.*`; the event signal is one) is `.release` / `.acq_rel`, or
     a fence stands between the last ordinary global store and it; a strong `st.relaxed`
     used as a signal needs the same fence, `st.release` passes;
  P3 the kernel contains at least one synchronizing load and, when the plan signals events,
     at least one release signal (an audit of a kernel without waits proves nothing).
  P4 system scope (multi-rank kernels, V7): a strong load at `.sys` scope is an acquire or is
     followed by a `fence.acq_rel.sys` / `fence.sc.sys` (a gpu-scope fence does not order a
     peer's stores) before the next data load; an atomic at `.sys` scope is a release, or a
     `.sys` fence stands between the last global store and it; no `multimem` instruction
     (NVLink multicast stays off); and a multi-rank kernel (`expect_sys`) has at least one
     system-scope acquire load and one system-scope release signal (the peer signal).
  P5 async proxy (the wgmma MLA body): wgmma reads its shared-memory operands through the async
     proxy, so shared memory written through the generic proxy must be made visible to it by a
     `fence.proxy.async` first. Audited for cp.async (non-bulk) into shared memory, the way the
     operands are written: a `wgmma.mma_async` with such a copy before it and no
     `fence.proxy.async` between them is a violation. (cp.async.bulk writes through the async
     proxy itself; st.shared is not tracked: the kernel's shared stores are read by threads,
     and an address-blind rule could not tell them from operands.)

Text order approximates control flow: the spin loop's load sits above the code after the loop,
so a fence placed after the loop is seen before the data loads. Known limit: the audit cannot
tell which address a load reads, so it is conservative (every strong non-acquire load needs
the fence).

CLI: python -m fusec.backends.cute.ptx_audit FILE.ptx   (exit 1 on a violation)
"""
from __future__ import annotations

import dataclasses
import pathlib
import re
import sys

_INSTR = re.compile(r"^\s*(?:@!?%\w+\s+)?([a-z][\w.:]*)")
_FENCE = re.compile(r"^fence\.(acq_rel|sc)\b")
_SYS_FENCE = re.compile(r"^fence\.(acq_rel|sc)\.sys\b")


@dataclasses.dataclass
class AuditReport:
    """Findings of one audit. ok is True when there is no violation."""

    violations: list[str]
    acquire_loads: int = 0
    fenced_relaxed_loads: int = 0
    release_signals: int = 0
    fenced_signals: int = 0
    sys_acquire_loads: int = 0      # P4: system-scope spin loads that acquire (or are sys-fenced)
    proxy_fenced_wgmma: int = 0     # P5: wgmma instructions after a fence.proxy.async
    sys_release_signals: int = 0    # P4: system-scope atomics that release (or are sys-fenced)

    @property
    def ok(self) -> bool:
        return not self.violations

    def summary(self) -> str:
        head = "PASS" if self.ok else f"FAIL ({len(self.violations)} violations)"
        sys = (f", system scope: acquire loads {self.sys_acquire_loads}, release signals "
               f"{self.sys_release_signals}") if self.sys_acquire_loads or self.sys_release_signals else ""
        proxy = f", wgmma after the async-proxy fence {self.proxy_fenced_wgmma}" if self.proxy_fenced_wgmma else ""
        return (f"{head}: acquire loads {self.acquire_loads}, fenced relaxed loads "
                f"{self.fenced_relaxed_loads}, release signals {self.release_signals}, "
                f"fenced signals {self.fenced_signals}" + sys + proxy)


def _opcodes(ptx: str):
    """(line number, opcode) of each instruction, split per function body."""
    funcs: list[list[tuple[int, str]]] = [[]]
    for n, line in enumerate(ptx.splitlines(), 1):
        s = line.strip()
        if s.startswith((".entry", ".visible .entry", ".func", ".visible .func")):
            funcs.append([])
            continue
        if not s or s.startswith(("//", ".", "{", "}")) or s.endswith(":"):
            continue
        m = _INSTR.match(s)
        if m:
            funcs[-1].append((n, m.group(1)))
    return [f for f in funcs if f]


def _is_global_load(op: str) -> bool:
    return op.startswith("ld.") and ".global" in op or op.startswith("ld.global")


def _is_async_global_read(op: str) -> bool:
    """cp.async / cp.async.bulk(.tensor) from global memory: a data load the issuing thread
    starts now (the L2 prefetch forms write nothing a thread reads, so they are not)."""
    return op.startswith("cp.async") and ".global" in op and "prefetch" not in op.split(".")


def _strength(op: str) -> str:
    """'acquire', 'relaxed' (strong non-acquire) or 'weak' for a load or store opcode."""
    parts = set(op.split("."))
    if "acquire" in parts or "release" in parts or "acq_rel" in parts:
        return "acquire" if op.startswith("ld.") else "release"
    if "relaxed" in parts or "volatile" in parts:
        return "relaxed"
    return "weak"


def _is_generic_shared_copy(op: str) -> bool:
    """cp.async (not .bulk) into shared memory: written through the generic proxy (P5)."""
    return op.startswith("cp.async.") and not op.startswith("cp.async.bulk") and ".shared" in op


def _is_sys(op: str) -> bool:
    return "sys" in op.split(".")


def _unfenced(rep: AuditReport, loads: list[int], sys_loads: list[int], reader: str) -> None:
    """P1 / P4 violations: relaxed spin loads (lines) not fenced before `reader` reads data."""
    for m in loads:
        rep.violations.append(f"P1 line {m}: relaxed spin load is not acquire and no fence.acq_rel/"
                              f"fence.sc precedes {reader}")
    for m in sys_loads:
        rep.violations.append(f"P4 line {m}: relaxed system-scope load is not acquire and no "
                              f"fence.acq_rel.sys/fence.sc.sys precedes {reader}")


def audit_ptx(ptx: str, *, expect_signals: bool = True, expect_sys: bool = False) -> AuditReport:
    """Check P1-P5 on PTX text; see the module docstring."""
    rep = AuditReport(violations=[])
    for func in _opcodes(ptx):
        pending_loads: list[int] = []  # strong relaxed loads not yet followed by a fence
        pending_sys: list[int] = []    # ... of them at system scope, not yet followed by a sys fence
        fence_since_store = False
        sys_fence_since_store = False
        unfenced_copy = 0              # P5: line of a cp.async into shared memory not yet proxy-fenced
        for n, op in func:
            if _is_generic_shared_copy(op):
                unfenced_copy = unfenced_copy or n
            elif op.startswith("fence.proxy.async"):
                unfenced_copy = 0
            elif op.startswith("wgmma.mma_async"):
                if unfenced_copy:
                    rep.violations.append(f"P5 line {n}: '{op}' reads shared memory that the cp.async at line "
                                          f"{unfenced_copy} wrote, with no fence.proxy.async between them")
                    unfenced_copy = 0
                else:
                    rep.proxy_fenced_wgmma += 1
            if op.startswith("multimem"):
                rep.violations.append(f"P4 line {n}: '{op}': NVLink multicast (multimem) must stay off")
            if _FENCE.match(op):
                if pending_loads:
                    rep.fenced_relaxed_loads += len(pending_loads)
                pending_loads = []
                fence_since_store = True
                if _SYS_FENCE.match(op):
                    rep.sys_acquire_loads += len(pending_sys)
                    pending_sys = []
                    sys_fence_since_store = True
            elif op.startswith("ld."):
                kind = _strength(op)
                if kind == "acquire":
                    rep.acquire_loads += 1
                    rep.sys_acquire_loads += _is_sys(op)
                elif kind == "relaxed":
                    pending_loads.append(n)
                    if _is_sys(op):
                        pending_sys.append(n)
                elif _is_global_load(op) and (pending_loads or pending_sys):
                    _unfenced(rep, pending_loads, pending_sys, f"the data load at line {n}")
                    pending_loads, pending_sys = [], []
            elif _is_async_global_read(op) and (pending_loads or pending_sys):
                _unfenced(rep, pending_loads, pending_sys, f"the asynchronous copy at line {n}")
                pending_loads, pending_sys = [], []
            elif op.startswith(("atom.", "red.")):
                if _strength(op) == "release" or ".acq_rel" in op:
                    rep.release_signals += 1
                    rep.sys_release_signals += _is_sys(op)
                elif fence_since_store:
                    rep.fenced_signals += 1
                    if _is_sys(op) and sys_fence_since_store:
                        rep.sys_release_signals += 1
                    elif _is_sys(op):
                        rep.violations.append(f"P4 line {n}: system-scope '{op}' is fenced at gpu scope only")
                else:
                    rep.violations.append(
                        f"P2 line {n}: '{op}' is neither release nor preceded by a fence")
            elif op.startswith("st."):
                kind = _strength(op)
                if kind == "release":
                    rep.release_signals += 1
                elif kind == "relaxed" and not fence_since_store:
                    rep.violations.append(f"P2 line {n}: relaxed store '{op}' without a fence")
                elif ".global" in op or op.startswith("st.global"):
                    fence_since_store = False
                    sys_fence_since_store = False
        for m in pending_loads:
            rep.fenced_relaxed_loads += 0  # never followed by a data load: harmless
    if rep.acquire_loads + rep.fenced_relaxed_loads == 0 and not any(
            v.startswith("P1") for v in rep.violations):
        rep.violations.append("P3: no synchronizing (acquire or fenced) load in the kernel")
    if expect_signals and rep.release_signals + rep.fenced_signals == 0:
        rep.violations.append("P3: no release signal in the kernel")
    if expect_sys and rep.sys_acquire_loads == 0:
        rep.violations.append("P4: a multi-rank kernel without a system-scope acquire load (the peer waits)")
    if expect_sys and rep.sys_release_signals == 0:
        rep.violations.append("P4: a multi-rank kernel without a system-scope release signal (the peer signals)")
    return rep


def audit_dir(dump_dir: str | pathlib.Path, **kw) -> AuditReport:
    """Audit every .ptx file under dump_dir (merged report)."""
    files = sorted(pathlib.Path(dump_dir).rglob("*.ptx"))
    if not files:
        raise FileNotFoundError(f"no .ptx under {dump_dir}: compile with --keep-ptx --dump-dir")
    return audit_ptx("\n".join(f.read_text() for f in files), **kw)


def audit_plan(plan, out_dir) -> AuditReport:
    """Generate + compile `plan` on the CPU into out_dir and audit its PTX."""
    from .codegen import compile_plan

    _, _, dump = compile_plan(plan, out_dir, keep_ptx=True)
    return audit_dir(dump, expect_signals=any(t.signal_event >= 0 for t in plan.tasks),
                     expect_sys=plan.ranks > 1)


def main(argv: list[str]) -> int:
    rep = audit_ptx("\n".join(pathlib.Path(a).read_text() for a in argv))
    print(rep.summary())
    for v in rep.violations:
        print("  " + v)
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
