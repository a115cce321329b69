"""Named model configs with field overrides, shared by every model file."""
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
