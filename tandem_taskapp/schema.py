"""The contract's JSON schemas, read from docs/taskapp-openapi.yaml, as jsonschema validators.

The file is looked up at `$TANDEM_TASKAPP_OPENAPI`, then next to the package in a source checkout
(`docs/taskapp-openapi.yaml`), then inside the package (`tandem_taskapp/taskapp-openapi.yaml`)."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft202012Validator, ValidationError
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SPEC_URI = "urn:tandem:taskapp-openapi"
SCHEMA_NAMES = (
    "Error",
    "Health",
    "TaskInfo",
    "RolloutRequest",
    "RolloutResponse",
)


def spec_path() -> Path:
    """Where the OpenAPI document is read from."""
    override = os.environ.get("TANDEM_TASKAPP_OPENAPI")
    if override:
        return Path(override)
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "docs" / "taskapp-openapi.yaml", here / "taskapp-openapi.yaml"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        "docs/taskapp-openapi.yaml not found; set TANDEM_TASKAPP_OPENAPI to the Task App OpenAPI document"
    )


@functools.cache
def openapi_spec() -> dict[str, Any]:
    """The parsed OpenAPI document."""
    with spec_path().open(encoding="utf-8") as f:
        spec: dict[str, Any] = yaml.safe_load(f)
    return spec


@functools.cache
def _registry() -> Registry[Any]:
    resource: Resource[Any] = Resource.from_contents(openapi_spec(), default_specification=DRAFT202012)
    registry: Registry[Any] = Registry().with_resource(SPEC_URI, resource)
    return registry


@functools.cache
def validator(name: str) -> Draft202012Validator:
    """A validator for `components.schemas[name]` of the OpenAPI document.

    The schema's references to other components are inlined when they can be (none is recursive), since
    resolving a `$ref` on every validation was about half of validating a rollout's body; the violations,
    their paths and messages are the same either way."""
    if name not in openapi_spec()["components"]["schemas"]:
        raise KeyError(f"no schema {name!r} in the Task App OpenAPI document")
    try:
        return Draft202012Validator(_inline(openapi_spec()["components"]["schemas"][name], ()))
    except _NotInlinable:
        return Draft202012Validator({"$ref": f"{SPEC_URI}#/components/schemas/{name}"}, registry=_registry())


_LOCAL_REF = "#/components/schemas/"
_ANNOTATIONS = frozenset(
    {"description", "title", "examples", "default", "deprecated", "readOnly", "writeOnly", "$comment"}
)


class _NotInlinable(Exception):
    pass


def _inline(node: Any, seen: tuple[str, ...]) -> Any:
    """`node` with every `$ref` to a component replaced by that component (itself inlined). A reference
    with assertions beside it becomes `allOf: [component]` next to them, as `$ref` applies both; one with
    annotations only takes them over. Raises `_NotInlinable` for a recursive or non-local reference."""
    if isinstance(node, list):
        return [_inline(item, seen) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" not in node:
        return {key: _inline(value, seen) for key, value in node.items()}
    ref = node["$ref"]
    if not isinstance(ref, str) or not ref.startswith(_LOCAL_REF):
        raise _NotInlinable(ref)
    target_name = ref.removeprefix(_LOCAL_REF)
    components = openapi_spec()["components"]["schemas"]
    if target_name in seen or target_name not in components:
        raise _NotInlinable(ref)
    target = _inline(components[target_name], (*seen, target_name))
    rest = {key: _inline(value, seen) for key, value in node.items() if key != "$ref"}
    if not rest:
        return target
    if set(rest) <= _ANNOTATIONS and isinstance(target, dict):
        return {**target, **rest}
    return {"allOf": [target], **rest}


def errors(name: str, instance: Any, *, limit: int = 20) -> list[dict[str, str]]:
    """The violations of schema `name` by `instance`, at most `limit`, each `{"path", "message"}` with the
    message cut to 300 characters; empty when it is valid."""
    out: list[dict[str, str]] = []
    for err in _sorted(validator(name).iter_errors(instance)):
        out.append({"path": _path(err), "message": _short(err.message)})
        if len(out) >= limit:
            break
    return out


def _sorted(errs: Iterator[ValidationError]) -> list[ValidationError]:
    return sorted(errs, key=lambda e: [str(p) for p in e.absolute_path])


def _path(err: ValidationError) -> str:
    return "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err.absolute_path)


def _short(message: str, limit: int = 300) -> str:
    return message if len(message) <= limit else message[: limit - 1] + "…"
