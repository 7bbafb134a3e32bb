"""A typed config checked again when a job starts, not only when it was built.

Both products' configs are dataclasses that check themselves in ``__post_init__``, and they are
not frozen: ``cfg.batch_size = 0`` after construction is checked by nothing. ``rechecked``
builds the config again from its values, each part before the config that holds it, so every
``__post_init__`` runs on the values the job will use, and a setting changed after
construction is refused as it would have been at construction (the same message, naming the
setting). Each product's API calls it on the config it is given.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

Config = TypeVar("Config")


def rechecked(cfg: Config, **changes: Any) -> Config:
    """``cfg`` built again (``dataclasses.replace``, parts first) with ``changes`` to its own
    fields: a new object, equal to ``cfg`` without changes, checked as at construction. The
    caller's config is not changed."""
    parts = {f.name: rechecked(value) for f in dataclasses.fields(cfg)  # type: ignore[arg-type]
             if f.init and f.name not in changes and dataclasses.is_dataclass(value := getattr(cfg, f.name))
             and not isinstance(value, type)}
    return dataclasses.replace(cfg, **parts, **changes)  # type: ignore[type-var]
