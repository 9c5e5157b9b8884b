"""User model factories named by import path: ``"package.module:function"`` plus JSON kwargs.

`load_factory(reference, kwargs)` imports ``package.module``, calls ``function(**kwargs)`` and
checks it returned a `tandem.engine.kernels.StageModel`. The model's ``spec`` becomes
``{"kind": "factory", "factory": reference, "kwargs": kwargs}``: what an export records, and
what `tandem.parties.models.model_from_spec` calls again to rebuild the model for prediction.
So a factory must be deterministic in its kwargs (same kwargs, same model), and its kwargs are
JSON data (str, int, float, bool, None, lists, tables with str keys) — never arrays or objects.

Rebuilding an export imports the module it names: load only exports your own training wrote,
on a machine where that module is installed.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import numbers
import re
from collections.abc import Mapping
from typing import Any

from tandem.engine.kernels import StageModel
from tandem.errors import ConfigError

_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
REFERENCE = re.compile(rf"^{_NAME}(\.{_NAME})*:{_NAME}(\.{_NAME})*$")


def check_reference(reference: Any) -> str:
    """``reference`` if it has the form ``"package.module:attribute"``, else `ConfigError`."""
    if not isinstance(reference, str) or not REFERENCE.match(reference):
        raise ConfigError(
            f"model factory {reference!r} is not an import reference; write it as "
            "'package.module:function' (e.g. factory = \"mypkg.models:bottom\")"
        )
    return reference


def json_data(value: Any, where: str) -> Any:
    """``value`` as plain JSON data (tuples become lists); `ConfigError` naming the first part
    that is not JSON data (an array, an object, a non-str key, NaN or infinity)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(f"{where} is {value!r}; JSON data holds only finite numbers")
        return float(value)
    if isinstance(value, (list, tuple)):
        return [json_data(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigError(f"{where} has key {k!r}; JSON tables need str keys")
            out[k] = json_data(v, f"{where}.{k}")
        return out
    raise ConfigError(
        f"{where} is a {type(value).__name__}, not JSON data (str, int, float, bool, None, "
        "lists, tables): pass plain values and build arrays or objects inside the factory"
    )


def factory_spec(reference: str, kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The spec of the model ``reference(**kwargs)`` returns (checked; kwargs as JSON data)."""
    reference = check_reference(reference)
    kw = json_data({} if kwargs is None else kwargs, f"kwargs of {reference!r}")
    if not isinstance(kw, dict):
        raise ConfigError(f"kwargs of {reference!r} must be a table of keyword arguments")
    return {"kind": "factory", "factory": reference, "kwargs": kw}


def load_factory(reference: str, kwargs: Mapping[str, Any] | None = None) -> StageModel:
    """The `StageModel` that ``reference(**kwargs)`` returns, with its factory spec.

    Raises `ConfigError` naming the reference and the fix when the reference is malformed, its
    module cannot be imported, the attribute is missing or not callable, the call fails, or
    it returns something other than a `StageModel`.
    """
    spec = factory_spec(reference, kwargs)
    module_name, attr = spec["factory"].split(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"model factory {reference!r}: cannot import {module_name!r} ({exc}); install the "
            "package that provides it, or fix the module path (PYTHONPATH for a local module)"
        ) from None
    except Exception as exc:
        raise ConfigError(
            f"model factory {reference!r}: importing {module_name!r} raised "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(obj) if not n.startswith("_"))[:20]
            raise ConfigError(
                f"model factory {reference!r}: {getattr(obj, '__name__', obj)!r} has no "
                f"attribute {part!r}; it defines {public}"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"model factory {reference!r} is a {type(obj).__name__}, not callable")
    try:
        model = obj(**spec["kwargs"])
    except Exception as exc:
        raise ConfigError(
            f"model factory {reference!r} called with kwargs {spec['kwargs']} raised "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(model, StageModel):
        raise ConfigError(
            f"model factory {reference!r} returned a {type(model).__name__}, not a StageModel; "
            "return tandem.parties.models.mlp(...) / embedding_mlp(...), or wrap your model "
            "with from_functions, from_flax_linen, from_flax_nnx or from_equinox"
        )
    return dataclasses.replace(model, spec=spec)
