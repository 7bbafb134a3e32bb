"""Flags generated from a config: one ``Setting`` per flag, read into the config and written back.

A ``Setting`` names its flag, the config field it sets (a dotted path into a dataclass config,
e.g. ``"train.schedule.lr"``), its ``--help`` section and its help. The flag's type and default
come from that field (``bool`` -> a boolean flag, ``int``/``float``/``str`` (``| None``) -> that
flag, ``list[int]`` -> a comma-separated list of integers, ``Sequence[str]``/``list[str]`` -> a
comma-separated list), so a setting is declared once. A flag whose
form differs from its field says so in the same declaration, both ways: ``to_config`` (flag
value -> field value) and ``to_flag`` (field value -> flag value). From one table:

- ``define`` defines the flags;
- ``read`` builds the config from the flags' values (the table walked, the parts built in order);
- ``args`` writes a config as the command line that reads back as it (``read(parse(args(cfg)))``).

Library code never sees flags: this module lives beside the scripts and only maps.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import sys
import textwrap
import typing
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Sequence

from absl import app, flags

FROM_CONFIG: Any = object()  # Setting.default: the config field's default, in flag form


def ints(values: Sequence[str], flag: str) -> list[int]:
    """A comma-separated flag as integers; ``app.UsageError`` naming the flag otherwise."""
    try:
        return [int(v) for v in values]
    except ValueError:
        raise app.UsageError(f"--{flag} must be a comma-separated list of integers, got {','.join(values)}") from None


@dataclass(frozen=True)
class Setting:
    """One flag and the config field it sets (module docstring). ``choices``: an enum flag;
    ``parser``: a custom absl parser (its type then is the parser's); ``default``: the flag's
    default where it differs from the field's (in flag form); ``to_config(value, flag_values)``
    and ``to_flag(value)``: the flag's form where it differs from the field's; ``defined_elsewhere``:
    a flag another module defines (shared with other scripts), read and written from here;
    ``upper_bound``: with ``lower_bound``, absl's range check; ``flag_kind``: the flag's kind
    where the field's type does not say it (e.g. ``"strings"``, a comma-separated list that
    ``to_config`` reads)."""

    flag: str
    path: str
    section: str
    help: str
    choices: Sequence[str] | None = None
    lower_bound: float | None = None
    default: Any = FROM_CONFIG
    to_config: Callable[[Any, flags.FlagValues], Any] | None = None
    to_flag: Callable[[Any], Any] | None = None
    parser: flags.ArgumentParser | None = None
    short_name: str | None = None
    case_sensitive: bool = True
    defined_elsewhere: bool = False
    upper_bound: float | None = None
    flag_kind: str | None = None


def field_of(config_cls: type, path: str) -> dataclasses.Field:
    """The dataclass field at ``path`` (``"train.schedule.lr"``) below ``config_cls``."""
    cls, field = config_cls, None
    for part in path.split("."):
        if cls is None:
            raise KeyError(path)
        field = {f.name: f for f in dataclasses.fields(cls)}[part]
        cls = _nested_class(cls, part)
    return field


def _nested_class(owner: type, name: str) -> type | None:
    """The config class of field ``name`` of ``owner``, or None when it holds no config."""
    hint = typing.get_type_hints(owner)[name]
    return hint if dataclasses.is_dataclass(hint) else None


def _class_at(config_cls: type, path: str) -> type:
    for part in filter(None, path.split(".")):
        config_cls = _nested_class(config_cls, part)
    return config_cls


def field_defaults(config_cls: type) -> SimpleNamespace:
    """Each field's default below ``config_cls`` (parts: theirs), by attribute as on a config: the
    ``defaults`` of ``define`` and ``args`` for a config whose own defaults do not validate (one
    with a required setting), built without constructing it. A field without a default holds None."""
    out = {}
    for f in dataclasses.fields(config_cls):
        nested = _nested_class(config_cls, f.name)
        if nested is not None:
            out[f.name] = field_defaults(nested)
        elif f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        else:
            out[f.name] = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
    return SimpleNamespace(**out)


def get(config: Any, path: str) -> Any:
    for part in path.split("."):
        config = getattr(config, part)
    return config


def kind(config_cls: type, setting: Setting) -> str:
    """The flag's kind: bool, int, float, str, list (of ints) or custom (``parser`` or declared converters)."""
    if setting.parser is not None:
        return "custom"
    if setting.flag_kind is not None:
        return setting.flag_kind
    annotation = str(field_of(config_cls, setting.path).type).replace(" | None", "")
    known = {"bool": "bool", "int": "int", "float": "float", "str": "str", "list[int]": "list",
             "list[str]": "strings", "Sequence[str]": "strings", "tuple[str, ...]": "strings"}
    if annotation in known:
        return known[annotation]
    if setting.to_config is None or setting.to_flag is None:
        raise TypeError(f"{setting.flag}: field {setting.path} is {annotation}; declare to_config and to_flag")
    return "custom"


