"""The export format shared by split learning, federated learning and elastic training.

An export is one safetensors file per party: its stages' parameters, each stage's model
reference (the spec `tandem.parties.models.model_from_spec` rebuilds), the preprocessing state
and data fingerprint, and what a peer needs to check it (`stages` documents the format).
`model.load_model` rebuilds a party's stages from its export (`PartyModel`), whichever system
wrote it.
"""

from .stages import (
    FORMAT,
    OPTIONAL_FIELDS,
    VERSION,
    ExportError,
    ExportMismatchError,
    LoadedStages,
    describe,
    load_stages,
    read_description,
    save_stages,
)

__all__ = [
    "FORMAT",
    "OPTIONAL_FIELDS",
    "VERSION",
    "ExportError",
    "ExportMismatchError",
    "LoadedStages",
    "describe",
    "load_stages",
    "read_description",
    "save_stages",
]
