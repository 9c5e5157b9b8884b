"""Shared small federation for the FL tests: one trainer per session, so JAX compiles the
local step and the compression kernels once for all FL tests."""

from __future__ import annotations

import functools

from tandem.parties.fl.aggregate import ServerRule
from tandem.parties.fl.client import compress_update
from tandem.parties.fl.data import load_federated_digits
from tandem.parties.fl.federation import make_trainer
from tandem.parties.fl.server import FLConfig

UPLINK = {"kind": "randk", "k": 40}


@functools.lru_cache(maxsize=1)
def small_setup():
    """(data, trainer): 4 clients, MLP 64-16-10, warmed up (compiled)."""
    data = load_federated_digits(4, 0.5, seed=1)
    trainer = make_trainer(data, [16], lr=0.1, epochs=1)
    x, y = data.clients[0]
    trainer.train(trainer.init_vec, x, y, 0)
    trainer.accuracy(trainer.init_vec, data.x_test, data.y_test)
    compress_update(trainer.init_vec, UPLINK, 0)  # compile the uplink kernels too
    return data, trainer


def compressed(rounds: int, timeout: float, **kw) -> FLConfig:
    base = dict(
        rounds=rounds,
        fraction=1.0,
        round_timeout=timeout,
        uplink=UPLINK,
        rule=ServerRule(momentum=0.5, topk=60),
        downlink="version",
        seed=3,
    )
    base.update(kw)
    return FLConfig(**base)
