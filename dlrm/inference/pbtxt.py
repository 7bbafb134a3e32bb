"""Reads a generated ``config.pbtxt`` back, so that a deploy never leaves a config that says
something other than what was asked for (or that the server cannot parse).

With ``tritonclient`` installed (the ``serving`` extra) the text is parsed as Triton's own
``ModelConfig`` protobuf. Without it a strict reader of the subset the deployer writes takes its
place: known keys only, balanced braces and brackets, quoted strings with protobuf escapes.
Either way the key fields come back as a ``ConfigSummary`` for comparison.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

# Every key the deployer writes, at any depth.
KNOWN_KEYS = frozenset({
    "name", "platform", "backend", "default_model_filename", "max_batch_size", "input", "output", "data_type",
    "dims", "dynamic_batching", "preferred_batch_size", "max_queue_delay_microseconds", "instance_group", "kind",
    "count", "gpus", "parameters", "key", "value", "string_value",
})
_TOKEN = re.compile(r"""\s+|\#[^\n]*|(?P<str>"(?:[^"\\\n]|\\(?:[0-7]{1,3}|x[0-9A-Fa-f]{1,2}|[nrt"'\\abfv?]))*")"""
                    r"|(?P<num>-?[0-9]+)|(?P<id>[A-Za-z_][A-Za-z0-9_]*)|(?P<punct>[{}\[\]:,])")
_ESCAPE = re.compile(r"""\\([0-7]{1,3}|x[0-9A-Fa-f]{1,2}|[nrt"'\\abfv?])""")
_SIMPLE = {"n": "\n", "r": "\r", "t": "\t", "a": "\a", "b": "\b", "f": "\f", "v": "\v"}


class ConfigCheckError(ValueError):
    """A generated config that does not parse back, or says something else than intended."""


@dataclass
class ConfigSummary:
    """The fields of a config that decide what the server serves."""

    name: str = ""
    platform: str = ""
    backend: str = ""
    default_model_filename: str = ""
    max_batch_size: int = 0
    inputs: list[tuple[str, str, list[int]]] = field(default_factory=list)  # (name, data type, dims)
    outputs: list[tuple[str, str, list[int]]] = field(default_factory=list)
    parameters: dict[str, str] = field(default_factory=dict)


def _unescape(literal: str) -> str:
    """The value of a quoted string token (its escapes stand for bytes of UTF-8 text)."""
    def byte(match: re.Match) -> str:
        code = match.group(1)
        if code[0] in "01234567":
            return chr(int(code, 8) & 0xFF)
        if code[0] == "x":
            return chr(int(code[1:], 16))
        return _SIMPLE.get(code, code)

    raw = _ESCAPE.sub(byte, literal[1:-1])
    try:
        return raw.encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        raise ConfigCheckError("a string is not UTF-8 text") from None


def _tokens(text: str) -> list[tuple[str, str]]:
    tokens, pos = [], 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None:
            raise ConfigCheckError(f"unexpected character at offset {pos}")
        if match.lastgroup is not None:
            tokens.append((match.lastgroup, match.group(match.lastgroup)))
        pos = match.end()
    return tokens + [("end", "")]


class _Reader:
    """Recursive descent over the tokens: message := (key [':'] value [','])*."""

    def __init__(self, text: str) -> None:
        self.tokens, self.pos = _tokens(text), 0

    def peek(self) -> tuple[str, str]:
        return self.tokens[self.pos]

    def take(self, kind: str, value: str | None = None) -> str:
        got_kind, got = self.tokens[self.pos]
        if got_kind != kind or (value is not None and got != value):
            raise ConfigCheckError(f"expected {value or kind} at token {self.pos}, got {got_kind}")
        self.pos += 1
        return got

    def message(self, closing: str) -> list[tuple[str, Any]]:
        fields = []
        while self.peek() != (("end", "") if closing == "" else ("punct", closing)):
            key = self.take("id")
            if key not in KNOWN_KEYS:
                raise ConfigCheckError(f"unknown key {key[:40]!r}")
            colon = self.peek() == ("punct", ":")
            if colon:
                self.pos += 1
            value = self.value()
            if not colon and not isinstance(value, list | tuple):
                raise ConfigCheckError(f"{key}: a scalar needs ':'")
            fields.append((key, value))
            if self.peek() == ("punct", ","):
                self.pos += 1
        return fields

    def value(self) -> Any:
        kind, token = self.peek()
        if (kind, token) == ("punct", "{"):
            self.pos += 1
            fields = self.message("}")
            self.take("punct", "}")
            return tuple(fields)  # a message
        if (kind, token) == ("punct", "["):
            self.pos += 1
            items = []
            while self.peek() != ("punct", "]"):
                items.append(self.value())
                if self.peek() == ("punct", ","):
                    self.pos += 1
            self.take("punct", "]")
            return items
        self.pos += 1
        if kind == "str":
            return _unescape(token)
        if kind == "num":
            return int(token)
        if kind == "id":
            return token
        raise ConfigCheckError(f"unexpected {token or 'end of text'!r} at token {self.pos - 1}")


