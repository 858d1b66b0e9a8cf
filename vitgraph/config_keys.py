"""Config keys declared on their fields, and the one check that reads those declarations.

A section of the config (``vitgraph.config``, ``vitgraph.graphs.config``,
``vitgraph.data.augment``) is a dataclass; each field says next to its default what its value
may be and whether a resumed run may change it::

    pool: str = key("cls", choices=("cls", "mean"))
    lr: float = key(1e-3, above=0)
    log_every: int = key(50, above=0, resume_ok=True)

``check_section`` checks every field of a section (and of the sections inside it) against
its type and declaration and raises ``ConfigError`` naming the file, the key and the value.
Rules that relate keys to each other stay in ``vitgraph.config.validate``.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Optional

# the metadata entry of a dataclass field that holds its Key
META = "vitgraph.key"


class ConfigError(ValueError):
    """A config problem the user must fix; the message names the key and value."""


@dataclass(frozen=True)
class Key:
    """What a field's value may be (None: anything of its type), and whether a resumed run
    may change it."""
    choices: Optional[tuple] = None
    min: Optional[float] = None  # value >= min
    max: Optional[float] = None  # value <= max
    above: Optional[float] = None  # value > above
    below: Optional[float] = None  # value < below
    # a rule the value must pass, given the value and its section (for rules between the keys
    # of one section) ...
    check: Optional[Callable[[Any, Any], bool]] = None
    why: str = ""  # ... and what the error says when it does not
    resume_ok: bool = False

    def problem(self, value: Any, section: Any = None) -> Optional[str]:
        """Why ``value`` is not allowed, or None. A null value is the type check's matter."""
        if value is None:
            return None
        if self.choices is not None:
            if not any(type(value) is type(c) and value == c for c in self.choices):
                return f"must be one of {', '.join(map(yaml_value, self.choices))}" + _closest(
                    value, self.choices)
            return None
        low_ok = (self.min is None or value >= self.min) and \
            (self.above is None or value > self.above)
        high_ok = (self.max is None or value <= self.max) and \
            (self.below is None or value < self.below)
        if not (low_ok and high_ok):
            return f"must be {self.range_text()}"
        if self.check is not None and not self.check(value, section):
            return self.why
        return None

    def range_text(self) -> str:
        low = self.min if self.min is not None else self.above
        high = self.max if self.max is not None else self.below
        if high is None:
            if self.above == 0:
                return "positive"
            return f">= {self.min}" if self.min is not None else f"> {self.above}"
        if low is None:
            return f"<= {self.max}" if self.max is not None else f"< {self.below}"
        return (f"in {'[' if self.min is not None else '('}{low}, "
                f"{high}{']' if self.max is not None else ')'}")


def key(default: Any = dataclasses.MISSING, *, choices: Optional[tuple] = None,
        min: Optional[float] = None, max: Optional[float] = None,
        above: Optional[float] = None, below: Optional[float] = None,
        check: Optional[Callable[[Any, Any], bool]] = None, why: str = "",
        resume_ok: bool = False) -> Any:
    """A dataclass field with ``default`` whose value is checked by ``check_section``:
    one of ``choices``; within ``min`` / ``max`` (inclusive) and ``above`` / ``below``
    (exclusive); passing ``check(value, section)`` (``why`` is then the error).
    ``resume_ok``: a resumed run may change it (vitgraph.train.runcheck)."""
    if check is not None and not why:
        raise TypeError("key(check=...) needs why=... for its error message")
    return dataclasses.field(default=default, metadata={META: Key(
        choices=tuple(choices) if choices is not None else None, min=min, max=max,
        above=above, below=below, check=check, why=why, resume_ok=resume_ok)})


def declared(f: dataclasses.Field) -> Key:
    """The field's Key (an empty one for a field declared without ``key()``)."""
    return f.metadata.get(META) or Key()


def yaml_value(value: Any) -> str:
    """A value as it is written in YAML (and in a key=value override)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else str(value)


def _closest(value: Any, choices: tuple) -> str:
    names = [c for c in choices if isinstance(c, str)]
    close = difflib.get_close_matches(str(value), names, n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _types(hint) -> tuple[list, bool]:
    """The types a hint allows, and whether it allows None."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        return [a for a in args if a is not type(None)], type(None) in args
    return [hint], False


def _type_name(hint) -> str:
    """'an int', 'a bool or str'."""
    names = " or ".join(t.__name__ for t in _types(hint)[0])
    return ("an " if names[0] in "aeiou" else "a ") + names


def coerce(hint, value: Any, where: str) -> Any:
    """``value`` as the type ``hint`` names (a YAML string such as 5e-4 read as a float, an
    int as a float); ConfigError, after ``where`` (e.g. "file.yaml: train.steps"), if it is
    none of them."""
    allowed, optional = _types(hint)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{where} must be {_type_name(hint)}, got null")
    for t in allowed:
        if t is bool and isinstance(value, bool):
            return value
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if t is float:
            v = value
            if isinstance(v, str):  # YAML 1.1 reads 5e-4 (no dot) as a string
                try:
                    v = float(v)
                except ValueError:
                    continue
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                return float(v)
        if t in (str, list) and isinstance(value, t):
            return value
    raise ConfigError(f"{where} must be {_type_name(hint)}, got {value!r} "
                      f"({type(value).__name__})")


def coerce_field(f: dataclasses.Field, hint, value: Any, where: str) -> Any:
    """``coerce`` for the field ``f``; a field with choices takes its value as it is, for
    ``check_section`` to name the choices."""
    if declared(f).choices is not None and value is not None:
        return value
    return coerce(hint, value, where)


def check_section(section: Any, prefix: str, src: Optional[str] = None,
                  overrides: Optional[dict] = None) -> None:
    """Check every field of the dataclass ``section`` (whose keys start with ``prefix``, e.g.
    "graphs.") and of the sections inside it against its type and ``key()`` declaration.
    ``overrides``: dotted key -> the command line's ``key=value`` that set it (an error names
    that rather than the file)."""
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        name = prefix + f.name
        if dataclasses.is_dataclass(hints[f.name]):
            check_section(value, name + ".", src, overrides)
            continue
        spec = declared(f)
        coerce_field(f, hints[f.name], value, where(src, name, overrides))
        why = spec.problem(value, section)
        if why:
            raise ConfigError(f"{where(src, name, overrides)}={value!r}: {why}")


def where(src: Optional[str], name: str, overrides: Optional[dict] = None) -> str:
    """How an error names the key ``name``: 'override train.steps' when the command line set
    it (``overrides``), else '<src>: train.steps' (the file)."""
    if overrides and name in overrides:
        return f"override {name}"
    return f"{src}: {name}" if src else name


def resume_ok(cls: type, dotted: str) -> bool:
    """Whether a resumed run may change the key ``dotted`` (e.g. "train.steps") of the config
    dataclass ``cls``; False for a name that is no key."""
    *sections, name = dotted.split(".")
    for part in sections:
        hints = typing.get_type_hints(cls)
        if part not in hints or not dataclasses.is_dataclass(hints[part]):
            return False
        cls = hints[part]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    return name in fields and declared(fields[name]).resume_ok
