"""The published API description: ``GET /openapi.json`` (and FastAPI's ``/docs`` page over it).

Handlers read their bodies themselves (:func:`.body.read_json`: the size limit first, then errors in the
route's own API shape), so FastAPI cannot see the body models; each route names its model with
``openapi_extra=request_body(Model)`` and :func:`openapi_schema` adds the models' JSON schemas as
components.
"""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

__all__ = ["request_body", "openapi_schema"]

_REF = "#/components/schemas/{model}"


def request_body(model: type[BaseModel], **examples: dict) -> dict:
    """``openapi_extra`` of a route whose JSON body is ``model``; ``examples``: named example bodies (on
    ``/docs``, and the fuzz test sends each)."""
    media = {"schema": {"$ref": _REF.format(model=model.__name__)}}
    if examples:
        media["examples"] = {name: {"value": value} for name, value in examples.items()}
    return {"requestBody": {"required": True, "content": {"application/json": media}}}


def openapi_schema(app: FastAPI, models: list[type[BaseModel]], version: str) -> dict:
    """The app's OpenAPI document with ``models`` (and the models they refer to) as component schemas."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=version, routes=app.routes,
                             description="dynamoe's LLM server: OpenAI- and Anthropic-compatible routes. Errors "
                                         "are 4xx in each API's own shape; a request never gets a 500 for its "
                                         "content.")
        _, defs = models_json_schema([(m, "validation") for m in models], ref_template=_REF)
        schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
        app.openapi_schema = schema
    return app.openapi_schema
