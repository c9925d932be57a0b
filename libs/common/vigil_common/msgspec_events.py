"""The high-volume events' msgspec structs, derived from their pydantic model.

Every rank sends a `StepCompleted` per step: telemetry stores each one and the guardian judges each one,
and pydantic's validation was most of what either spent on a message. `struct_of` derives a msgspec
struct from the pydantic model, field by field (types, defaults, bounds, patterns), so the model stays
the one definition of the event; a field or constraint it cannot translate is a TypeError at the first
use, never a silent difference. The bus decodes with it (`vigil_common.bus.decoding.FastDecoder`) and
builds the pydantic event without a second validation (`built`); what msgspec refuses goes to pydantic
(`vigil.events.decode`), which upgrades an older version or names the field that is wrong. So
msgspec only has to accept a subset of what pydantic accepts, with the same values
(`tests/unit/common/test_msgspec_events.py` checks both on generated messages).
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from typing import Annotated, Any, Literal, Union

import msgspec
from pydantic import AwareDatetime, BaseModel
from pydantic.fields import FieldInfo

# How the events serialize a non-finite float (`ser_json_inf_nan="strings"`); pydantic reads them back
# with float(). A second struct accepts them on the float fields that have no bounds, for the payloads
# that hold one (the union costs a third more to decode: the common case goes without it).
_NONFINITE = Literal["NaN", "Infinity", "-Infinity"]
# An aware datetime as RFC 3339 text with at most microseconds, parsed by `datetime.fromisoformat`:
# msgspec's own datetime rounds a seventh fractional digit where pydantic truncates it (the property test
# found it). Anything else (more digits, a space for the T, no offset) goes to pydantic.
_RFC3339 = r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,6})?(Z|[+-]\d{2}:\d{2})\Z"
_AWARE = Annotated[str, msgspec.Meta(pattern=_RFC3339)]
_CONSTRAINTS = ("ge", "gt", "le", "lt", "min_length", "max_length", "pattern")


_setattr = object.__setattr__


def built(model: type[BaseModel], values: dict[str, Any]) -> BaseModel:
    """`model.model_construct(**values)` for values already checked, with all of `model`'s fields: what
    it sets, without its per-field loop (5 us a step event, more than pydantic's whole validation).
    pydantic's own names, in this one place (a test compares the result with model_construct's)."""
    event = model.__new__(model)
    _setattr(event, "__dict__", values)
    _setattr(event, "__pydantic_fields_set__", set(values))
    _setattr(event, "__pydantic_extra__", None)
    _setattr(event, "__pydantic_private__", None)
    return event


def struct_of(model: type[BaseModel], *, nonfinite: bool = False) -> type[msgspec.Struct]:
    """A msgspec struct with `model`'s fields, defaults and constraints, refusing unknown fields;
    `nonfinite`: its unbounded floats also take "NaN", "Infinity" and "-Infinity"."""
    return derive(model, nonfinite=nonfinite)[0]


def derive(
    model: type[BaseModel], *, nonfinite: bool
) -> tuple[type[msgspec.Struct], tuple[str, ...], tuple[str, ...]]:
    """The struct, the float fields that may hold a non-finite number's string, and the datetime fields
    (decoded as RFC 3339 text)."""
    decorators = model.__pydantic_decorators__
    own = (decorators.validators, decorators.field_validators, decorators.root_validators)
    if any(own) or decorators.model_validators or decorators.computed_fields:
        raise TypeError(f"{model.__name__} has validators of its own: no struct can be derived from it")
    if model.model_config.get("extra") != "forbid":
        raise TypeError(f"{model.__name__} does not forbid extra fields: no struct can be derived from it")
    fields: list[tuple[str, Any, Any]] = []
    floats: list[str] = []
    datetimes: list[str] = []
    for name, info in model.model_fields.items():
        where = f"{model.__name__}.{name}"
        if info.alias not in (None, name) or info.validation_alias not in (None, name):
            raise TypeError(f"{where}: an alias cannot be derived")
        tp = _type(info.annotation, _constraints(info.metadata, where), where, nonfinite)
        if _has_arm(tp, _NONFINITE):
            floats.append(name)
        if _has_arm(tp, _AWARE):
            datetimes.append(name)
        if info.is_required():
            default: Any = msgspec.NODEFAULT
        elif info.default_factory is not None:
            default = msgspec.field(default_factory=info.default_factory)  # type: ignore[arg-type]
        else:
            default = info.default
        fields.append((name, tp, default))
    struct = msgspec.defstruct(
        f"{model.__name__}{'NonFinite' if nonfinite else ''}Struct",
        fields,
        kw_only=True,
        forbid_unknown_fields=True,
        module=__name__,
    )
    return struct, tuple(floats), tuple(datetimes)


def _constraints(metadata: typing.Iterable[Any], where: str) -> dict[str, Any]:
    """The bounds, lengths and pattern `metadata` holds (annotated-types objects, pydantic's
    StringConstraints or general metadata); TypeError for any other setting (a validator, strictness,
    `allow_inf_nan`, ...), which the struct would not check."""
    found: dict[str, Any] = {}
    for item in metadata:
        if isinstance(item, FieldInfo):
            found.update(_constraints(item.metadata, where))
            continue
        if dataclasses.is_dataclass(item):
            attrs = {f.name: getattr(item, f.name) for f in dataclasses.fields(item)}
        else:
            attrs = dict(getattr(item, "__dict__", {}))
        attrs = {k: v for k, v in attrs.items() if v is not None}
        if not attrs or set(attrs) - set(_CONSTRAINTS):
            raise TypeError(f"{where}: constraint {item!r} cannot be derived")
        found.update(attrs)
    if "pattern" in found:
        found["pattern"] = _whole_string(found["pattern"])
    return found


def _whole_string(pattern: str) -> str:
    """`pattern` as msgspec must read it to match what pydantic's (Rust) regex does: a final `$` matches
    only at the end (Python's `$` also matches before a final newline)."""
    if pattern.endswith("$") and not pattern.endswith("\\$"):
        pattern = pattern[:-1] + r"\Z"
    re.compile(pattern)
    return pattern


def _type(tp: Any, constraints: dict[str, Any], where: str, nonfinite: bool) -> Any:
    """The msgspec type of a pydantic annotation with its constraints."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        base, *metadata = typing.get_args(tp)
        return _type(base, {**constraints, **_constraints(metadata, where)}, where, nonfinite)
    if origin in (Union, types.UnionType):
        arms = [
            a if a is type(None) else _type(a, constraints, where, nonfinite) for a in typing.get_args(tp)
        ]
        return Union[tuple(arms)]  # noqa: UP007 (a runtime union of computed arms)
    if origin is Literal:
        if constraints:
            raise TypeError(f"{where}: a constrained Literal cannot be derived")
        return tp
    if tp is AwareDatetime:
        if constraints:
            raise TypeError(f"{where}: a constrained datetime cannot be derived")
        return _AWARE
    if tp is float and not constraints and nonfinite:
        return Union[float, _NONFINITE]  # noqa: UP007
    if tp in (int, float, str, bool):
        if tp is bool and constraints:
            raise TypeError(f"{where}: a constrained bool cannot be derived")
        return Annotated[tp, msgspec.Meta(**constraints)] if constraints else tp
    raise TypeError(f"{where}: type {tp!r} cannot be derived")


def _has_arm(tp: Any, arm: Any) -> bool:
    """`tp` is `arm`, or a union holding it."""
    if tp == arm:
        return True
    return typing.get_origin(tp) in (Union, types.UnionType) and any(
        _has_arm(a, arm) for a in typing.get_args(tp)
    )