def _flat(fields: list[tuple[str, Any]], key: str) -> list[Any]:
    """Every value of ``key``, repeated fields and ``key: [a, b]`` lists alike."""
    out: list[Any] = []
    for name, value in fields:
        if name == key:
            out.extend(value if isinstance(value, list) else [value])
    return out


def _one(fields: list[tuple[str, Any]] | tuple, key: str, default: Any) -> Any:
    values = _flat(list(fields), key)
    if len(values) > 1:
        raise ConfigCheckError(f"{key} is given {len(values)} times")
    return values[0] if values else default


def _tensors(fields: list[tuple[str, Any]], key: str) -> list[tuple[str, str, list[int]]]:
    tensors = []
    for tensor in _flat(fields, key):
        if not isinstance(tensor, tuple):
            raise ConfigCheckError(f"{key} is not a message")
        tensors.append((_one(tensor, "name", ""), _one(tensor, "data_type", "TYPE_INVALID"),
                        [int(d) for d in _flat(list(tensor), "dims")]))
    return tensors


def read_subset(text: str) -> ConfigSummary:
    """The summary of ``text`` by the strict reader of the deployer's subset."""
    reader = _Reader(text)
    fields = reader.message("")
    parameters = {}
    for entry in _flat(fields, "parameters"):
        value = _one(entry, "value", ())
        parameters[_one(entry, "key", "")] = _one(value, "string_value", "")
    return ConfigSummary(
        name=_one(fields, "name", ""), platform=_one(fields, "platform", ""), backend=_one(fields, "backend", ""),
        default_model_filename=_one(fields, "default_model_filename", ""),
        max_batch_size=_one(fields, "max_batch_size", 0), inputs=_tensors(fields, "input"),
        outputs=_tensors(fields, "output"), parameters=parameters,
    )


def read_protobuf(text: str) -> ConfigSummary | None:
    """The summary of ``text`` parsed as Triton's ``ModelConfig``, or None without tritonclient."""
    try:
        from google.protobuf import text_format
        from tritonclient.grpc import model_config_pb2
    except ImportError:
        return None
    try:
        config = text_format.Parse(text, model_config_pb2.ModelConfig())
    except text_format.ParseError as e:
        raise ConfigCheckError(f"not a Triton ModelConfig ({str(e)[:120]})") from None

    def tensors(items: Any) -> list[tuple[str, str, list[int]]]:
        return [(t.name, model_config_pb2.DataType.Name(t.data_type), list(t.dims)) for t in items]

    return ConfigSummary(
        name=config.name, platform=config.platform, backend=config.backend,
        default_model_filename=config.default_model_filename, max_batch_size=config.max_batch_size,
        inputs=tensors(config.input), outputs=tensors(config.output),
        parameters={k: v.string_value for k, v in config.parameters.items()},
    )


def read_config(text: str) -> ConfigSummary:
    """The key fields of a ``config.pbtxt``: by protobuf where it is installed, else by the subset."""
    summary = read_protobuf(text)
    return summary if summary is not None else read_subset(text)


def check_config(text: str, intended: ConfigSummary) -> None:
    """Raise ``ConfigCheckError`` unless ``text`` parses back to ``intended``, naming the first
    field that differs (by name only: values may be hostile)."""
    got = read_config(text)
    for name in intended.__dataclass_fields__:
        if getattr(got, name) != getattr(intended, name):
            raise ConfigCheckError(f"its {name} reads back differently from what was written")
