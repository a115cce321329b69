"""Write output files atomically: a temporary name in the same folder, then rename; whole output
folders through a staging folder (`staged_dir`); and output writing beside other work
(`background`)."""
from __future__ import annotations

import gzip
import os
import pickle
import shutil
import signal
import tempfile
from contextlib import contextmanager
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text(path, text: str) -> Path:
    """Write `text` to `path` atomically; a `.gz` path is gzip-compressed (level 1, no timestamp:
    the same text gives the same bytes; a full K3 schedule 55 MB -> 4 MB in ~0.15 s)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb" if path.suffix == ".gz" else "w") as f:
            if path.suffix == ".gz":
                f.write(gzip.compress(text.encode(), compresslevel=1, mtime=0))
            else:
                f.write(text)
        os.chmod(tmp, 0o666 & ~_umask())   # mkstemp makes 0600; give the usual permissions
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


@contextmanager
def staged_dir(target):
    """Yield an empty folder next to `target` to write a whole output set into.

    On success its contents move into `target`: a new target is the staging folder renamed (one
    step, so a reader never sees half of it); an existing one keeps its other files and has those
    of the same name replaced. On any failure the staging folder is removed, together with the
    parent folders made for it, so a failed compile leaves neither an empty nor a half-written
    folder behind, and a folder the user gave is never deleted.
    """
    target = Path(target)
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"{target}: exists and is not a folder")
    made = _missing_parents(target.parent)
    target.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    try:
        yield stage
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        for d in made:                    # deepest first; stop at anything not empty
            try:
                d.rmdir()
            except OSError:
                break
        raise
    try:
        os.rename(stage, target)          # fails if target exists (and is not an empty folder)
    except OSError:
        if not target.is_dir():
            shutil.rmtree(stage, ignore_errors=True)
            raise
        _merge(stage, target)
        shutil.rmtree(stage, ignore_errors=True)
    else:
        os.chmod(target, 0o777 & ~_umask())   # mkdtemp makes 0700; give the usual permissions


def _missing_parents(folder: Path) -> list[Path]:
    """The folders `mkdir(parents=True)` would create for `folder`, deepest first."""
    out = []
    while not folder.exists() and folder != folder.parent:
        out.append(folder)
        folder = folder.parent
    return out


def _merge(src: Path, dst: Path) -> None:
    """Move every file of `src` to the same place under `dst`, replacing what is there."""
    dst.mkdir(exist_ok=True)
    for p in src.iterdir():
        if p.is_dir() and not p.is_symlink():
            _merge(p, dst / p.name)
        else:
            os.replace(p, dst / p.name)


class _Done:
    """A job already run in this process (no fork here): its result, or its exception."""

    def __init__(self, fn):
        self._value, self._error = None, None
        try:
            self._value = fn()
        except Exception as e:   # raised where the caller asks for the result, as with a fork
            self._error = e

    def result(self):
        if self._error is not None:
            raise self._error
        return self._value

    def cancel(self) -> None:
        pass


class _Forked:
    """A job running in a forked child: `result()` waits for it and returns its value (or raises
    its exception); `cancel()` kills it and waits, so nothing writes after the caller moves on."""

    def __init__(self, fn):
        r, w = os.pipe()
        self._pid = os.fork()
        if self._pid == 0:                      # the child: run, report, leave at once
            os.close(r)
            status = 0
            try:
                payload = pickle.dumps(("ok", fn()))
            except BaseException as e:           # the parent re-raises it
                status = 1
                try:
                    payload = pickle.dumps(("error", e))
                except Exception:
                    payload = pickle.dumps(("error", RuntimeError(f"{type(e).__name__}: {e}")))
            with os.fdopen(w, "wb") as f:
                f.write(payload)
            os._exit(status)                    # no atexit handlers, no flush of the parent's buffers
        os.close(w)
        self._pipe = os.fdopen(r, "rb")

    @property
    def pid(self) -> int:
        """The child's process id (waited for by `result` and `cancel`)."""
        return self._pid

    def result(self):
        data = self._pipe.read()
        self._pipe.close()
        _, status = os.waitpid(self._pid, 0)
        if not data:
            raise RuntimeError(f"the output writer stopped (wait status {status}) without a result")
        kind, value = pickle.loads(data)
        if kind == "error":
            raise value
        return value

    def cancel(self) -> None:
        if self._pipe.closed:
            return
        self._pipe.close()
        try:
            os.kill(self._pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(self._pid, 0)


@contextmanager
def background(fn):
    """Run `fn()` (it writes files and returns what it wrote) in a forked child while the body
    of the `with` runs here, on another core; `.result()` inside the body waits for it. If the
    body raises, the child is killed first, so nothing is written after the caller (e.g.
    `staged_dir`) cleans up. Without os.fork (Windows), `fn()` runs here at once.
    The child sees the parent's objects as they were at the fork: `fn` must only read state
    that the body does not change."""
    job = _Forked(fn) if hasattr(os, "fork") else _Done(fn)
    try:
        yield job
    except BaseException:
        job.cancel()
        raise
