"""The names other modules and tests have imported from here: the party's configuration
(`tandem.parties.split.process.config`, plain data) and what it builds
(`tandem.parties.split.process.build`, `tandem.parties.split.process.build_data`)."""

from __future__ import annotations

from ..hyper import FOLLOWER_TRAIN_KEYS, Train
from .build import (
    DataConfig,
    PartySetup,
    load_party_config,
    models_from_widths,
    split_config_from,
)
from .build_data import PartyData
from .config import Checkpoint, PartyConfig, PartyConfigError, load_party_file

__all__ = [
    "Checkpoint",
    "DataConfig",
    "FOLLOWER_TRAIN_KEYS",
    "PartyConfig",
    "PartyConfigError",
    "PartyData",
    "PartySetup",
    "Train",
    "load_party_config",
    "load_party_file",
    "models_from_widths",
    "split_config_from",
]
