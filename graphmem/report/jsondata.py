"""One typed codec between graphmem's frozen dataclasses and JSON: ``to_json(value, hint)`` and
``from_json(hint, data)``, with ``from_json(T, to_json(x, T)) == x`` for the values a Report holds
(graphmem/report/__init__.py ``Report.from_dict``).

The declared field types drive the way back: a ``tuple[int, ...]`` field comes back a tuple, a
``dict[int, ...]`` one with integer keys, a nested dataclass as that class. Where the declared type
does not name the class (``Any``, a Protocol, a union of classes) the value carries
``"__type__": "module:Class"``; only graphmem's own modules are imported for it. What JSON has no
form for is tagged: ``{"__fraction__": "1/3"}``, ``{"__frozenset__": [...]}``, ``{"__items__":
[[key, value], ...]}`` (a dict whose keys are not strings), ``{"__list__": [...]}`` (a list where the
declared type does not say so), ``{"__sympy__": "2*b*s + 8"}`` and ``{"__object__": ...}`` (a plain
graphmem object such as passes/coefficients.py's PeakModel, by its attributes).

>>> from graphmem.passes.saved import ModuleSaved
>>> from_json(ModuleSaved, to_json(ModuleSaved("h.0", 4096, 0, 2), ModuleSaved))
ModuleSaved(path='h.0', activation_bytes=4096, self_bytes=0, count=2)
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import re
import sys
import types
import typing
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Union

from graphmem.errors import UsageError
from graphmem.jsontypes import JSON

if TYPE_CHECKING:
    import sympy

TYPE = "__type__"
_SYMPY_TEXT = re.compile(r"^[\w\s*+\-/().]*$")  # a polynomial's text: names, numbers, + - * / ** ( )
_CALL = re.compile(r"__|[A-Za-z_]\w*\s*\(")  # no dunder, no call: a polynomial calls nothing


def to_json(value: object, hint: object = Any) -> JSON:
    """``value`` as JSON (dicts, lists, strings, numbers, None); ``hint``: its declared type."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Fraction):
        return {"__fraction__": str(value)}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict[str, JSON] = {} if type(value) is _concrete(hint) else {TYPE: _name(type(value))}
        hints = _hints(type(value))
        for f in dataclasses.fields(value):
            if f.init and f.metadata.get("json", True):  # json=False: a live handle (a Trainer), left out
                out[f.name] = to_json(getattr(value, f.name), hints.get(f.name, Any))
        return out
    if isinstance(value, (frozenset, set)):
        return {"__frozenset__": [to_json(v, _args(hint, 0)) for v in sorted(value, key=repr)]}
    if isinstance(value, tuple):
        return [to_json(v, _element(hint, i)) for i, v in enumerate(value)]
    if isinstance(value, list):
        items = [to_json(v, _element(hint, i)) for i, v in enumerate(value)]
        return items if typing.get_origin(hint) is list else {"__list__": items}
    if isinstance(value, dict):
        key, val = _args(hint, 0), _args(hint, 1)
        if all(isinstance(k, str) for k in value) and not ({TYPE, "__items__"} & value.keys()):
            return {k: to_json(v, val) for k, v in value.items()}
        return {"__items__": [[to_json(k, key), to_json(v, val)] for k, v in value.items()]}
    if type(value).__module__.split(".")[0] == "sympy":
        return {"__sympy__": str(value)}
    if type(value).__module__.startswith("graphmem."):
        return {"__object__": _name(type(value)), "state": to_json(dict(vars(value)))}
    raise TypeError(f"no JSON form for {type(value).__name__}")


def from_json(hint: object, data: Any) -> Any:
    """The value ``to_json(value, hint)`` wrote (``data``: JSON as read, unchecked: a malformed report fails here
    with TypeError/KeyError, which ``Report.from_dict`` turns into one line; the value: what ``hint`` names)."""
    if isinstance(data, dict):
        tagged = _tagged(data)
        if tagged is not _UNTAGGED:
            return tagged
    if data is None:
        return None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        kinds = [a for a in args if a is not type(None)]
        return from_json(kinds[0] if len(kinds) == 1 else Any, data)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _build(hint, data)
    if hint is Fraction:
        return Fraction(data)
    if origin is tuple or hint is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(from_json(args[0], v) for v in data)
        return tuple(from_json(args[i] if i < len(args) else Any, v) for i, v in enumerate(data))
    if origin is list:
        return [from_json(args[0] if args else Any, v) for v in data]
    if origin is dict or hint is dict:
        return {k: from_json(args[1] if args else Any, v) for k, v in data.items()}
    if isinstance(data, list):  # Any: a tuple (lists are tagged)
        return tuple(from_json(Any, v) for v in data)
    if isinstance(data, dict):
        return {k: from_json(Any, v) for k, v in data.items()}
    return data


