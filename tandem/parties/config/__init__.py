"""Typed configuration: one mechanism (pydantic v2 models, docs/design.md) for every TOML file.

`base` holds the generic layer (`Section`, `load_toml`, `validate`, located errors);
`sections` the tables several files share, each declared once.
"""

from .base import Invalid, Section, load_toml, read_toml, validate
from .sections import Data, Http, Identities, Listen, Log, Model, Peers, Security

__all__ = [
    "Data",
    "Http",
    "Identities",
    "Invalid",
    "Listen",
    "Log",
    "Model",
    "Peers",
    "Section",
    "Security",
    "load_toml",
    "read_toml",
    "validate",
]
