"""The errors of the data layer. It derives from `tandem.errors.ConfigError`: bad data is a
setting the user has to change (a file, a column, a `[data]` key)."""

from __future__ import annotations

from tandem.errors import ConfigError


class DataError(ConfigError):
    """A `[data]` key, a data file or a value in it is wrong.

    The message names the file (the TOML file for a key, the table for a value), the column or
    key, the row where one is at fault (0-based data row, header excluded), and the fix.
    """


class IdError(DataError, ValueError):
    """An id has a type or value that cannot be encoded canonically (the message names it)."""


class AlignedFileError(DataError):
    """An aligned-rows file (`tandem align --out`) is missing or malformed (the message names
    the file and the problem)."""


__all__ = ["AlignedFileError", "DataError", "IdError"]
