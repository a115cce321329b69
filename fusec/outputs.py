"""Write output files atomically: a temporary name in the same folder, then rename; and whole
output folders through a staging folder (`staged_dir`)."""
from __future__ import annotations

import gzip
import os
import shutil
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
