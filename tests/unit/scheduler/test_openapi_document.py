"""The served OpenAPI document: pydantic's schemas merged into Litestar's document once per document, not
once per request (`gateway.openapi.Merged`)."""

from __future__ import annotations

import pytest

from vigil.api import UserIn
from vigil_scheduler.gateway import openapi


def litestar_document() -> dict:
    return {"openapi": "3.1.0", "components": {"schemas": {"UserIn": {"type": "object"}}}}


def test_a_document_is_merged_once_and_a_new_one_again(monkeypatch: pytest.MonkeyPatch):
    made: list[dict] = []
    merge = openapi.with_pydantic_schemas

    def counted(document: dict) -> dict:
        made.append(document)
        return merge(document)

    merged = openapi.Merged()
    monkeypatch.setattr(openapi, "with_pydantic_schemas", counted)
    document = litestar_document()
    first = merged(document)
    assert merged(document) is first and made == [document]
    # what is served is pydantic's description of the models, Litestar's own document left as it was
    assert first["components"]["schemas"]["UserIn"] == openapi.model_schema(UserIn)[0]
    assert "JobSpec" in first["components"]["schemas"]
    assert document == litestar_document()
    # another app's (or a rebuilt) document is merged anew, even when equal to the last one
    other = litestar_document()
    assert merged(other) is not first and made == [document, other]
