"""Config override values: the errors, and casting command-line text to the type of the value it replaces.

``opensora.config`` applies overrides; this module turns ``"1e-4"``, ``"true"``, ``"1,2,3"`` or ``"[1, 2]"`` into the
Python value the key's existing value (its template) calls for. A template of None parses a Python literal, and
text that is not one stays text.
"""

from __future__ import annotations

import ast
import copy
from typing import Any, Mapping

_TRUE_WORDS = frozenset({"true", "1", "yes"})
_FALSE_WORDS = frozenset({"false", "0", "no"})


class _BareFlag:
    """Marks an override given without a value (``--flag``): True for a bool key."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "BARE_FLAG"

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


BARE_FLAG = _BareFlag()


class ConfigKeyError(KeyError):
    """A config key that does not exist (and may not be created); the message names the nearest valid keys."""

    def __str__(self) -> str:  # KeyError would print the message inside quotes
        return str(self.args[0]) if self.args else ""


class ConfigValueError(ValueError):
    """An override whose value cannot be cast to the type of the key it sets, or a malformed command line."""


def _cast(value: Any, existing: Any, key: str) -> Any:
    """Cast an override to the type of ``existing``: strings are parsed, Python values checked."""
    if value is BARE_FLAG:
        if isinstance(existing, bool):
            return True
        raise ConfigValueError(
            f"--{key} needs a value (it holds {_a_type(existing)}): use --{key} VALUE or --{key}=VALUE"
        )
    if not isinstance(value, str):
        return _coerce(value, existing, key)
    if value.strip() == "None":
        return None
    if existing is None:
        return _parse_literal(value)
    if isinstance(existing, bool):  # before int: bool is an int subclass
        return _parse_bool(value, key)
    if isinstance(existing, int):
        return _parse_int(value, key)
    if isinstance(existing, float):
        return _parse_float(value, key)
    if isinstance(existing, str):
        return value
    if isinstance(existing, (list, tuple)):
        return _parse_sequence(value, existing, key)
    if isinstance(existing, dict):
        parsed = _literal_eval(value)
        if not isinstance(parsed, dict):
            raise ConfigValueError(f"config key '{key}' holds a dict; give a Python dict literal, got {value!r}")
        return parsed
    raise ConfigValueError(f"config key '{key}' holds {_a_type(existing)}, which cannot be set from the command line")


def _parse_bool(text: str, key: str) -> bool:
    word = text.strip().lower()
    if word in _TRUE_WORDS:
        return True
    if word in _FALSE_WORDS:
        return False
    raise ConfigValueError(f"config key '{key}' is a bool; expected true/false/1/0/yes/no, got {text!r}")


def _parse_int(text: str, key: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        pass
    try:  # "1e3" is a fine way to type a step count
        number = float(text)
    except ValueError:
        number = None
    if number is not None and number.is_integer():
        return int(number)
    raise ConfigValueError(f"config key '{key}' is an int; got {text!r}")


def _parse_float(text: str, key: str) -> float:
    try:
        return float(text.strip())
    except ValueError:
        raise ConfigValueError(f"config key '{key}' is a float; got {text!r}") from None


def _parse_sequence(text: str, existing: list | tuple, key: str) -> list | tuple:
    stripped = text.strip()
    if stripped.startswith(("[", "(")):
        parsed = _literal_eval(stripped)
        if not isinstance(parsed, (list, tuple)):
            raise ConfigValueError(f"config key '{key}' holds {_a_type(existing)}; got {text!r}")
        templates = _element_templates(existing, len(parsed))
        items = [_coerce(item, like, f"{key}[{i}]") for i, (item, like) in enumerate(zip(parsed, templates))]
    else:
        if any(isinstance(item, (list, tuple, dict)) for item in existing):
            raise ConfigValueError(
                f"config key '{key}' holds nested containers; give a Python literal such as [[1, 2], [3, 4]]"
            )
        pieces = [piece.strip() for piece in stripped.split(",")] if stripped else []
        if pieces and pieces[-1] == "":  # tolerate a trailing comma: "1,"
            pieces.pop()
        templates = _element_templates(existing, len(pieces))
        items = [_cast(piece, like, f"{key}[{i}]") for i, (piece, like) in enumerate(zip(pieces, templates))]
    return type(existing)(items)


def _element_templates(existing: list | tuple, count: int) -> list:
    """Values whose types ``count`` new elements take: the common type of the existing elements, position by
    position for a mixed sequence of the same length (``(1.0, 16)``), else None (parse as a literal)."""
    if existing and len({type(item) for item in existing}) == 1:
        return [existing[0]] * count
    if len(existing) == count:
        return list(existing)
    return [None] * count


def _coerce(value: Any, existing: Any, key: str) -> Any:
    """Check a Python value against the type of ``existing``; ints widen to floats, nothing else converts."""
    if value is None or existing is None:
        return value
    if isinstance(existing, bool):
        if isinstance(value, bool):
            return value
    elif isinstance(existing, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif isinstance(existing, int):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif isinstance(existing, (list, tuple)):
        if isinstance(value, (list, tuple)):
            templates = _element_templates(existing, len(value))
            return type(existing)(
                _coerce(item, like, f"{key}[{i}]") for i, (item, like) in enumerate(zip(value, templates))
            )
    elif isinstance(existing, dict):
        if isinstance(value, Mapping):
            return _plain(value)
    elif isinstance(value, type(existing)):
        return value
    raise ConfigValueError(f"config key '{key}' holds {_a_type(existing)}; got {value!r} ({type(value).__name__})")


def _parse_new_value(value: Any) -> Any:
    if value is BARE_FLAG:
        return True
    if isinstance(value, str):
        return _parse_literal(value)
    return _plain(value) if isinstance(value, Mapping) else value


def _parse_literal(text: str) -> Any:
    """A Python literal if ``text`` is one (true/false too), else the text itself."""
    word = text.strip().lower()
    if word in ("true", "false"):
        return word == "true"
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text


def _literal_eval(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as error:
        raise ConfigValueError(f"not a Python literal: {text!r} ({error})") from None


def _a_type(value: Any) -> str:
    name = type(value).__name__
    return ("an " if name[0] in "aeiou" else "a ") + name


def _plain(mapping: Mapping) -> dict:
    """A plain nested dict (ConfigDicts converted) so overrides never touch the caller's objects."""
    to_dict = getattr(mapping, "to_dict", None)
    return copy.deepcopy(to_dict() if callable(to_dict) else dict(mapping))
