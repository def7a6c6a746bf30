"""How a field of the InferenceService spec is declared once: its camelCase name, default, range,
the API server's CEL rules and the operator's message, on a pydantic model; and how the CRD's
structural OpenAPI schema is read back from those models (:func:`object_schema`).

A spec model subclasses :class:`SpecModel` and declares each field with :func:`spec_field`.
:meth:`SpecModel.parse` reads the CRD's camelCase dict and raises :class:`SpecValueError` whose
message names the CRD field (``spec.autoscaling.maxReplicas must be an integer ≥ 1, got 0``).
"""
from __future__ import annotations

import collections.abc
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator
from pydantic.fields import FieldInfo

# A Kubernetes resource quantity (``512Mi``, ``2``): the API server takes an integer or a string;
# the operator parses it (kubernetes' quantity parser), this package only normalizes it to a string.
QUANTITY_PATTERN = (r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
                    r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")
QUANTITY_RULE = "a Kubernetes quantity such as '512Mi' or '2'"


def _int_to_str(value: Any) -> Any:
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


@dataclass(frozen=True)
class _IntOrString:
    """Marks a string field that the CRD declares int-or-string."""


Quantity = typing.Annotated[str, BeforeValidator(_int_to_str), _IntOrString()]


@dataclass(frozen=True)
class CelRule:
    """One ``x-kubernetes-validations`` entry: a CEL ``rule`` over ``self`` and the API server's
    ``message`` when it is false. Its Python twin is the model's validator beside it."""

    rule: str
    message: str

    def to_schema(self) -> dict[str, str]:
        return {"rule": self.rule, "message": self.message}


class SpecValueError(ValueError):
    """A spec value the contract refuses; the message names the CRD field and what to do."""


def spec_field(default: Any = ..., *, alias: str | None = None, description: str | None = None,
               rule: str | None = None, cel: tuple[CelRule, ...] = (), crd_default: bool = True,
               schema: Mapping[str, Any] | None = None, default_factory: Any = None,
               **constraints: Any) -> Any:
    """A spec field. ``alias``: its CRD name (default: the camelCase of the attribute).
    ``rule``: what the operator's message says the value must be (default: from the type and
    ``constraints``, e.g. ``an integer ≥ 1``). ``cel``: rules of this field's node.
    ``crd_default=False``: the Python default is not written into the CRD (a rule reads
    ``has()``). ``schema``: schema keys the API server checks that the operator does not (a
    pattern the operator checks itself with a clearer message), or list/preserve markers.
    ``constraints``: pydantic's ``ge``/``gt``/``le``/``lt``/``min_length``/``max_length``/
    ``pattern``, enforced by both."""
    extra = {"rule": rule, "cel": tuple(cel), "crd_default": crd_default, "schema": dict(schema or {})}
    if default_factory is not None:
        return Field(default_factory=default_factory, alias=alias, description=description,
                     json_schema_extra={"crd": extra}, **constraints)
    return Field(default, alias=alias, description=description, json_schema_extra={"crd": extra},
                 **constraints)


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(word.title() for word in rest)


class SpecModel(BaseModel):
    """Base of the spec's models: frozen, strict (no ``"5"`` for 5, no ``true`` for 1), unknown
    keys refused, a key set to null means its default (the API server drops nulls too).
    Python code builds them by attribute name; the CRD's dicts are read by camelCase name
    (:meth:`parse`)."""

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid", alias_generator=_camel,
                              validate_by_name=True, validate_by_alias=True)
    # The object's own CEL rules (x-kubernetes-validations of its node).
    cel_rules: ClassVar[tuple[CelRule, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, raw: Any) -> Any:
        if isinstance(raw, Mapping):
            return {key: value for key, value in raw.items() if value is not None}
        return raw

    @classmethod
    def parse(cls, raw: Mapping[str, Any] | None, where: str) -> typing.Self:
        """``raw`` (the CRD's camelCase dict; None: every default) as this model.

        Raises:
            SpecValueError: the first value refused, naming it as ``where`` + its CRD path: an
                unknown key (``… has unknown field(s) …; known: …``), a value that is not an
                object, of the wrong type or out of range, or a broken cross-field rule.
        """
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise SpecValueError(f"{where} must be an object, got {raw!r}")
        try:
            return cls.model_validate(raw, by_alias=True, by_name=False)
        except ValidationError as exc:
            raise SpecValueError(_message(cls, exc, where)) from None

    def to_dict(self) -> dict[str, Any]:
        """The camelCase form :meth:`parse` reads, nulls left out."""
        return self.model_dump(by_alias=True, exclude_none=True)


def _path(where: str, loc: tuple[Any, ...]) -> str:
    return where + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc)


