"""The (epsilon, delta) of activation DP (`tandem.parties.privacy.feature`), by dp-accounting.

Each training step releases, for every row of its batch, that row's clipped activation plus
Gaussian noise of std ``noise_multiplier * clip``: the Gaussian mechanism with noise multiplier
``noise_multiplier`` on that row (neighbouring datasets: one row's activation present or
replaced by zeros, L2 sensitivity ``clip``; for replace-one neighbours the epsilon is that of
``noise_multiplier / 2``). There is no amplification by sampling: the leader, which receives
the activations, draws the batches and names their rows' ids, so it knows whose activation each
released row is. A row is released once per epoch (every epoch's batches cover every row once),
so after ``steps`` steps of ``ceil(samples / batch_size)`` per epoch a row has been released at
most ``ceil(steps / that)`` times; the RDP accountant of the ``dp-accounting`` package (the
``privacy`` extra) composes that many Gaussian mechanisms into epsilon at the configured delta.
The bound covers what each row's own released activations reveal; the bottom model is trained
on the clean features, so what its later activations of other rows reveal about a row is not
accounted.
"""

from __future__ import annotations

import functools

from tandem._extras import needs

from .config import Privacy


@functools.lru_cache(maxsize=256)
def activation_epsilon(
    noise_multiplier: float, sampling_rate: float, steps: int, delta: float
) -> float:
    """Epsilon of ``steps`` Poisson-sampled Gaussian mechanisms at ``sampling_rate`` (1.0: each
    step releases the row; 0.0 for no steps); pure, cached."""
    if steps <= 0:
        return 0.0
    with needs("privacy", "the activation-DP accountant ([privacy.activation_dp])"):
        from dp_accounting import dp_event, rdp

    accountant = rdp.RdpAccountant()
    event = dp_event.PoissonSampledDpEvent(
        min(1.0, float(sampling_rate)), dp_event.GaussianDpEvent(float(noise_multiplier))
    )
    accountant.compose(event, int(steps))
    return float(accountant.get_epsilon(float(delta)))


def epoch_report(
    privacy: Privacy, *, batch_size: int, samples: int, steps: int
) -> dict[str, float]:
    """What an epoch's history records of the privacy spent: ``privacy_epsilon`` (and its
    ``privacy_delta``) of activation DP after ``steps`` training steps on batches of
    ``batch_size`` of ``samples`` rows: the epsilon of the most releases of one row (one per
    epoch begun, see the module docstring); ``{}`` without activation DP. The parameters are the
    negotiated spec's, so the leader reports the followers' spend."""
    dp = privacy.activation_dp
    if dp is None or samples <= 0:
        return {}
    per_epoch = -(-samples // max(batch_size, 1))
    releases = -(-max(steps, 0) // per_epoch)
    eps = activation_epsilon(dp.noise_multiplier, 1.0, releases, dp.delta)
    return {"privacy_epsilon": eps, "privacy_delta": dp.delta}


__all__ = ["activation_epsilon", "epoch_report"]