_UNTAGGED = object()


def _tagged(data: dict[str, Any]) -> object:
    """A tagged value's own decoding, or _UNTAGGED (``data``: as read, unchecked, as ``from_json``'s)."""
    if TYPE in data:
        return _build(_resolve(data[TYPE]), data)
    if "__fraction__" in data:
        return Fraction(data["__fraction__"])
    if "__frozenset__" in data:
        return frozenset(from_json(Any, v) for v in data["__frozenset__"])
    if "__list__" in data:
        return [from_json(Any, v) for v in data["__list__"]]
    if "__items__" in data:
        return {from_json(Any, k): from_json(Any, v) for k, v in data["__items__"]}
    if "__sympy__" in data:
        return _sympy(data["__sympy__"])
    if "__object__" in data:
        obj: object = object.__new__(_resolve(data["__object__"]))
        obj.__dict__.update(from_json(dict[str, Any], data["state"]))
        return obj
    return _UNTAGGED


def _build(cls: type, data: dict[str, Any]) -> object:
    hints = _hints(cls)
    values = {f.name: from_json(hints.get(f.name, Any), data[f.name])
              for f in dataclasses.fields(cls) if f.init and f.name in data}
    return cls(**values)


def _sympy(text: str) -> sympy.Basic:
    import sympy  # only when a formula is read back

    if not _SYMPY_TEXT.match(text) or _CALL.search(text):
        raise UsageError(f"not a polynomial in a saved report: {text[:60]!r}; analyze the model again")
    return sympy.sympify(text)


def _name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _resolve(name: str) -> type:
    module, _, qual = str(name).partition(":")
    if not (module == "graphmem" or module.startswith("graphmem.")) or not qual:
        raise UsageError(f"a saved report names {name!r}, not a graphmem class; write it with Report.to_dict()")
    obj: object = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part, None)
    if not isinstance(obj, type):
        raise UsageError(f"a saved report names {name!r}, which this graphmem does not have; analyze the model again")
    return obj


@functools.cache
def _hints(cls: type) -> dict[str, object]:
    """The dataclass's field types, evaluated; a field whose type names what its module imports
    only for type checking is Any (its value carries its own ``__type__``)."""
    try:
        return typing.get_type_hints(cls)
    except (NameError, TypeError):
        pass
    space = {**vars(typing), **vars(sys.modules[cls.__module__])}
    out: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        try:
            out[f.name] = eval(f.type, space) if isinstance(f.type, str) else f.type  # noqa: S307 (annotations)
        except (NameError, TypeError, AttributeError):
            out[f.name] = Any
    return out


def _concrete(hint: object) -> object:
    """The one class a declared type names (Optional[X] -> X), else None."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        kinds = [a for a in typing.get_args(hint) if a is not type(None)]
        return kinds[0] if len(kinds) == 1 else None
    return hint if isinstance(hint, type) else None


def _args(hint: object, i: int) -> object:
    args = typing.get_args(_concrete_generic(hint))
    return args[i] if len(args) > i else Any


def _element(hint: object, i: int) -> object:
    args = typing.get_args(_concrete_generic(hint))
    if len(args) == 2 and args[1] is Ellipsis:
        return args[0]
    return args[i] if i < len(args) else (args[0] if len(args) == 1 else Any)


def _concrete_generic(hint: object) -> object:
    if typing.get_origin(hint) in (Union, types.UnionType):
        kinds = [a for a in typing.get_args(hint) if a is not type(None)]
        return kinds[0] if len(kinds) == 1 else Any
    return hint


def field_types(cls: type) -> dict[str, object]:
    """A dataclass's field types, evaluated (what ``from_json`` rebuilds its fields as)."""
    return dict(_hints(cls))


__all__ = ["field_types", "from_json", "to_json"]
