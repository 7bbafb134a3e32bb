"""The one rule for Triton model names, and the two ways a name leaves this program.

A model name becomes a directory in a model repository, the ``name:`` of a ``config.pbtxt`` and
a segment of the server's URLs (``v2/models/<name>/...``). Each place has its own dangers (``..``
and ``/`` in a path, a quote or newline in the config, ``?`` or ``%`` in a URL), so a name is
checked once, where it enters (a flag, a config field, an API argument), against Triton's own
rule, and written out through ``pbtxt_string`` or ``url_segment`` only.
"""

from __future__ import annotations

import re
import urllib.parse

MAX_NAME_LENGTH = 128
NAME_RULE = (f"1 to {MAX_NAME_LENGTH} characters from A-Z a-z 0-9 _ . -, not starting with a dot "
             "(Triton's model names; they become a directory, the config's name and a URL segment)")
_NAME = re.compile(rf"[A-Za-z0-9_-][A-Za-z0-9_.-]{{0,{MAX_NAME_LENGTH - 1}}}")
_SHOWN = 40  # characters of a refused value shown in a message


class ModelNameError(ValueError):
    """A model name (or version) outside the rule; the message names the setting and the rule."""


def shown(value: object) -> str:
    """``value`` as a message may quote it: ASCII on one line, at most about 40 characters, so
    that a hostile value can neither forge lines nor flood the terminal."""
    text = ascii(value)
    return text if len(text) <= _SHOWN else text[:_SHOWN] + f"... ({len(str(value))} characters)"


def is_model_name(name: object) -> bool:
    """Whether ``name`` follows the rule (``NAME_RULE``)."""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


def check_model_name(name: object, setting: str = "model_name") -> str:
    """``name`` if it follows the rule, else ``ModelNameError`` naming `setting` (a config field;
    the command line shows it as its flag) and the rule."""
    if not is_model_name(name):
        raise ModelNameError(f"`{setting}` {shown(name)} is not a model name: use {NAME_RULE}")
    return name


def check_version(version: object, setting: str = "version") -> int:
    """A model version: a whole number from 1 (Triton's version folders are positive integers)."""
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version < 2**63:
        raise ModelNameError(f"`{setting}` {shown(version)} is not a model version: use a whole number from 1")
    return version


def pbtxt_string(value: str) -> str:
    """``value`` as a protobuf text-format string literal, quotes included: backslash, quotes and
    every byte outside printable ASCII escaped (octal, of its UTF-8 encoding), so that no value
    can end the string, start a line or add a field."""
    out = []
    for byte in value.encode("utf-8"):
        char = chr(byte)
        if char in '"\\\'':
            out.append("\\" + char)
        elif 0x20 <= byte < 0x7F:
            out.append(char)
        else:
            out.append(f"\\{byte:03o}")
    return '"' + "".join(out) + '"'


def url_segment(name: str, setting: str = "model_name") -> str:
    """A checked model name as one URL path segment (``/``, ``?``, ``%`` and the rest quoted)."""
    return urllib.parse.quote(check_model_name(name, setting), safe="")


def model_path(name: str, version: int | None = None) -> str:
    """The server's path of a model (``v2/models/<name>[/versions/<version>]``), for messages and
    requests alike: the name checked and quoted, the version checked."""
    path = f"v2/models/{url_segment(name)}"
    return path if version is None else f"{path}/versions/{check_version(version)}"
