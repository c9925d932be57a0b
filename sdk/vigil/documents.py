"""Untrusted YAML and JSON documents (job specs), parsed at a bounded cost.

A request body of up to `VIGIL_MAX_BODY_BYTES` must never cost more than a small, known amount of
time and memory, nor blow the stack. So, before anything is built, one pass over the parser's
events (libyaml's C parser when present) counts nodes, alias expansions and nesting depth, refuses
duplicate keys naming where they are, and gives up past a time budget; only then is the document
constructed. JSON goes through the standard decoder, with the same limits checked afterwards and
duplicate keys refused too.

A scalar that YAML's constructors cannot build (`2001-13-14` read as a date, `!!int 0b`) is refused
naming its field, and so is a number longer than MAX_NUMBER_CHARS in either format (a decimal number
past 4,300 digits is refused by `int()` itself; a sexagesimal one like `1:0:0:...` costs quadratic
time to build).
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import yaml

MAX_DEPTH = 32  # a job spec nests four levels deep
MAX_NODES = 10_000  # a job spec with 64 faults has about 600
MAX_SECONDS = 2.0  # far above what MAX_NODES costs; a guard against a pathological scanner input
MAX_NUMBER_CHARS = 100  # the largest number a spec takes has 10 digits


class DocumentError(ValueError):
    """The document is not one Vigil reads; `field` says where (`train.steps`, or `(spec)`)."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(message)


class _Unbuildable(Exception):
    """A node that its constructor refused: `node` is where, the cause says why."""

    def __init__(self, node: yaml.Node) -> None:
        self.node = node


class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """The safe loader (libyaml's C parser when PyYAML has it), reading `3e-4` as a float as YAML 1.2
    and JSON do (YAML 1.1 wants `3.0e-4`), since the spec takes no string where a number is due.
    A node its constructor fails on raises `_Unbuildable` naming it, whatever the constructor raised."""

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except (yaml.YAMLError, _Unbuildable):
            raise
        except Exception as exc:  # ValueError, TypeError, KeyError, AttributeError, ...: the node's value
            raise _Unbuildable(node) from exc

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        _check_number_length(node.value)
        return super().construct_yaml_int(node)  # type: ignore[no-any-return]

    def construct_yaml_float(self, node: yaml.ScalarNode) -> float:
        _check_number_length(node.value)
        return super().construct_yaml_float(node)  # type: ignore[no-any-return]


def _check_number_length(text: str) -> None:
    if len(text) > MAX_NUMBER_CHARS:
        raise ValueError(f"a number of more than {MAX_NUMBER_CHARS} characters")


_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)
_Loader.add_constructor("tag:yaml.org,2002:float", _Loader.construct_yaml_float)
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load(text: str, *, json_only: bool = False) -> Any:
    """The document in `text` (YAML, of which JSON is a subset; or JSON alone with `json_only`).

    Raises DocumentError for a malformed document, a duplicate key, one past the limits, or a value
    that cannot be built (naming its field)."""
    if json_only:
        return _load_json(text)
    _check_yaml_events(text)
    loader = _Loader(text)
    root = None
    try:
        root = loader.get_single_node()
        return None if root is None else loader.construct_document(root)  # a safe loader (SafeConstructor)
    except yaml.YAMLError as exc:
        raise _yaml_error(exc) from exc
    except _Unbuildable as exc:
        raise _unbuildable(root, exc) from exc.__cause__
    finally:
        loader.dispose()


def _yaml_error(exc: yaml.YAMLError) -> DocumentError:
    if "maximum nesting depth" in str(exc):  # PyYAML >= 6.0.3 stops deep flow collections itself
        return DocumentError("(spec)", f"nested deeper than {MAX_DEPTH} levels")
    return DocumentError("(spec)", f"not valid YAML or JSON: {exc}")


def _unbuildable(root: yaml.Node | None, exc: _Unbuildable) -> DocumentError:
    node, cause = exc.node, exc.__cause__
    where = _where(_path_to(root, node)) if root is not None else "(spec)"
    kind = node.tag.rsplit(":", 1)[-1]
    value = node.value if isinstance(node, yaml.ScalarNode) else f"a {kind}"
    if isinstance(value, str) and len(value) > 40:
        value = value[:40] + "..."
    why = f" ({cause})" if isinstance(cause, ValueError) and len(str(cause)) < 200 else ""
    return DocumentError(
        where,
        f"{where}: {value!r} cannot be read as a YAML {kind}{why}; quote it if it is meant as text "
        f"(line {node.start_mark.line + 1})",
    )


def _path_to(root: yaml.Node, target: yaml.Node) -> list[str | int]:
    """Where `target` sits under `root` (keys and indexes), walked without recursion; a node reached
    through an alias is found at its first place."""
    todo: list[tuple[yaml.Node, list[str | int]]] = [(root, [])]
    seen: set[int] = set()
    while todo:
        node, path = todo.pop()
        if node is target:
            return path
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for key, value in reversed(node.value):
                name = key.value if isinstance(key, yaml.ScalarNode) else "(complex key)"
                todo += [(value, [*path, name]), (key, [*path, name])]
        elif isinstance(node, yaml.SequenceNode):
            todo += [(item, [*path, i]) for i, item in reversed(list(enumerate(node.value)))]
    return []


