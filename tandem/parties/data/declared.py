"""Declared vocabularies (``[data] vocabularies = "<file>.json"``): categorical codes fixed by a
list the user gives instead of fitted to the training rows.

A party that knows the full set of values a categorical column can take (a product catalog,
a list of merchant or diagnosis codes) declares it in a JSON file, one list per column::

    {"merchant": [5411, 5812, 5999], "country": ["DE", "FR", "NL"]}

The column's vocabulary is then that list, sorted (the codes follow the same rule as a fitted
vocabulary: the *i*-th value in sorted order has code *i* + 1, 0 is a value outside it or a
missing cell). So the embedding table has the same length whatever rows a run trains on, and a
value the training rows lack still has its own code. Columns the file does not name keep the
fitted vocabulary.

`read_declared(url, categorical, where)` reads and checks the file; every refusal is a
`DataError` naming the file, the column and the fix: a column that is not in
``data.categorical``, a list that is empty, mixes numbers and text, holds something else
(true/false, fractions, null) or holds a value twice. Whether the list suits the column's
values (numbers for a number column, text for a text column, at least one training value in
it) is checked when the column is fitted (`tandem.parties.data.preprocess`).
"""

from __future__ import annotations

from collections.abc import Sequence

from .errors import DataError

#: a declared vocabulary: ``(kind, sorted values)``, kind "int" or "string"
Declared = tuple[str, tuple[int | str, ...]]


def read_declared(url: str, categorical: Sequence[str], where: str) -> dict[str, Declared]:
    """The vocabularies the JSON file ``url`` declares, by column (see the module docstring);
    ``categorical`` is the config's categorical columns, ``where`` the TOML file (messages)."""
    import fsspec
    import orjson

    try:
        with fsspec.open(url, "rb") as f:
            raw = orjson.loads(f.read())
    except FileNotFoundError:
        raise DataError(f"{where}: data.vocabularies {url!r}: no such file") from None
    except orjson.JSONDecodeError as exc:
        raise DataError(
            f"{where}: data.vocabularies {url!r} is not valid JSON ({exc}); it must be one "
            'object of lists, e.g. {"city": ["Lyon", "Paris"]}'
        ) from None
    if not isinstance(raw, dict):
        raise DataError(
            f"{where}: data.vocabularies {url!r} holds a {type(raw).__name__}; it must be one "
            'object of lists, e.g. {"city": ["Lyon", "Paris"]}'
        )
    unknown = [name for name in raw if name not in categorical]
    if unknown:
        raise DataError(
            f"{where}: data.vocabularies {url!r} lists {unknown}, which data.categorical does "
            f"not ({list(categorical)}); add them to data.categorical or remove them from the file"
        )
    return {name: _declared(url, name, values, where) for name, values in raw.items()}


def _declared(url: str, name: str, values: object, where: str) -> Declared:
    at = f"{where}: data.vocabularies {url!r}, column {name!r}"
    if not isinstance(values, list) or not values:
        raise DataError(f"{at}: must be a non-empty list of the column's values, got {values!r}")
    kinds = {type(v) for v in values}
    if kinds == {int}:
        kind = "int"
    elif kinds == {str}:
        kind = "string"
    else:
        odd = [v for v in values if type(v) not in (int, str)]
        if odd:
            raise DataError(
                f"{at}: holds {odd[0]!r} (from JSON {_json_text(odd[0])}); a value is a whole "
                "number or text, listed exactly as the column holds it"
            )
        raise DataError(
            f"{at}: mixes numbers and text; list the values exactly as the column holds them "
            "(all numbers for a number column, all text for a text column)"
        )
    ordered = sorted(values)
    twice = next((a for a, b in zip(ordered, ordered[1:], strict=False) if a == b), None)
    if twice is not None:
        raise DataError(f"{at}: lists {twice!r} twice; list each value once")
    return kind, tuple(ordered)


def _json_text(value: object) -> str:
    import orjson

    return orjson.dumps(value).decode()


__all__ = ["Declared", "read_declared"]
