"""Request validation from the rules written in the contracts.

Request fields carry `(tandem.common.v1.field)` options (required, lengths, patterns, ranges, item counts).
`violations(message)` walks a message, nested messages and repeated entries included, and returns every
broken rule with the field's path. The validation interceptor runs it before any handler, so servicers
receive only requests that satisfy their contract.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from tandem.common.v1 import validation_pb2

from mesh.errors import FieldViolation

_NUMERIC = {
    FieldDescriptor.TYPE_DOUBLE,
    FieldDescriptor.TYPE_FLOAT,
    FieldDescriptor.TYPE_INT32,
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_UINT32,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_SINT32,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_FIXED32,
    FieldDescriptor.TYPE_FIXED64,
    FieldDescriptor.TYPE_SFIXED32,
    FieldDescriptor.TYPE_SFIXED64,
}


@dataclass(frozen=True)
class _Rule:
    field: FieldDescriptor
    rules: validation_pb2.FieldRules | None
    pattern: re.Pattern[str] | None
    nested: bool
    # Read once from the descriptor and the rules, so a walk touches no descriptor or options.
    name: str = ""
    repeated: bool = False
    is_map: bool = False
    is_message: bool = False
    required: bool = False
    max_items: int = 0
    min_len: int = 0
    max_len: int = 0
    min: float | None = None
    max: float | None = None
    numeric: bool = False
    defined: frozenset[int] | None = None  # defined_only enums: the defined numbers
    enum_name: str = ""


def _rule(
    field: FieldDescriptor,
    rules: validation_pb2.FieldRules | None,
    pattern: re.Pattern[str] | None,
    nested: bool,
) -> _Rule:
    enum_type = field.enum_type
    return _Rule(
        field,
        rules,
        pattern,
        nested,
        name=field.name,
        repeated=_is_repeated(field),
        is_map=_is_map(field),
        is_message=field.type == FieldDescriptor.TYPE_MESSAGE,
        required=bool(rules is not None and rules.required),
        max_items=rules.max_items if rules is not None else 0,
        min_len=rules.min_len if rules is not None else 0,
        max_len=rules.max_len if rules is not None else 0,
        min=rules.min if rules is not None and rules.HasField("min") else None,
        max=rules.max if rules is not None and rules.HasField("max") else None,
        numeric=field.type in _NUMERIC,
        defined=(
            frozenset(enum_type.values_by_number)
            if enum_type is not None and rules is not None and rules.defined_only
            else None
        ),
        enum_name=enum_type.name if enum_type is not None else "",
    )


def _is_repeated(field: FieldDescriptor) -> bool:
    return bool(field.is_repeated)


def _is_map(field: FieldDescriptor) -> bool:
    message_type = field.message_type
    return (
        field.type == FieldDescriptor.TYPE_MESSAGE
        and message_type is not None
        and message_type.has_options
        and bool(message_type.GetOptions().map_entry)
    )


@cache
def _plan(descriptor: Descriptor) -> tuple[_Rule, ...]:
    plan: list[_Rule] = []
    for field in descriptor.fields:
        rules: validation_pb2.FieldRules | None = None
        options = field.GetOptions()
        if options.HasExtension(validation_pb2.field):
            rules = options.Extensions[validation_pb2.field]
        message_type = field.message_type
        nested = (
            message_type is not None
            and not _is_map(field)
            and message_type.full_name.startswith("tandem.")
            and _has_rules(message_type)
        )
        if rules is None and not nested:
            continue
        pattern = re.compile(rules.pattern) if rules is not None and rules.pattern else None
        plan.append(_rule(field, rules, pattern, nested))
    return tuple(plan)


@cache
def _has_rules(descriptor: Descriptor, _seen: frozenset[str] = frozenset()) -> bool:
    if descriptor.full_name in _seen:
        return False
    seen = _seen | {descriptor.full_name}
    for field in descriptor.fields:
        if field.GetOptions().HasExtension(validation_pb2.field):
            return True
        if field.message_type is not None and _has_rules(field.message_type, seen):
            return True
    return False


def _is_set(message: Message, rule: _Rule, value: object) -> bool:
    if rule.repeated:
        return len(value) > 0  # type: ignore[arg-type]
    if rule.is_message:
        return message.HasField(rule.name)
    return bool(value)


def _check_scalar(path: str, value: object, rule: _Rule, out: list[FieldViolation]) -> None:
    rules = rule.rules
    if rules is None:
        return
    if isinstance(value, str | bytes):
        size = len(value)
        if rule.min_len and size < rule.min_len:
            unit = "characters" if isinstance(value, str) else "bytes"
            out.append(FieldViolation(path, f"must be at least {rule.min_len} {unit}"))
        if rule.max_len and size > rule.max_len:
            unit = "characters" if isinstance(value, str) else "bytes"
            out.append(FieldViolation(path, f"must be at most {rule.max_len} {unit}, got {size}"))
        if (
            rule.pattern is not None
            and isinstance(value, str)
            and value
            and not rule.pattern.fullmatch(value)
        ):
            out.append(FieldViolation(path, f"must match {rules.pattern}"))
    elif rule.numeric and isinstance(value, int | float):
        if rule.min is not None and value < rule.min:
            out.append(FieldViolation(path, f"must be >= {rule.min:g}, got {value}"))
        if rule.max is not None and value > rule.max:
            out.append(FieldViolation(path, f"must be <= {rule.max:g}, got {value}"))
    elif rule.defined is not None and isinstance(value, int) and value not in rule.defined:
        out.append(FieldViolation(path, f"{value} is not a defined {rule.enum_name}"))


def _scalar_ok(value: object, rule: _Rule) -> bool:
    """True when `_check_scalar` would find nothing: the common case, decided without building a path."""
    if isinstance(value, str):
        if not value:
            return not rule.min_len
        size = len(value)
        return (
            (not rule.min_len or size >= rule.min_len)
            and (not rule.max_len or size <= rule.max_len)
            and (rule.pattern is None or rule.pattern.fullmatch(value) is not None)
        )
    if isinstance(value, bytes):
        size = len(value)
        return (not rule.min_len or size >= rule.min_len) and (not rule.max_len or size <= rule.max_len)
    if rule.numeric and isinstance(value, int | float):
        return (rule.min is None or value >= rule.min) and (rule.max is None or value <= rule.max)
    return rule.defined is None or not isinstance(value, int) or value in rule.defined


def _walk(message: Message, prefix: str, out: list[FieldViolation], depth: int) -> None:  # noqa: PLR0912
    if depth > 32:
        out.append(FieldViolation(prefix or "(request)", "nesting is too deep"))
        return
    for rule in _plan(message.DESCRIPTOR):
        name = rule.name
        if rule.is_message and not rule.repeated:
            if rule.required and not message.HasField(name):
                out.append(FieldViolation(f"{prefix}{name}", "is required"))
            elif rule.nested and message.HasField(name):
                _walk(getattr(message, name), f"{prefix}{name}.", out, depth + 1)
            continue
        value = getattr(message, name)
        if rule.required and not _is_set(message, rule, value):
            out.append(FieldViolation(f"{prefix}{name}", "is required"))
            continue
        if rule.repeated:
            if rule.max_items and len(value) > rule.max_items:
                out.append(
                    FieldViolation(
                        f"{prefix}{name}", f"must have at most {rule.max_items} items, got {len(value)}"
                    )
                )
            if rule.is_map:
                continue
            if rule.nested:
                for index, item in enumerate(value):
                    _walk(item, f"{prefix}{name}[{index}].", out, depth + 1)
            elif rule.rules is not None:
                for index, item in enumerate(value):
                    if not _scalar_ok(item, rule):
                        _check_scalar(f"{prefix}{name}[{index}]", item, rule, out)
        elif rule.rules is not None and not _scalar_ok(value, rule):
            _check_scalar(f"{prefix}{name}", value, rule, out)


def violations(message: Message) -> list[FieldViolation]:
    """Every rule the message breaks, in field order; empty when it is valid."""
    out: list[FieldViolation] = []
    _walk(message, "", out, 0)
    return out
