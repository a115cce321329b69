"""Find a model's graph from what a user names: a model file (`models/kimi_k3.py`), a `.fir`
file, or a module name (`kimi_k3`). A model module defines `build_graph(config, **overrides)`."""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from fusec.ir.graph import Graph
from fusec.ir.parser import parse_fir_file


class ModelError(ValueError):
    """A model that cannot be loaded (missing file, no graph declared, bad config)."""


def load_module(spec: str) -> ModuleType:
    path = Path(spec)
    if path.suffix == ".py":
        if not path.is_file():
            raise ModelError(f"{spec}: no such model file")
        # Prefer the packaged module of the same name so both spellings share one module object.
        pkg = f"fusec.models.{path.stem}"
        try:
            mod = importlib.import_module(pkg)
            if Path(mod.__file__).resolve() == path.resolve():
                return mod
        except ImportError:
            pass
        name = f"fusec_user_model_{path.stem}"
        sp = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(sp)
        sys.modules[name] = mod
        try:
            sp.loader.exec_module(mod)
        except Exception as e:  # a user's model file may fail in any way: report it in one line
            raise ModelError(f"{spec}: failed to import: {type(e).__name__}: {e}") from None
        return mod
    try:
        return importlib.import_module(f"fusec.models.{spec}")
    except ModuleNotFoundError:
        raise ModelError(f"{spec}: not a model file, .fir file or known model name") from None


def parse_overrides(items: list[str] | None) -> dict:
    """`key=value` strings; values are parsed as int, float, bool or a string."""
    out = {}
    for it in items or []:
        if "=" not in it:
            raise ModelError(f"--set expects key=value, got '{it}'")
        k, v = it.split("=", 1)
        for conv in (int, float):
            try:
                out[k] = conv(v)
                break
            except ValueError:
                continue
        else:
            out[k] = {"true": True, "false": False}.get(v.lower(), v)
    return out


def _coerce(spec: str, key: str, value, default, int_min: int = 1):
    """`value` for a config field whose default is `default`, checked against its type: ints are
    integers >= `int_min`, floats finite numbers, bools true/false, tuples comma lists of integers
    >= 0."""
    import math

    def bad(what):
        return ModelError(f"{spec}: config override {key}={value}: {key} must be {what}")

    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("an integer")
        if value < int_min:
            raise bad(f"an integer >= {int_min}")
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise bad("a finite number")
        return float(value)
    if isinstance(default, str):
        return value if isinstance(value, str) else str(value)
    if isinstance(default, tuple):
        items = value if isinstance(value, (tuple, list)) else \
            [x for x in str(value).split(",") if x.strip()] if not isinstance(value, int) else [value]
        try:
            out = tuple(int(x) for x in items)
        except (TypeError, ValueError):
            raise bad("a comma list of integers") from None
        if any(x < 0 for x in out):
            raise bad("a comma list of integers >= 0")
        return out
    return value


def check_overrides(spec: str, mod, overrides: dict | None) -> dict:
    """`overrides` checked against the fields of the model's config (its `CONFIGS` values):
    values of the wrong type or out of range are a ModelError naming the field."""
    import dataclasses
    if not overrides:
        return overrides or {}
    configs = getattr(mod, "CONFIGS", None)
    base = next(iter(configs.values()), None) if isinstance(configs, dict) else None
    if base is None or not dataclasses.is_dataclass(base):
        return overrides
    names = {f.name for f in dataclasses.fields(base)}

    def int_min(k):   # an integer field is >= 1 unless some named config sets it lower
        vals = [getattr(c, k, 1) for c in configs.values()]
        return min([1] + [v for v in vals if isinstance(v, int) and not isinstance(v, bool)])
    return {k: _coerce(spec, k, v, getattr(base, k), int_min(k)) if k in names else v
            for k, v in overrides.items()}


def load_graph(spec, config: str | None = None, overrides: dict | None = None,
               checkpoint=None) -> tuple[Graph, ModuleType | None]:
    """(graph, model module or None for .fir files and Graph objects).

    `checkpoint`: a checkpoint path whose `config.json`, when it has one and the model file
    reads it (`config_from_checkpoint`), gives the config: see `checkpoint_config`."""
    if isinstance(spec, Graph):
        return spec, None
    spec = str(spec)
    if spec.endswith(".fir"):
        if not Path(spec).is_file():
            raise ModelError(f"{spec}: no such file")
        if config or overrides:
            raise ModelError(f"{spec}: a .fir file has no configs; --config/--set apply to model files")
        return parse_fir_file(spec), None
    mod = load_module(spec)
    build = getattr(mod, "build_graph", None)
    if not callable(build):
        raise ModelError(f"{spec}: declares no graph (expected a function build_graph(config, **overrides))")
    overrides = check_overrides(spec, mod, overrides)
    chosen = config or getattr(mod, "DEFAULT_CONFIG", None)
    if checkpoint is not None:
        cfg = checkpoint_config(spec, mod, checkpoint, config, overrides)
        if cfg is not None:
            chosen, overrides = cfg, {}
    try:
        g = build(chosen, **(overrides or {}))
    except (ValueError, TypeError) as e:
        raise ModelError(f"{spec}: {e}") from None
    if not isinstance(g, Graph):
        raise ModelError(f"{spec}: build_graph returned {type(g).__name__}, not a Graph")
    return g, mod


def list_configs(spec) -> tuple[dict, str | None]:
    """(the model's named configs, name -> config object; its default config's name).

    Named configs are the `CONFIGS` dict a model module declares next to `build_graph` (what
    `--config NAME` picks from); `DEFAULT_CONFIG` is the one used when none is named.
    """
    spec = str(spec)
    if spec.endswith(".fir"):
        raise ModelError(f"{spec}: a .fir file is one graph and has no configs; configs belong to model files")
    mod = load_module(spec)
    configs = getattr(mod, "CONFIGS", None)
    if not isinstance(configs, dict) or not configs:
        raise ModelError(f"{spec}: declares no named configs (expected a dict CONFIGS of name -> config)")
    return configs, getattr(mod, "DEFAULT_CONFIG", None)


def checkpoint_config(spec: str, mod, path, config: str | None = None, overrides: dict | None = None):
    """The model config a checkpoint's `config.json` describes (reconciled with a named `config`
    and `overrides`: every disagreement in one ModelError), or None when the checkpoint has no
    config.json or the model file cannot read one (no `config_from_checkpoint(doc, shape_of)`)."""
    import os

    from fusec.checkpoint import CONFIG_FILE, CheckpointError, header_shapes, read_config
    from fusec.modelconfig import checkpoint_config as reconcile

    reader = getattr(mod, "config_from_checkpoint", None)
    configs = getattr(mod, "CONFIGS", None)
    if reader is None or not isinstance(configs, dict):
        return None
    doc = read_config(path)
    if doc is None:
        return None
    folder = os.fspath(path) if os.path.isdir(path) else os.path.dirname(os.fspath(path)) or "."
    source = os.path.join(folder, CONFIG_FILE)
    try:
        fields = reader(doc, header_shapes(path))
        return reconcile(spec, configs, getattr(mod, "DEFAULT_CONFIG", next(iter(configs))), fields, config,
                         overrides, source=source)
    except CheckpointError:
        raise
    except ValueError as e:   # the reader's problems, or the disagreements (which name the file)
        raise ModelError(str(e) if str(e).startswith(source) else f"{source}: {e}") from None
