"""`fusec compile` writes the lowered graph, schedule, verifier report, Perfetto trace and task
DOT; `fusec verify` re-checks a written schedule and fails on a planted bug."""
import json

import pytest

from fusec.cli import main
from fusec.ir.schedule_text import parse_schedule_file, print_schedule
from fusec.testing.mutate import plant


@pytest.fixture(scope="module")
def out_r2(tmp_path_factory):
    out = tmp_path_factory.mktemp("k3tiny_r2")
    assert main(["compile", "models/kimi_k3.py", "--config", "tiny", "--ranks", "2", "--max-len", "64",
                 "-o", str(out)]) == 0
    return out


def test_all_outputs_written(out_r2):
    names = {p.name for p in out_r2.iterdir()}
    assert {"kimi_k3_tiny.fir", "summary.txt", "lowered.fir", "schedule.fsched.gz", "verify.txt",
            "trace.json", "tasks.dot"} <= names
    assert not [n for n in names if n.startswith(".")]          # no temporary files left behind
    assert (out_r2 / "verify.txt").read_text().startswith("memory-order verifier (rules V1-V7): OK")


def test_trace_is_chrome_trace_with_a_track_per_sm_and_rank(out_r2):
    tr = json.loads((out_r2 / "trace.json").read_text())
    tasks = [e for e in tr["traceEvents"] if e["ph"] == "X"]
    tracks = {(e["pid"], e["tid"]) for e in tasks}
    assert {p for p, _ in tracks} == {0, 1}
    named = {(e["pid"], e["tid"]) for e in tr["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert tracks <= named
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in tasks)


def test_trace_full_has_one_event_per_task_and_sm(tmp_path):
    out = tmp_path / "full"
    assert main(["compile", "models/kimi_k3.py", "--config", "tiny", "--max-len", "64", "--trace", "full",
                 "-o", str(out)]) == 0
    sched = parse_schedule_file(out / "schedule.fsched.gz")
    tr = json.loads((out / "trace.json").read_text())
    tasks = [e for e in tr["traceEvents"] if e["ph"] == "X"]
    assert len(tasks) == len(sched.tasks)
    assert {e["tid"] for e in tasks} == {sm for (_, sm) in sched.queues}


def test_verify_accepts_the_written_schedule_and_rejects_a_planted_bug(out_r2, tmp_path, capsys):
    path = out_r2 / "schedule.fsched.gz"
    assert main(["verify", str(path)]) == 0
    bad, what = plant(parse_schedule_file(path), "hoist_act_load", seed=1)
    bad_path = tmp_path / "bad.fsched"
    bad_path.write_text(print_schedule(bad))
    capsys.readouterr()
    assert main(["verify", str(bad_path)]) == 1
    assert "V2:" in capsys.readouterr().out


def test_dump_dir_stages_reparse(tmp_path):
    from fusec.ir.parser import parse_fir_file
    dump = tmp_path / "dump"
    assert main(["compile", "models/kimi_k3.py", "--config", "tiny", "--max-len", "64", "-o", str(tmp_path / "o"),
                 "--dump-dir", str(dump)]) == 0
    stages = sorted(p.name for p in dump.iterdir())
    assert stages[0].startswith("00-canonicalize") and stages[-1].startswith("07-prefetch")
    # from tile on, a stage is the schedule text with its task families (the tile, split_reduce
    # and overlap stages have no events or queues yet); each reads back to the same text
    assert [p.split(".")[-1] for p in stages] == ["fir"] * 3 + ["fsched"] * 5
    for p in dump.iterdir():
        if p.suffix == ".fir":
            parse_fir_file(p)
        else:
            s = parse_schedule_file(p)
            assert s.families and print_schedule(s) == p.read_text()


def test_schedule_text_on_request_is_the_gzip_text(out_r2, tmp_path):
    """--schedule text writes the plain text; it is the compressed file's text, byte for byte."""
    import gzip
    out = tmp_path / "text"
    assert main(["compile", "models/kimi_k3.py", "--config", "tiny", "--ranks", "2", "--max-len", "64",
                 "--schedule", "text", "-o", str(out)]) == 0
    assert not (out / "schedule.fsched.gz").exists()
    assert (out / "schedule.fsched").read_bytes() == gzip.decompress((out_r2 / "schedule.fsched.gz").read_bytes())
    assert main(["verify", str(out)]) == 0


def test_background_writer_returns_raises_and_is_cancelled(tmp_path):
    """fusec.outputs.background (the compile writes its outputs in a forked child while it
    verifies): the child's result comes back, its exception is raised here with its type, and
    when the body fails the child is killed before it writes anything more."""
    import os
    import time

    from fusec.outputs import background, write_text

    with background(lambda: [write_text(tmp_path / "a.txt", "a")]) as job:
        assert job.result() == [tmp_path / "a.txt"]
    assert (tmp_path / "a.txt").read_text() == "a"

    def fails():
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        with background(fails) as job:
            job.result()

    def slow():
        time.sleep(0.5)
        return [write_text(tmp_path / "late.txt", "late")]

    with pytest.raises(ValueError, match="verify failed"):
        with background(slow) as job:
            raise ValueError("verify failed")
    time.sleep(0.8)
    assert not (tmp_path / "late.txt").exists()
    if hasattr(os, "fork"):                     # the writer's child was killed and reaped
        # (its own pid: other tests' helpers, e.g. multiprocessing's resource tracker, may
        # still be children of this process)
        with pytest.raises(ChildProcessError):
            os.waitpid(job.pid, os.WNOHANG)


def test_failed_verification_writes_nothing(tmp_path, monkeypatch, capsys):
    """A compile whose final verification fails: one error line, exit 2, no output folder, even
    though its outputs were being written beside the check."""
    import fusec.compiler as compiler
    from fusec.passes.manager import PassError

    def broken(prog, opts):
        raise PassError("after the pipeline: planted failure")

    monkeypatch.setattr(compiler, "final_verify", broken)
    out = tmp_path / "o"
    assert main(["compile", "models/llama.py", "--config", "tiny", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "fusec: error:" in err and "planted failure" in err
    assert not out.exists() and list(tmp_path.iterdir()) == []
