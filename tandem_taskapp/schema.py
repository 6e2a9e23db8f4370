"""The contract's JSON schemas, read from docs/taskapp-openapi.yaml, as jsonschema validators.

The file is looked up at `$TANDEM_TASKAPP_OPENAPI`, then next to the package in a source checkout
(`docs/taskapp-openapi.yaml`), then inside the package (`tandem_taskapp/taskapp-openapi.yaml`)."""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable, Iterator
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
    message cut to 300 characters; empty when it is valid. An instance the compiled check (`conforms`)
    accepts is valid without asking jsonschema, which costs about five times more; only the others go
    through it, for the violations and their messages."""
    if conforms(name, instance):
        return []
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


Check = Callable[[Any], bool]
_TYPES: dict[str, Check] = {
    "object": lambda value: isinstance(value, dict),
    "array": lambda value: isinstance(value, list),
    "string": lambda value: isinstance(value, str),
    "number": lambda value: isinstance(value, int | float) and not isinstance(value, bool),
    # jsonschema takes 1.0 for an integer too; the compiled check leaves such a value to it.
    "integer": lambda value: isinstance(value, int) and not isinstance(value, bool),
    "boolean": lambda value: isinstance(value, bool),
    "null": lambda value: value is None,
}
_COMPILED = (
    frozenset({"type", "properties", "required", "additionalProperties", "items", "maxItems", "pattern"})
    | _ANNOTATIONS
)


def conforms(name: str, instance: Any) -> bool:
    """True only when `instance` is valid against schema `name`; False when it is not, or when the compiled
    check cannot tell (a keyword it does not compile, anywhere in the schema): then ask `errors`."""
    check = _compiled(name)
    return check is not None and check(instance)


@functools.cache
def _compiled(name: str) -> Check | None:
    try:
        return _compile(validator(name).schema)
    except _NotInlinable:  # a `$ref` left in, or a keyword not compiled: jsonschema decides alone
        return None


def _compile(node: Any) -> Check:
    """`node` (an inlined schema) as a plain function of the instance, for the keywords in `_COMPILED`
    with jsonschema's Draft 2020-12 meaning: each keyword constrains only the instances of its own type."""
    if node is True or node == {}:
        return lambda value: True
    if node is False:
        return lambda value: False
    if not isinstance(node, dict) or not set(node) <= _COMPILED:
        raise _NotInlinable(str(node)[:100])
    checks: list[Check] = []
    kinds = node.get("type")
    if kinds is not None:
        names = [kinds] if isinstance(kinds, str) else list(kinds)
        if not set(names) <= set(_TYPES):
            raise _NotInlinable(f"type {kinds}")
        tests = [_TYPES[kind] for kind in names]
        checks.append(lambda value: any(test(value) for test in tests))
    properties = {key: _compile(sub) for key, sub in node.get("properties", {}).items()}
    required = tuple(node.get("required", ()))
    extra = _compile(node["additionalProperties"]) if "additionalProperties" in node else None
    if properties or required or extra is not None:

        def object_ok(value: Any) -> bool:
            if not isinstance(value, dict):
                return True
            for key, item in value.items():
                check = properties.get(key, extra)
                if check is not None and not check(item):
                    return False
            return all(key in value for key in required)

        checks.append(object_ok)
    items = _compile(node["items"]) if "items" in node else None
    most = node.get("maxItems")
    if items is not None or most is not None:

        def array_ok(value: Any) -> bool:
            if not isinstance(value, list):
                return True
            if most is not None and len(value) > most:
                return False
            return items is None or all(items(item) for item in value)

        checks.append(array_ok)
    if "pattern" in node:
        search = re.compile(node["pattern"]).search  # jsonschema searches too: unanchored
        checks.append(lambda value: not isinstance(value, str) or search(value) is not None)
    return lambda value: all(check(value) for check in checks)