def _model_at(cls: type[BaseModel], loc: tuple[Any, ...]) -> tuple[type[BaseModel] | None, FieldInfo | None]:
    """The model that holds the field at ``loc`` (camelCase names, list indices) and its field."""
    model: type[BaseModel] | None = cls
    info = None
    for part in loc:
        if isinstance(part, int) or model is None:
            continue
        info = next((f for name, f in model.model_fields.items() if _alias(name, f) == part), None)
        model = _nested_model(info.annotation) if info is not None else None
    return model, info


def _alias(name: str, info: FieldInfo) -> str:
    return info.alias or _camel(name)


def _message(cls: type[SpecModel], exc: ValidationError, where: str) -> str:
    errors = exc.errors()
    # Unknown keys first, all of one object in one message, as a reader fixes a typo first.
    extra = [e for e in errors if e["type"] == "extra_forbidden"]
    if extra:
        parent = extra[0]["loc"][:-1]
        unknown = sorted(str(e["loc"][-1]) for e in extra if e["loc"][:-1] == parent)
        model, _ = _model_at(cls, parent)
        known = [_alias(n, f) for n, f in model.model_fields.items()] if model else []
        return f"{_path(where, parent)} has unknown field(s) {', '.join(unknown)}; known: {', '.join(known)}"
    error = errors[0]
    loc, path = error["loc"], _path(where, error["loc"])
    if error["type"] == "value_error":
        return str(error["ctx"]["error"]).replace("{where}", path)
    if error["type"] == "model_type":
        return f"{path} must be an object, got {error['input']!r}"
    if error["type"] == "missing":
        return f"{path} is required"
    _, info = _model_at(cls, loc)
    rule = _rule(info) if info is not None else error["msg"]
    return f"{path} must be {rule}, got {error['input']!r}"


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _rule(info: FieldInfo) -> str:
    """What the operator's message says a value must be: declared, or from type and bounds."""
    declared = _crd(info)["rule"]
    if declared:
        return declared
    kind, enum = _scalar(info.annotation)
    if enum is not None:
        return "one of " + ", ".join(str(v) for v in enum)
    bounds = _bounds(info)
    if kind == "boolean":
        return "true or false"
    if kind == "array":
        return f"a list of at most {bounds['maxLength']} items" if "maxLength" in bounds else "a list"
    if kind == "integer":
        low, high = bounds.get("minimum"), bounds.get("maximum")
        if low is not None and high is not None:
            return f"an integer between {low} and {high}"
        return f"an integer ≥ {low}" if low is not None else "an integer"
    if kind == "number":
        low, high = bounds.get("minimum"), bounds.get("maximum")
        low_open, high_open = bounds.get("exclusiveMinimum"), bounds.get("exclusiveMaximum")
        if low is not None and high is not None:
            return (f"a number in {'(' if low_open else '['}{_number(low)}, "
                    f"{_number(high)}{')' if high_open else ']'}")
        if low is not None:
            return f"a number {'>' if low_open else '≥'} {_number(low)}"
        return "a number"
    if "minLength" in bounds or "maxLength" in bounds:
        return f"a string of {bounds.get('minLength', 0)} to {bounds.get('maxLength', '∞')} characters"
    return "a string"


def _crd(info: FieldInfo) -> dict[str, Any]:
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    return extra.get("crd") or {"rule": None, "cel": (), "crd_default": True, "schema": {}}