def _where(path: list[str | int]) -> str:
    return ".".join(str(p) for p in path) or "(spec)"


def _check_yaml_events(text: str) -> None:
    """One pass over the parser's events: depth, nodes (aliases count as the nodes they repeat),
    duplicate keys and time, each refused before any object is built."""
    deadline = time.monotonic() + MAX_SECONDS
    nodes = 0
    anchors: dict[str, int] = {}  # anchor -> nodes it spans
    # one frame per open collection:
    # [is_mapping, path part of the next child, keys seen, anchor, nodes at its start, on the path]
    stack: list[list[Any]] = []
    path: list[str | int] = []
    try:
        for event in yaml.parse(text, Loader=_Loader):
            if isinstance(event, yaml.NodeEvent):
                nodes += anchors.get(event.anchor, 1) if isinstance(event, yaml.AliasEvent) else 1
                if nodes > MAX_NODES:
                    raise DocumentError(_where(path), f"more than {MAX_NODES} values in one document")
                if nodes % 512 == 0 and time.monotonic() > deadline:
                    raise DocumentError("(spec)", f"took more than {MAX_SECONDS}s to read; simplify it")
                key = _child(stack, path, event)
                if isinstance(event, yaml.CollectionStartEvent):
                    if len(stack) >= MAX_DEPTH:
                        raise DocumentError("(spec)", f"nested deeper than {MAX_DEPTH} levels")
                    is_map = isinstance(event, yaml.MappingStartEvent)
                    stack.append([is_map, None if is_map else 0, set(), event.anchor, nodes, key is not None])
                    if key is not None:
                        path.append(key)
                elif event.anchor and not isinstance(event, yaml.AliasEvent):
                    anchors[event.anchor] = 1
            elif isinstance(event, yaml.CollectionEndEvent):
                _, _, _, anchor, start, on_path = stack.pop()
                if anchor:
                    anchors[anchor] = nodes - start + 1
                if on_path:
                    path.pop()
    except yaml.YAMLError as exc:
        raise _yaml_error(exc) from exc


def _child(stack: list[list[Any]], path: list[str | int], event: yaml.NodeEvent) -> str | int | None:
    """Account for one node inside the innermost open collection; returns the path part it sits at
    (None for a mapping key, or the document's root)."""
    if not stack:
        return None
    frame = stack[-1]
    if not frame[0]:  # a sequence: the node is item `index`
        index = frame[1]
        frame[1] = index + 1
        return index
    if frame[1] is None:  # a mapping expecting a key
        key = event.value if isinstance(event, yaml.ScalarEvent) else "(complex key)"
        if key in frame[2] and key != "<<":
            where = _where([*path, key])
            raise DocumentError(where, f"duplicate key {key!r} (line {event.start_mark.line + 1})")
        frame[2].add(key)
        frame[1] = key
        return None
    key, frame[1] = frame[1], None  # the value of `key`; the next node is a key again
    return key


class _LongNumber(str):
    """A JSON number longer than MAX_NUMBER_CHARS, kept as its text until its field is known."""


def _number(parse: type[int] | type[float]) -> Any:
    def read(text: str) -> int | float | _LongNumber:
        return _LongNumber(text) if len(text) > MAX_NUMBER_CHARS else parse(text)

    return read


def _load_json(text: str) -> Any:
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in pairs:
            if k in out:
                raise DocumentError("(spec)", f"duplicate key {k!r}")
            out[k] = v
        return out

    try:
        value = json.loads(
            text, object_pairs_hook=no_duplicates, parse_int=_number(int), parse_float=_number(float)
        )
    except RecursionError as exc:
        raise DocumentError("(spec)", f"nested deeper than {MAX_DEPTH} levels") from exc
    except json.JSONDecodeError as exc:
        raise DocumentError("(spec)", f"not valid JSON: {exc}") from exc
    _check_tree(value)
    return value


def _check_tree(value: Any) -> None:
    """Depth, size and number lengths of a decoded JSON value, walked without recursion."""
    todo: list[tuple[Any, list[str | int]]] = [(value, [])]
    nodes = 0
    while todo:
        item, path = todo.pop()
        nodes += 1
        if nodes > MAX_NODES:
            raise DocumentError("(spec)", f"more than {MAX_NODES} values in one document")
        if isinstance(item, _LongNumber):
            where = _where(path)
            raise DocumentError(where, f"{where}: a number of more than {MAX_NUMBER_CHARS} characters")
        if isinstance(item, dict | list):
            if len(path) >= MAX_DEPTH:
                raise DocumentError("(spec)", f"nested deeper than {MAX_DEPTH} levels")
            pairs = item.items() if isinstance(item, dict) else enumerate(item)
            todo.extend((v, [*path, k]) for k, v in pairs)
