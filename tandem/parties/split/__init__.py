"""Split learning (vertical federated learning) roles."""

from .party import EpochResult, SplitConfig, SplitParty

__all__ = ["SplitParty", "SplitConfig", "EpochResult"]
