"""Request validation from the rules written in the contracts.

Request fields carry `(tandem.common.v1.field)` options (required, lengths, patterns, ranges, item counts).
`violations(message)` walks a message, nested messages and repeated entries included, and returns every
broken rule with the field's path. The validation interceptor runs it before any handler, so servicers
receive only requests that satisfy their contract.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from tandem.common.v1 import validation_pb2

from mesh.errors import FieldViolation

PATTERN_MEMO = 1024  # remembered values per pattern-checked field

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
        if not rule.repeated and rule.field.has_presence and not message.HasField(name):
            if rule.required:
                out.append(FieldViolation(f"{prefix}{name}", "is required"))
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


Check = Callable[[Message, int], bool]


def _ok(message: Message, depth: int = 0) -> bool:
    """True when the message breaks no rule: the common case, decided without building any path."""
    if depth > 32:
        return False
    for check in _checks(message.DESCRIPTOR):  # noqa: SIM110 - cheaper than all() over a generator
        if not check(message, depth):
            return False
    return True


def _message_check(rule: _Rule) -> Check:
    name, nested, required = rule.name, rule.nested, rule.required

    def check(message: Message, depth: int) -> bool:
        if not message.HasField(name):
            return not required
        return not nested or _ok(getattr(message, name), depth + 1)

    return check


def _oneof_check(oneof: str, members: frozenset[str]) -> Check:
    """One `WhichOneof` for a oneof's optional message members instead of a `HasField` per member."""

    def check(message: Message, depth: int) -> bool:
        which = message.WhichOneof(oneof)
        return which is None or which not in members or _ok(getattr(message, which), depth + 1)

    return check


def _value_check(rule: _Rule) -> Check:
    name, required = rule.name, rule.required
    if not rule.repeated:
        if rule.rules is None:
            return lambda message, depth: not required or _is_set(message, rule, getattr(message, name))
        min_len, max_len, pattern = rule.min_len, rule.max_len, rule.pattern
        optional = bool(rule.field.has_presence)
        # Values that passed a pattern: type names, ids and the like repeat from request to request, and
        # a dict lookup costs a fraction of a regular expression match.
        passed: dict[str, bool] = {}

        def scalar(message: Message, depth: int) -> bool:
            if optional and not message.HasField(name):
                return not required  # an unset `optional` field has no value to check
            value = getattr(message, name)
            if isinstance(value, str):  # the common case, inline: no call per rule
                if not value:
                    return not required and not min_len
                if (min_len and len(value) < min_len) or (max_len and len(value) > max_len):
                    return False
                if pattern is None or value in passed:
                    return True
                if pattern.fullmatch(value) is None:
                    return False
                if len(passed) >= PATTERN_MEMO:
                    passed.clear()
                passed[value] = True
                return True
            if required and not value:
                return False
            return _scalar_ok(value, rule)

        return scalar

    def repeated(message: Message, depth: int) -> bool:
        value = getattr(message, name)
        if required and not value:
            return False
        if rule.max_items and len(value) > rule.max_items:
            return False
        if rule.is_map:
            return True
        if rule.nested:
            return all(_ok(item, depth + 1) for item in value)
        return rule.rules is None or all(_scalar_ok(item, rule) for item in value)

    return repeated


@cache
def _checks(descriptor: Descriptor) -> tuple[Check, ...]:
    plan = _plan(descriptor)
    checks: list[Check] = []
    grouped: set[str] = set()
    for rule in plan:
        oneof = rule.field.containing_oneof
        if rule.is_message and not rule.repeated and not rule.required and oneof is not None:
            if oneof.name not in grouped:
                grouped.add(oneof.name)
                members = frozenset(
                    r.name
                    for r in plan
                    if r.field.containing_oneof is oneof and r.is_message and not r.required
                )
                checks.append(_oneof_check(oneof.name, members))
        elif rule.is_message and not rule.repeated:
            checks.append(_message_check(rule))
        else:
            checks.append(_value_check(rule))
    return tuple(checks)


def violations(message: Message) -> list[FieldViolation]:
    """Every rule the message breaks, in field order; empty when it is valid."""
    if _ok(message):
        return []
    out: list[FieldViolation] = []
    _walk(message, "", out, 0)
    return out
