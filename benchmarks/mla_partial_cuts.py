"""Where the MLA PARTIAL body's time goes: benchmarks/mla_partial.py with parts of the body cut out.

    MLA_B=16,4 python benchmarks/mla_partial_cuts.py [full,noS_mma,...] [plan variant, e.g. mla_head_tiles=4]

Each cut edits the installed body template (restored afterwards, also on failure), so each is a
new compile; the cut variants compute wrong results on purpose (timing only: their 'rel err'
says how wrong). Differences against 'full' bound what each part costs.
"""
import os
import subprocess
import sys

import fusec.backends.cute as cb
T = os.path.join(os.path.dirname(cb.__file__), "templates", "bodies", "mla.py.j2")
orig = open(T).read()
cuts = {
    "full": [],
    "noS_mma": [("_mma_bf16([qa[u][0]", "pass  # "), ("_mma_bf16([qa[u][2]", "pass  # ")],
    "noPV_mma": [("_mma_bf16(pf[mt * (MLA_SR // 16) + 2 * kp + h]", "pass  # ")],
    "no_softmax": [("_mla_softmax(sm, sp, warp, lane, nhb, nr)", "pass  # ")],
    "no_next_stage_load": [("if blk + MLA_SR < end:", "if blk + MLA_SR < 0:")],
    "no_S_loop": [("while si < mtn * (MLA_SR // 8):", "while si < 0:")],
    "no_PV_loop": [("if nt < nlt:\n                            for mt", "if nt < 0:\n                            for mt")],
}
which = sys.argv[1].split(",") if len(sys.argv) > 1 else list(cuts)
extra = sys.argv[2] if len(sys.argv) > 2 else ""
try:
    for name in which:
        s = orig
        for a, b in cuts[name]:
            assert a in s, (name, a)
            s = s.replace(a, b)
        open(T, "w").write(s)
        out = subprocess.run([sys.executable, "benchmarks/mla_partial.py", "--batches", os.environ.get("MLA_B", "16,4"),
                              "--variants", extra, "--reps", "10"], capture_output=True, text=True)
        lines = [l for l in out.stdout.splitlines() if l.startswith("B=")]
        for l in lines:
            print(f"{name:20s} {l}", flush=True)
        if out.returncode:
            print(name, "FAILED", out.stderr[-2000:])
finally:
    open(T, "w").write(orig)
