"""Typed configuration: YAML / dotlist overrides → keyword-only dataclasses.

In the llm-foundry style, a run is described by a YAML file plus `key=value`
overrides merged with OmegaConf, then validated *at the edge* into frozen,
keyword-only dataclasses. Everything after that point receives typed objects.
Unknown keys are errors that name the key and list the allowed ones; wrong
types name the key, the expected type and the value received.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

from omegaconf import OmegaConf

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value or key is invalid; the message names the key."""


TimeString = typing.NewType("TimeString", str)
"""A Composer time string (`100ba`, `2ep`, `5000sp`, `1e6tok`, `0.1dur`, `1h30m`): the type of
duration, interval and warmup keys. Checked where the config is loaded, so a typo is an error
naming the key rather than Composer's "Invalid time string" when the Trainer is built."""

_TIME_UNITS = ("iter", "ep", "ba", "sp", "tok", "dur", "sec")
_TIME_RE = re.compile(r"^(.+?)(" + "|".join(_TIME_UNITS) + r")$", re.IGNORECASE)
_WALL_CLOCK_RE = re.compile(r"^(\d+h)?(\d+m)?(\d+s)?$")
TIME_EXAMPLE = (
    "e.g. 100ba (batches) or 2ep (epochs); units: ba, ep, sp (samples), tok (tokens), dur "
    "(fraction)"
)


def check_time_string(value: Any, where: str) -> str:
    """`value` if Composer's `Time.from_timestring` accepts it (same grammar: a number and a unit,
    integral except for `dur`, or a wall-clock XhYmZs), else a ConfigError naming `where`."""
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected a time string, got {value!r} ({TIME_EXAMPLE})")
    v = value.strip()
    if v and _WALL_CLOCK_RE.match(v):
        return value
    m = _TIME_RE.match(v)
    try:
        number = float(m.group(1)) if m else None
    except ValueError:
        number = None
    if (
        number is None
        or not math.isfinite(number)
        or number < 0
        or (m.group(2).lower() != "dur" and number != int(number))
    ):
        raise ConfigError(f"{where}: {value!r} is not a time string ({TIME_EXAMPLE})")
    return value


def is_int(x: Any) -> bool:
    """An int that is not a bool: what config validation means by "an integer"."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: Any) -> bool:
    """An int or float that is not a bool."""
    return isinstance(x, int | float) and not isinstance(x, bool)


def _is_optional(tp: Any) -> tuple[bool, Any]:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) < len(typing.get_args(tp)):
            inner = args[0] if len(args) == 1 else Union[tuple(args)]  # noqa: UP007
            return True, inner
    return False, tp


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(tp: Any, value: Any, where: str) -> Any:
    optional, inner = _is_optional(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{where}: must not be null (expected {_type_name(inner)})")
    tp = inner
    if tp is TimeString:
        return check_time_string(value, where)
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping for {tp.__name__}, got {value!r}")
        return from_dict(tp, value, where=where)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{where}: {value!r} is not one of {list(allowed)}")
        return value
    if origin in (list, tuple, Sequence) or tp in (list, tuple):
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(f"{where}: expected {len(args)} items, got {len(value)}")
            return tuple(
                _coerce(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value))
            )
        item = args[0] if args else Any
        items = [_coerce(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple or tp is tuple else items
    if origin in (dict, Mapping) or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        args = typing.get_args(tp)
        vt = args[1] if len(args) == 2 else Any
        return {str(k): _coerce(vt, v, f"{where}.{k}") for k, v in value.items()}
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    if tp is Path:
        if not isinstance(value, (str, Path)):
            raise ConfigError(f"{where}: expected a path, got {value!r}")
        return Path(value)
    return value


def from_dict(cls: type[T], data: Mapping[str, Any], *, where: str = "") -> T:
    """Build dataclass `cls` from a mapping, rejecting unknown keys by name."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    prefix = f"{where}." if where else ""
    unknown = sorted(set(map(str, data)) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown config key {prefix}{unknown[0]!s}"
            + (f" (and {unknown[1:]})" if len(unknown) > 1 else "")
            + f"; allowed keys{' under ' + where if where else ''}: {sorted(fields)}"
        )
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(hints[name], value, f"{prefix}{name}")
    missing = [
        n
        for n, f in fields.items()
        if n not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"missing required config key {prefix}{missing[0]}")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{where or cls.__name__}: {e}") from None


def to_dict(obj: Any) -> Any:
    """Plain (JSON/YAML-serialisable) form of a config dataclass."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, Path):
        return str(obj)
    return obj


def load_config(
    cls: type[T],
    source: str | Path | Mapping[str, Any] | None = None,
    overrides: Sequence[str] = (),
) -> T:
    """Merge a YAML file (or mapping) with `key=value` overrides into `cls`."""
    if source is None:
        base = OmegaConf.create({})
    elif isinstance(source, Mapping):
        base = OmegaConf.create(dict(source))
    else:
        path = Path(source)
        if path.is_dir():
            yamls = sorted(q.name for q in path.glob("*.yaml"))[:6]
            raise ConfigError(
                f"config {path}: a directory, not a YAML file"
                + (f" (it holds {', '.join(yamls)})" if yamls else "")
            )
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            base = OmegaConf.load(path)
        except Exception as e:  # noqa: BLE001 — yaml errors come in several types
            raise ConfigError(f"{path}: cannot parse YAML ({e})") from None
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(f"override {ov!r} is not of the form key=value")
    try:
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist(list(overrides)))
        data = OmegaConf.to_container(merged, resolve=True)
    except Exception as e:  # noqa: BLE001 — OmegaConf raises many types; all become a ConfigError
        raise ConfigError(f"cannot resolve config: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError("config must be a mapping at the top level")
    return from_dict(cls, data)


def dump_yaml(obj: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(to_dict(obj)))


def check_selection(
    names: Sequence[str], select: Sequence[str], *, key: str, flag: str, noun: str, empty: str
) -> None:
    """A grid's named entries (`key`) and the subset `select` (given as `flag` on the command line):
    at least one entry, no name twice, every selected name known; errors name the key."""
    if not names:
        raise ConfigError(f"{key}: {empty}")
    dup = sorted({n for n in names if list(names).count(n) > 1})
    if dup:
        raise ConfigError(f"{key}: name(s) {dup} used twice")
    unknown = [n for n in select if n not in names]
    if unknown:
        raise ConfigError(
            f"select ({flag}): unknown {noun}(s) {unknown}; the config's {key}: {list(names)}"
        )
