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
        plan.append(_Rule(field, rules, pattern, nested))
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


def _is_set(message: Message, field: FieldDescriptor) -> bool:
    value = getattr(message, field.name)
    if _is_repeated(field):
        return len(value) > 0
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return message.HasField(field.name)
    return bool(value)


def _check_scalar(
    path: str, value: object, field: FieldDescriptor, rule: _Rule, out: list[FieldViolation]
) -> None:
    rules = rule.rules
    if rules is None:
        return
    if isinstance(value, str | bytes):
        size = len(value)
        unit = "characters" if isinstance(value, str) else "bytes"
        if rules.min_len and size < rules.min_len:
            out.append(FieldViolation(path, f"must be at least {rules.min_len} {unit}"))
        if rules.max_len and size > rules.max_len:
            out.append(FieldViolation(path, f"must be at most {rules.max_len} {unit}, got {size}"))
        if (
            rule.pattern is not None
            and isinstance(value, str)
            and value
            and not rule.pattern.fullmatch(value)
        ):
            out.append(FieldViolation(path, f"must match {rules.pattern}"))
    elif field.type in _NUMERIC and isinstance(value, int | float):
        if rules.HasField("min") and value < rules.min:
            out.append(FieldViolation(path, f"must be >= {rules.min:g}, got {value}"))
        if rules.HasField("max") and value > rules.max:
            out.append(FieldViolation(path, f"must be <= {rules.max:g}, got {value}"))
    elif (
        field.enum_type is not None
        and rules.defined_only
        and isinstance(value, int)
        and field.enum_type.values_by_number.get(value) is None
    ):
        out.append(FieldViolation(path, f"{value} is not a defined {field.enum_type.name}"))


def _walk(message: Message, prefix: str, out: list[FieldViolation], depth: int) -> None:
    if depth > 32:
        out.append(FieldViolation(prefix or "(request)", "nesting is too deep"))
        return
    for rule in _plan(message.DESCRIPTOR):
        field = rule.field
        path = f"{prefix}{field.name}"
        rules = rule.rules
        if rules is not None and rules.required and not _is_set(message, field):
            out.append(FieldViolation(path, "is required"))
            continue
        value = getattr(message, field.name)
        if _is_repeated(field):
            if rules is not None and rules.max_items and len(value) > rules.max_items:
                out.append(
                    FieldViolation(path, f"must have at most {rules.max_items} items, got {len(value)}")
                )
            if _is_map(field):
                continue
            for index, item in enumerate(value):
                item_path = f"{path}[{index}]"
                if rule.nested:
                    _walk(item, item_path + ".", out, depth + 1)
                else:
                    _check_scalar(item_path, item, field, rule, out)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            if rule.nested and message.HasField(field.name):
                _walk(value, path + ".", out, depth + 1)
        else:
            _check_scalar(path, value, field, rule, out)


def violations(message: Message) -> list[FieldViolation]:
    """Every rule the message breaks, in field order; empty when it is valid."""
    out: list[FieldViolation] = []
    _walk(message, "", out, 0)
    return out