def _bounds(info: FieldInfo) -> dict[str, Any]:
    """The OpenAPI v3.0 bounds of pydantic's constraints (exclusive bounds are booleans there)."""
    out: dict[str, Any] = {}
    for item in info.metadata:
        for attr, key, exclusive in (("ge", "minimum", None), ("gt", "minimum", "exclusiveMinimum"),
                                     ("le", "maximum", None), ("lt", "maximum", "exclusiveMaximum"),
                                     ("min_length", "minLength", None),
                                     ("max_length", "maxLength", None), ("pattern", "pattern", None)):
            value = getattr(item, attr, None)
            if value is not None:
                out[key] = value
                if exclusive:
                    out[exclusive] = True
    return out


def _optional(annotation: Any) -> Any:
    """``X`` of ``X | None``."""
    if typing.get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    annotation = _optional(annotation)
    if typing.get_origin(annotation) is tuple:
        annotation = typing.get_args(annotation)[0]
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


_MAPPINGS = (dict, collections.abc.Mapping)
_ITEMS = {"minLength": "minItems", "maxLength": "maxItems"}
_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string"}


def _scalar(annotation: Any) -> tuple[str, tuple[Any, ...] | None]:
    """The OpenAPI type of a field's annotation and its enum (a Literal), if any."""
    annotation = _optional(annotation)
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        values = typing.get_args(annotation)
        return _TYPES[type(values[0])], values
    if origin is typing.Annotated:
        return _scalar(typing.get_args(annotation)[0])
    if origin is tuple:
        return "array", None
    if origin in _MAPPINGS or annotation is dict:
        return "object", None
    return _TYPES.get(annotation, "object"), None


def _is_int_or_string(info: FieldInfo) -> bool:
    # pydantic moves a plain Annotated's metadata onto the field; an optional one keeps it.
    annotation = _optional(info.annotation)
    metadata = list(info.metadata)
    if typing.get_origin(annotation) is typing.Annotated:
        metadata += typing.get_args(annotation)[1:]
    return any(isinstance(m, _IntOrString) for m in metadata)


def field_schema(info: FieldInfo) -> dict[str, Any]:
    """The structural schema node of one field: type, description, default, bounds, enum,
    nested properties and CEL rules, in that order (the order the CRD has always used)."""
    crd = _crd(info)
    annotation = _optional(info.annotation)
    nested = _nested_model(annotation)
    node: dict[str, Any] = {}
    if _is_int_or_string(info):
        node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        node["x-kubernetes-int-or-string"] = True
    else:
        kind, enum = _scalar(annotation)
        node["type"] = kind
        if enum is not None:
            node["enum"] = list(enum)
    if info.description:
        node["description"] = info.description
    if crd["crd_default"] and not info.is_required():
        if nested is not None and info.default_factory is not None and typing.get_origin(annotation) is not tuple:
            node["default"] = {}  # the API server fills the nested defaults itself
        elif isinstance(info.default, (bool, int, float, str)):  # lists and maps: none, as the CRD
            node["default"] = info.default
    bounds = _bounds(info)
    if node.get("type") == "array":  # a list's length bounds count items
        bounds = {_ITEMS.get(k, k): v for k, v in bounds.items()}
    node.update(bounds)
    node.update(crd["schema"])
    if nested is not None:
        body = object_schema(nested)
        if typing.get_origin(annotation) is tuple:
            node["items"] = body
        else:
            node.update({k: v for k, v in body.items() if k != "type"})
    elif typing.get_origin(annotation) in _MAPPINGS:
        value_type = typing.get_args(annotation)[1]
        if value_type is Any:
            node["x-kubernetes-preserve-unknown-fields"] = True
        else:
            node["additionalProperties"] = {"type": _TYPES[value_type]}
    if crd["cel"]:
        node["x-kubernetes-validations"] = [rule.to_schema() for rule in crd["cel"]]
    return node


def object_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The structural schema of ``model``: ``type: object``, its required keys, each field by its
    CRD name (:func:`field_schema`) and the model's own CEL rules."""
    node: dict[str, Any] = {"type": "object"}
    required = [_alias(n, f) for n, f in model.model_fields.items() if f.is_required()]
    if required:
        node["required"] = required
    node["properties"] = {_alias(n, f): field_schema(f) for n, f in model.model_fields.items()}
    rules = getattr(model, "cel_rules", ())
    if rules:
        node["x-kubernetes-validations"] = [rule.to_schema() for rule in rules]
    return node
