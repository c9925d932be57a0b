"""The OpenAPI document the gateway serves at /schema/openapi.json (and the docs site renders): Litestar's
paths and operations, with each body and answer model described as pydantic itself validates it.

Litestar 2 writes a model's schema itself and loses constraints on the way: a pattern or a bound inside
an optional field (`team: str | None = Field(pattern=...)` became a bare string) or on a list's items
(`filter.teams`), so a client following the document sent what the gateway then refused with a 422. The
schemas under `components` are therefore replaced by pydantic's own (`model_json_schema`, JSON Schema
2020-12 as OpenAPI 3.1 takes it), request models in validation mode, answers in serialization mode. The
job spec (`JobSpec`), which the submit endpoint reads itself (JSON or YAML), is described the same way.
"""

from __future__ import annotations

import copy
from functools import cache
from typing import Any

from litestar import Request
from litestar.openapi.plugins import (
    JsonRenderPlugin,
    OpenAPIRenderPlugin,
    SwaggerRenderPlugin,
    YamlRenderPlugin,
)
from pydantic import BaseModel

import vigil.api
import vigil.api_alerts
import vigil.api_code
import vigil.api_guardian
import vigil.spec

REF = "#/components/schemas/{model}"


@cache
def _models() -> dict[str, type[BaseModel]]:
    """The SDK's API and spec models by name: the names Litestar gives their components."""
    found: dict[str, type[BaseModel]] = {}
    for module in (vigil.api, vigil.api_alerts, vigil.api_code, vigil.api_guardian, vigil.spec):
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and issubclass(value, BaseModel)
                and value.__module__ == module.__name__
            ):
                found[value.__name__] = value
    return found


def model_schema(model: type[BaseModel]) -> tuple[dict[str, Any], dict[str, Any]]:
    """`model`'s schema as pydantic writes it, and the models it refers to (its `$defs`)."""
    mode = (
        "validation"
        if model.__name__.endswith("In") or model.__module__ == vigil.spec.__name__
        else "serialization"
    )
    schema = model.model_json_schema(ref_template=REF, mode=mode)
    return schema, schema.pop("$defs", {})


def with_pydantic_schemas(document: dict[str, Any]) -> dict[str, Any]:
    """`document` (Litestar's, as a dict) with every component that is one of the SDK's models, and
    `JobSpec`, described by pydantic; the rest as it is."""
    out = copy.deepcopy(document)
    schemas = out.setdefault("components", {}).setdefault("schemas", {})
    models = _models()
    wanted = [name for name in schemas if name in models] + ["JobSpec"]
    for name in wanted:
        schema, defs = model_schema(models[name])
        schemas[name] = schema
        for def_name, definition in defs.items():
            schemas[def_name] = definition
    return out


class Merged:
    """`with_pydantic_schemas` made once per document: Litestar builds its document once per app and hands
    the same dict to every render, so a request for the document does not describe every model again."""

    def __init__(self) -> None:
        self._source: dict[str, Any] | None = None
        self._merged: dict[str, Any] = {}

    def __call__(self, document: dict[str, Any]) -> dict[str, Any]:
        # the source is held, so no new document can be given the old one's identity
        if document is not self._source:
            self._merged = with_pydantic_schemas(document)
            self._source = document
        return self._merged


class JsonDocument(JsonRenderPlugin):
    """/schema/openapi.json, with pydantic's schemas."""

    def __init__(self, merged: Merged) -> None:
        super().__init__()
        self.merged = merged

    def render(self, request: Request, openapi_schema: dict[str, Any]) -> bytes:
        return super().render(request, self.merged(openapi_schema))


class YamlDocument(YamlRenderPlugin):
    """/schema/openapi.yaml (and .yml), with pydantic's schemas."""

    def __init__(self, merged: Merged) -> None:
        super().__init__(path=["/openapi.yaml", "/openapi.yml"])
        self.merged = merged

    def render(self, request: Request, openapi_schema: dict[str, Any]) -> bytes:
        return super().render(request, self.merged(openapi_schema))


def render_plugins() -> list[OpenAPIRenderPlugin]:
    """What /schema serves: the document as JSON and YAML (one merge for both), and Swagger UI over it (at
    /schema too)."""
    merged = Merged()
    return [
        JsonDocument(merged),
        YamlDocument(merged),
        SwaggerRenderPlugin(path="/"),
    ]