def to_flag(config_cls: type, setting: Setting, value: Any) -> Any:
    """A field value in the flag's form."""
    if setting.to_flag is not None:
        return setting.to_flag(value)
    if kind(config_cls, setting) in ("list", "strings") and value is not None:
        return [str(v) for v in value]
    return value


def flag_default(config_cls: type, defaults: Any, setting: Setting) -> Any:
    return setting.default if setting.default is not FROM_CONFIG else \
        to_flag(config_cls, setting, get(defaults, setting.path))


def define(settings: Sequence[Setting], config_cls: type, defaults: Any, module_name: str,
           flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Defines the flag of each setting (but those ``defined_elsewhere``) under ``module_name``
    (so its --help lists them), typed and defaulted by the field of ``config_cls`` (``defaults``:
    an instance holding the defaults)."""
    for s in settings:
        if s.defined_elsewhere:
            continue
        default, common = flag_default(config_cls, defaults, s), {"flag_values": flag_values, "module_name": module_name}
        if s.short_name:
            common["short_name"] = s.short_name
        if s.parser is not None:
            flags.DEFINE(s.parser, s.flag, default, s.help, **common)
        elif s.choices is not None:
            flags.DEFINE_enum(s.flag, default, list(s.choices), s.help, case_sensitive=s.case_sensitive, **common)
        else:
            by_kind = {"bool": flags.DEFINE_boolean, "int": flags.DEFINE_integer, "float": flags.DEFINE_float,
                       "str": flags.DEFINE_string, "list": flags.DEFINE_list, "strings": flags.DEFINE_list,
                       "custom": flags.DEFINE_string}
            bound = {name: value for name, value in (("lower_bound", s.lower_bound), ("upper_bound", s.upper_bound))
                     if value is not None}
            by_kind[kind(config_cls, s)](s.flag, default, s.help, **bound, **common)


def read_values(settings: Sequence[Setting], config_cls: type, flag_values: flags.FlagValues) -> dict[str, Any]:
    """Each setting's field value (by path), from the flags, in the table's order."""
    out = {}
    for s in settings:
        value = flag_values[s.flag].value
        if s.to_config is not None:
            value = s.to_config(value, flag_values)
        elif kind(config_cls, s) == "list":
            value = ints(value, s.flag)
        elif kind(config_cls, s) == "strings":
            value = list(value)
        out[s.path] = value
    return out


def build(config_cls: type, values: dict[str, Any], order: Sequence[str] = ()) -> Any:
    """``config_cls`` from field values by dotted path: each part (``"data"``, ``"train.schedule"``)
    is built before what holds it, those in ``order`` first, so that a part's own checks
    (``__post_init__``) speak before the whole's."""
    prefixes = {p.rpartition(".")[0] for p in values if "." in p}
    rest = sorted(prefixes - set(order), key=lambda p: -p.count("."))
    built = dict(values)
    for prefix in [p for p in order if p in prefixes] + rest:  # ``order`` lists a part before what holds it
        owner, _, name = prefix.rpartition(".")
        cls = _nested_class(_class_at(config_cls, owner), name)
        own = {k.rpartition(".")[2]: built.pop(k) for k in list(built) if k.rpartition(".")[0] == prefix}
        built[prefix] = cls(**own)
    return config_cls(**built)


def args(settings: Sequence[Setting], config_cls: type, defaults: Any, config: Any) -> list[str]:
    """The command line that gives ``config`` back through ``read_values``/``build``: every
    setting spelled out, so no flag default or preset changes it. ``ValueError`` naming a setting
    whose value its flag cannot say."""
    out = []
    for s in settings:
        field_value = get(config, s.path)
        value = to_flag(config_cls, s, field_value)
        if value is None:
            if flag_default(config_cls, defaults, s) is not None:
                raise ValueError(f"`{s.path.rpartition('.')[2]}` {field_value!r}: --{s.flag} cannot say it")
            continue
        if isinstance(value, bool):
            out.append(f"--{s.flag}" if value else f"--no{s.flag}")
        elif isinstance(value, (list, tuple)):
            out.append(f"--{s.flag}={','.join(map(str, value))}")
        else:
            out.append(f"--{s.flag}={value}")
    return out


def parse(names: Sequence[str], args: Sequence[str], flag_values: flags.FlagValues = flags.FLAGS) -> flags.FlagValues:
    """``args`` parsed as the flags ``names`` of ``flag_values``, into copies of them (their values
    there stay as they are); ``flags.Error`` for a bad command line, ``ValueError`` for arguments
    that are no flags."""
    values = flags.FlagValues()
    for name in names:
        values[name] = copy.deepcopy(flag_values[name])
    rest = values([sys.argv[0], *args])[1:]
    if rest:
        raise ValueError(f"unexpected arguments: {' '.join(rest)}")
    return values


def shown(flag_values: flags.FlagValues, name: str) -> tuple[str, str]:
    """The flag ``name`` as a short ``--help`` shows it (its default, its choices) and its help
    without absl's choices prefix."""
    flag, text = flag_values[name], flag_values[name].help
    if flag.boolean:
        return f"--[no]{name}" + (" (on)" if flag.default else ""), text
    label = f"--{name}"
    if flag.default not in (None, "", []):
        default = flag.default_as_str.strip("'")
        label += f"={default if len(default) <= 24 else default[:20] + '...'}"
    if text.startswith("<") and ">: " in text:
        choices, text = text[1:].split(">: ", 1)
        label += f" ({choices})"
    return label, text


def first_sentence(text: str) -> str:
    """``text`` up to its first full stop, the one of an "e.g." or "i.e." not counted."""
    return re.split(r"(?<!\be\.g)(?<!\bi\.e)\. ", text)[0].rstrip(".")


def short_help(sections: Sequence[str], rows: Sequence[tuple[str, str, str]], width: int = 100,
               abbreviations: bool = False) -> str:
    """``rows`` of (section, flag as shown, help) grouped by ``sections``: each flag on one or two
    lines, its help's first sentence (``--helpfull`` keeps the whole text; ``abbreviations``: an
    "e.g. " or "i.e. " ends none, ``first_sentence``)."""
    out = []
    for section in sections:
        lines = [(shown, text) for sec, shown, text in rows if sec == section]
        if lines:
            out.append(f"\n{section}:")
        for shown, text in lines:
            first = first_sentence(text) if abbreviations else text.split(". ")[0].rstrip(".")
            out += textwrap.wrap(f"{shown}: {first}", width, initial_indent="  ", subsequent_indent="      ",
                                 max_lines=2, placeholder=" ...", break_on_hyphens=False)
    return "\n".join(out).lstrip("\n")
