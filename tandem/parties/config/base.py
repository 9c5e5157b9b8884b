"""The generic layer of every Tandem TOML file: frozen sections and located errors.

A file kind is a `Section` subclass whose fields are its keys and nested `Section`s its tables.
`load_toml` reads a file and validates it in one pass; `validate` checks a table already read.
Both turn pydantic's `ValidationError` into the caller's `ConfigError` subclass, worded as the
project words every configuration error::

    <file>: <section.key> <what was wrong>[, got <value>][; <how to fix it>]

Validators that need the file's folder (to resolve and check relative paths) read it from the
validation context: ``info.context["base"]`` (`base_dir`). A validator refuses a value by
raising `Invalid`, which names the key relative to the section being validated; the located
message then carries the full ``section.key``.
"""

from __future__ import annotations

import os
import tomllib
import typing
from collections.abc import Mapping
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError, ValidationInfo

from tandem.errors import ConfigError

S = TypeVar("S", bound="Section")


class Section(BaseModel):
    """One table of a TOML file: frozen, unknown keys refused, TOML types taken as they are
    (no ``"3"`` for 3, no ``true`` for 1). Field docs become the JSON Schema's descriptions."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class Invalid(ValueError):
    """Raised by a section's validator: ``key`` (relative to the section, "" for the section
    itself) is wrong; ``text`` continues the sentence after the key ("must be > 0, got 0")."""

    def __init__(self, key: str, text: str) -> None:
        super().__init__(text)
        self.key = key
        self.text = text


def _tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


#: A TOML array kept as an immutable tuple (its items keep their strict types).
Ints = Annotated[tuple[int, ...], BeforeValidator(_tuple)]
Names = Annotated[tuple[str, ...], BeforeValidator(_tuple)]


def base_dir(info: ValidationInfo) -> str:
    """The folder relative paths start at: the config file's (``"."`` without context)."""
    context = info.context or {}
    return str(context.get("base", "."))


def resolve_file(info: ValidationInfo, value: str, key: str) -> str:
    """``value`` resolved against the file's folder; `Invalid` (for ``key``) unless it exists."""
    base = base_dir(info)
    full = value if os.path.isabs(value) else os.path.join(base, value)
    if not os.path.exists(full):
        raise Invalid(
            key,
            f"= {value!r}: no such file ({full}); fix the path (relative paths start at the "
            "config file's folder)",
        )
    return full


def read_toml(path: str, error: type[ConfigError], example: str) -> dict[str, Any]:
    """The table of the TOML file ``path``; ``error`` when it is absent or not TOML (the
    message names ``example``, a file of that kind to start from)."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise error(
            f"config file {path!r} not found; pass --config with the path of a {example}"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise error(f"{path}: not valid TOML: {exc}") from None


def validate(
    model: type[S],
    table: Mapping[str, Any],
    *,
    path: str,
    error: type[ConfigError] = ConfigError,
    where: tuple[str, ...] = (),
    context: Mapping[str, Any] | None = None,
) -> S:
    """``table`` (read from ``path``; at ``where`` within it) checked as ``model``. Relative
    paths start at ``path``'s folder. Raises ``error`` with the first located problem."""
    ctx = {"base": os.path.dirname(os.path.abspath(path)), "path": path, **(context or {})}
    try:
        return model.model_validate(dict(table), context=ctx)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        inner = (first.get("ctx") or {}).get("error")
        if isinstance(inner, ConfigError):  # a checker's own error, already located
            raise inner from None
        raise error(f"{path}: {describe(exc, model, where)}") from None
    except Invalid as exc:  # raised outside a validator's reach (by a nested builder)
        raise error(f"{path}: {_dotted((*where, exc.key))} {exc.text}") from None


def load_toml(
    model: type[S], path: str | os.PathLike[str], *, error: type[ConfigError], example: str
) -> S:
    """Read the TOML file ``path`` and check it as ``model`` (see `validate`)."""
    path = os.fspath(path)
    return validate(model, read_toml(path, error, example), path=path, error=error)


# -- wording pydantic's errors -------------------------------------------------------------
_KINDS = {
    "int_type": "int",
    "float_type": "float or int",
    "string_type": "str",
    "bool_type": "bool",
    "list_type": "a list",
    "tuple_type": "a list",
    "dict_type": "a table",
    "model_type": "a table",
    "model_attributes_type": "a table",
    "int_from_float": "int",
}


def describe(exc: ValidationError, model: type[BaseModel], where: tuple[str, ...] = ()) -> str:
    """The first error of ``exc`` as ``section.key what was wrong; how to fix it``."""
    err = exc.errors(include_url=False)[0]
    loc = tuple(str(p) for p in err["loc"] if not _is_union_tag(p))
    kind, value, ctx = err["type"], err.get("input"), err.get("ctx") or {}
    key = _dotted((*where, *loc))
    if kind == "value_error" and isinstance(ctx.get("error"), Invalid):
        inner: Invalid = ctx["error"]
        text = inner.text.replace("{section}", key)
        if not inner.key and text.startswith(("set ", "the ", "unknown ", "[", key)):
            return text  # a sentence about the section that names its keys itself
        named = () if loc and loc[-1] == inner.key else (inner.key,)
        return f"{_dotted((*where, *loc, *named))} {text}"
    if kind == "value_error":
        return f"{key}: {ctx.get('error', err['msg'])}" if key else str(ctx.get("error"))
    if kind == "extra_forbidden":
        accepted = _accepted(model, loc[:-1])
        table = _dotted((*where, *loc[:-1])) or "the top level"
        return f"unknown key {key}; accepted keys in [{table}]: {accepted}"
    if kind == "missing":
        return f"required key {key!r} is missing"
    if kind == "literal_error":
        choices = [
            c.strip() for c in str(ctx.get("expected", "")).replace(" or ", ", ").split(", ")
        ]
        if len(choices) == 2:
            return f"{key} must be {choices[0]} or {choices[1]}, got {value!r}"
        return f"{key} must be one of [{', '.join(choices)}], got {value!r}"
    if kind in _KINDS:
        if kind in ("dict_type", "model_type", "model_attributes_type"):
            return f"{key} must be a table ([{key}])"
        return f"{key} must be {_KINDS[kind]}, got {value!r}"
    for bound, word in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
        if bound in ctx:
            return f"{key} must be {word} {ctx[bound]}, got {value!r}"
    return f"{key}: {err['msg']}, got {value!r}"


def _is_union_tag(part: Any) -> bool:
    text = str(part)
    return text.startswith(("function-", "tagged-union")) or text in ("int", "str", "list")


def _dotted(parts: tuple[str, ...]) -> str:
    return ".".join(p for p in parts if p != "")


def _accepted(model: type[BaseModel], loc: tuple[str, ...]) -> list[str]:
    """The keys accepted by the table at ``loc`` of ``model`` (sorted)."""
    current: Any = model
    for part in loc:
        fields = getattr(current, "model_fields", None)
        if fields is None or part not in fields:
            return []
        current = _section_type(fields[part].annotation)
    fields = getattr(current, "model_fields", {})
    return sorted(f.alias or name for name, f in fields.items())


def _section_type(annotation: Any) -> Any:
    """The `Section` class inside ``annotation`` (``X``, ``X | None``, ``Annotated[X, ...]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _section_type(arg)
        if found is not None:
            return found
    return None


__all__ = [
    "Ints",
    "Invalid",
    "Names",
    "Section",
    "base_dir",
    "describe",
    "load_toml",
    "read_toml",
    "resolve_file",
    "validate",
]
