"""Named model configs with field overrides, shared by every model file; and the config a
checkpoint's own config.json describes, reconciled with a named config and overrides."""
from __future__ import annotations

import dataclasses


def select_config(model: str, configs: dict, config, overrides: dict):
    """`config` is a name in `configs` or a config object; `overrides` replace its fields."""
    cls = type(next(iter(configs.values())))
    cfg = config if isinstance(config, cls) else configs.get(config)
    if cfg is None:
        raise ValueError(f"unknown config '{config}' for {model} (have: {', '.join(configs)})")
    fields = {f.name for f in dataclasses.fields(cls)}
    for k in overrides:
        if k not in fields:
            raise ValueError(f"{model} config has no field '{k}'")
    return dataclasses.replace(cfg, **overrides) if overrides else cfg


def checkpoint_config(model: str, configs: dict, default: str, fields: dict, config=None,
                      overrides: dict | None = None, source: str = "config.json"):
    """The config to build for a checkpoint whose config.json determines `fields` (field ->
    value, from the model's `config_from_checkpoint`).

    No named `config`: the default config with `fields` replaced, named after the named config it
    equals (e.g. the published K3 checkpoint gives `full`), else `checkpoint`; `overrides` may set
    only what config.json leaves open. A named `config` (plus `overrides`) must agree with
    config.json on every field it determines. Every disagreement is listed in one ValueError.
    """
    overrides = overrides or {}
    if config is None:
        base = configs[default]
        cfg = dataclasses.replace(base, **fields)
        same = next((n for n, c in configs.items() if dataclasses.replace(c, name=base.name) == cfg), None)
        cfg = dataclasses.replace(cfg, name=same or "checkpoint")
        bad = [(k, fields[k], v) for k, v in overrides.items() if k in fields and v != fields[k]]
        other = "--set"
        cfg = select_config(model, configs, cfg, overrides)
    else:
        cfg = select_config(model, configs, config, overrides)
        other = str(getattr(config, "name", config))
        bad = [(k, v, getattr(cfg, k)) for k, v in fields.items() if getattr(cfg, k) != v]
    if bad:
        what = "--set" if config is None else f"config '{other}'{' with --set' if overrides else ''}"
        short = source.rsplit("/", 1)[-1]
        raise ValueError(f"{source} and {what} disagree on {len(bad)} field{'s' if len(bad) > 1 else ''}: "
                         + ", ".join(f"{k} ({short} {_show(a)}, {other} {_show(b)})" for k, a, b in bad))
    return cfg


def _show(v) -> str:
    return ",".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
