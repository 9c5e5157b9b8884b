"""The (epsilon, delta) of activation DP (`tandem.parties.privacy.feature`), by dp-accounting.

Each training step releases, for every row of its batch, that row's clipped activation plus
Gaussian noise of std ``noise_multiplier * clip``: the Gaussian mechanism with noise multiplier
``noise_multiplier``, on a batch drawn with sampling rate ``batch_size / samples``. The steps
compose; the RDP accountant of the ``dp-accounting`` package (the ``privacy`` extra) turns the
composition into epsilon at the configured delta. The accounting treats batches as Poisson
sampled, the standard approximation for shuffled fixed-size batches (DP-SGD practice).
"""

from __future__ import annotations

import functools

from tandem._extras import needs

from .config import Privacy


@functools.lru_cache(maxsize=256)
def activation_epsilon(
    noise_multiplier: float, sampling_rate: float, steps: int, delta: float
) -> float:
    """Epsilon after ``steps`` training steps (0.0 for none); pure, cached."""
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
    ``batch_size`` of ``samples`` rows; ``{}`` without activation DP. The parameters are the
    negotiated spec's, so the leader reports the followers' spend."""
    dp = privacy.activation_dp
    if dp is None or samples <= 0:
        return {}
    eps = activation_epsilon(dp.noise_multiplier, batch_size / samples, steps, dp.delta)
    return {"privacy_epsilon": eps, "privacy_delta": dp.delta}


__all__ = ["activation_epsilon", "epoch_report"]
