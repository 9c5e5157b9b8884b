"""Server-side update rule of federated averaging with compression (pure, no asyncio).

Given the combination ``g_t`` of the clients' (decompressed) updates (by the server's
`tandem.parties.fl.aggregator.Aggregator`, a weighted mean by default):

1. momentum (optional): ``m_t = rho * m_{t-1} + g_t``; the step uses ``m_t``;
2. scale by the server learning rate;
3. error feedback with top-k (optional): ``acc = step + residual``; apply the top-k entries of
   ``acc`` and keep the rest as the new residual (``selected + residual == acc`` exactly).

With ``topk=None``, ``rho=0`` and ``lr=1`` this is plain FedAvg (the model moves by the
weighted mean delta). State is an explicit `ServerState` passed in and out.

`optax_step` replaces steps 1-2 by any optax optimizer (FedOpt): the pseudo-gradient is
``-g_t``, so ``optax.sgd(1.0)`` is FedAvg, ``optax.sgd(lr, momentum=rho)`` is the momentum rule
above, ``optax.adam`` is FedAdam and ``optax.yogi`` FedYogi; step 3 (error feedback with top-k)
applies to the optimizer's update unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np
import optax

from tandem.errors import ConfigError

from .compression import error_feedback


@dataclasses.dataclass(frozen=True)
class ServerRule:
    """``momentum`` rho in [0, 1); ``topk`` entries applied per round (None = all, no error
    feedback); ``lr`` server learning rate; ``momentum_stop``: zero the momentum on applied
    coordinates (FetchSGD's momentum stopping, avoids re-applying old momentum)."""

    momentum: float = 0.0
    topk: int | None = None
    lr: float = 1.0
    momentum_stop: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"server momentum must be in [0, 1), got {self.momentum}")
        if self.topk is not None and self.topk < 1:
            raise ConfigError(f"server topk must be >= 1 or None, got {self.topk}")
        if not self.lr > 0:
            raise ConfigError(f"server lr must be > 0, got {self.lr}")


@dataclasses.dataclass
class ServerState:
    momentum: jnp.ndarray
    residual: jnp.ndarray

    @classmethod
    def zeros(cls, d: int) -> ServerState:
        return cls(jnp.zeros((d,), jnp.float32), jnp.zeros((d,), jnp.float32))


def server_step(
    rule: ServerRule, state: ServerState, aggregate
) -> tuple[np.ndarray | None, np.ndarray, ServerState]:
    """One server update. Returns ``(indices, values, new_state)``: the model moves by
    ``values`` at ``indices`` (``indices is None`` means a dense ``values`` vector)."""
    g = jnp.asarray(aggregate, jnp.float32)
    m = state.momentum
    if rule.momentum:
        m = rule.momentum * m + g
        g = m
    step = g * rule.lr if rule.lr != 1.0 else g
    if rule.topk is None:
        return None, np.asarray(step), ServerState(m, state.residual)
    selected, residual = error_feedback(step, state.residual, min(rule.topk, g.shape[0]))
    sel = np.asarray(selected)
    idx = np.flatnonzero(sel)
    if rule.momentum and rule.momentum_stop:
        m = m.at[idx].set(0.0)
    return idx, sel[idx], ServerState(m, residual)


def optax_step(
    optimizer: optax.GradientTransformation,
    opt_state: Any,
    model: np.ndarray,
    aggregate,
    *,
    topk: int | None,
    residual: jnp.ndarray,
) -> tuple[np.ndarray | None, np.ndarray, Any, jnp.ndarray]:
    """One FedOpt server update over the flat ``model`` with pseudo-gradient ``-aggregate``.

    Returns ``(indices, values, new_opt_state, new_residual)`` with the meaning of
    `server_step`: the model moves by ``values`` at ``indices`` (None: dense). With ``topk``
    the optimizer's update goes through error feedback (``residual`` in, new residual out).
    """
    g = -jnp.asarray(aggregate, jnp.float32)
    updates, opt_state = optimizer.update(g, opt_state, jnp.asarray(model, jnp.float32))
    step = jnp.asarray(updates, jnp.float32)
    if topk is None:
        return None, np.asarray(step), opt_state, residual
    selected, residual = error_feedback(step, residual, min(topk, step.shape[0]))
    sel = np.asarray(selected)
    idx = np.flatnonzero(sel)
    return idx, sel[idx], opt_state, residual
