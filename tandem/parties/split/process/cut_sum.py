"""The secure sum's start-up in a standalone party: ``[model] aggregate`` into the spec, the
followers' signed key offers relayed inside it, and each party's `CutSum`.

The offers ride the negotiation the parties already run: each follower adds ``sum_offer`` (its
X25519 public key signed with its ``[security] private_key``) to the data description it gives
the leader; the leader records every follower's offer in the spec's ``hyper["sum_offers"]``
and proposes it; each follower checks every other follower's offer against its own roster
(``[security.public_keys]``) before accepting, so a leader that substitutes a key is refused.
The spec hash covers the offers. A follower's X25519 key lives in memory for this run only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from tandem.engine.topology import Topology
from tandem.errors import AuthenticationError, ConfigError

from ...privacy.masks import KeyShare
from ...privacy.securesum import CutSum, from_spec, hyper_of_model, mismatch_reasons

NEEDS_KEYS = (
    "model.aggregate = 'secure_sum' needs per-party keys on every follower: set [security] "
    "private_key and [security.public_keys] (`tandem keys generate NAME`); with only a shared "
    "secret the leader that relays the followers' keys could substitute them"
)


def _context(topology: Topology) -> str:
    return "split secure sum\n" + ",".join(sorted(topology.parties))


def _keys(cfg: Any):
    """(signing key, roster) of ``cfg``'s ``[security]``, or (None, None) without keys."""
    from tandem.parties.http_security import security_of

    settings = security_of(cfg.config.security).transport_settings()
    return settings.get("signing_key"), settings.get("roster")


def _share(cfg: Any) -> KeyShare:
    share = getattr(cfg, "_sum_share", None)
    if share is None:
        share = KeyShare()
        cfg._sum_share = share
    return share


def secure(cfg: Any) -> bool:
    return hyper_of_model(cfg.model).get("aggregate") == "secure_sum"


def offer(cfg: Any) -> dict | None:
    """A secure-sum follower's signed offer (None without keys: its check then refuses)."""
    signer, _ = _keys(cfg)
    if signer is None:
        return None
    return _share(cfg).offer(cfg.name, signer, _context(cfg.topology()))


def spec_hyper(cfg: Any, described: Mapping[str, Mapping[str, Any]]) -> dict:
    """The leader's cut-sum entries of the spec's ``hyper``: ``[model]``'s keys and the
    followers' offers as they described them."""
    out = hyper_of_model(cfg.model)
    if out.get("aggregate") == "secure_sum":
        out["sum_offers"] = {
            p: dict(d["sum_offer"]) for p, d in described.items() if d.get("sum_offer")
        }
    return out


def _agree(cfg: Any, hyper: Mapping[str, Any], topology: Topology) -> dict[str, bytes]:
    signer, roster = _keys(cfg)
    if signer is None or roster is None:
        raise ConfigError(NEEDS_KEYS)
    offers = dict(hyper.get("sum_offers") or {})
    summed = topology.loss_stage
    followers = sorted({topology.by_name[i].owner for i in summed.inputs})
    missing = [p for p in followers if p not in offers]
    if missing:
        raise ConfigError(f"the spec carries no secure-sum key offer of {missing}; " + NEEDS_KEYS)
    mine = offers[cfg.name]
    if mine.get("public") != _share(cfg).public_hex:
        raise AuthenticationError(
            f"the spec's secure-sum offer of {cfg.name!r} is not the key it sent; the leader "
            "relays offers unchanged"
        )
    return _share(cfg).agree(cfg.name, list(offers.values()), roster, _context(topology))


def follower_reasons(cfg: Any, hyper: Mapping[str, Any], topology: Topology) -> list[str]:
    """Why a follower refuses the spec's cut sum ([] = accept)."""
    reasons = mismatch_reasons(hyper, hyper_of_model(cfg.model), repr(cfg.name))
    if reasons or hyper.get("aggregate") != "secure_sum":
        return reasons
    try:
        _agree(cfg, hyper, topology)
    except (ConfigError, AuthenticationError) as exc:
        return [str(exc)]
    return []


def party_cut_sum(cfg: Any, hyper: Mapping[str, Any], topology: Topology) -> CutSum | None:
    """This party's `CutSum` for the agreed spec (a secure-sum follower's with its seeds)."""
    cs = from_spec(hyper, topology)
    if cs is None or not cs.secure or cfg.name == topology.label_owner:
        return cs
    return cs.for_follower(cfg.name, _agree(cfg, hyper, topology))


# -- `tandem predict`: the same sum over the training's exports ---------------------------------
def with_cut_sum(cfg: Any, spec: Any) -> Any:
    """Leader: the inference ``spec`` as is without a cut sum; else a function of the
    followers' descriptions (`tandem.parties.split.process.session.connect`) that adds the
    cut-sum entries (and, for a secure sum, their fresh key offers) to its ``hyper``."""
    if not hyper_of_model(cfg.model):
        return spec

    def build(described: Mapping[str, Mapping[str, Any]]):
        return dataclasses.replace(spec, hyper={**spec.hyper, **spec_hyper(cfg, described)})

    return build


def checking(cfg: Any, topology: Topology, check: Callable[[Any], list[str]]):
    """Follower: ``check`` plus the cut sum's reasons (`follower_reasons`)."""

    def both(spec: Any) -> list[str]:
        return [*check(spec), *follower_reasons(cfg, spec.hyper, topology)]

    return both


def describing(cfg: Any) -> Callable[[], dict] | None:
    """Follower: what it tells a leader that asks before an inference proposal: its key offer
    of a secure sum (None without one)."""
    if not secure(cfg):
        return None
    return lambda: {"sum_offer": offer(cfg)}
