"""The hyper-parameters and security settings of the small task specs that tests build with
`tandem.parties.split.spec.build_spec`: one place for the keys a spec needs, each test naming
only what it changes."""

from __future__ import annotations

from typing import Any


def small_hyper(**changes: Any) -> dict[str, Any]:
    """A spec's ``hyper``: batches of 8 rows in one group, SGD at 0.1 on the binary loss, one
    epoch, the priority policy, no checkpoints; ``changes`` replace or add keys."""
    return {
        "batch_size": 8,
        "eval_batch_size": 8,
        "groups": 1,
        "learning_rate": 0.1,
        "optimizer": "sgd",
        "loss": "binary",
        "epochs": 1,
        "seed": 0,
        "threshold": 2,
        "capacity": 8,
        "policy": "priority",
        "checkpoint_every": 0,
        **changes,
    }


def open_security(**changes: Any) -> dict[str, Any]:
    """A spec's ``security``: no authentication, no TLS, frames up to 1 MiB, non-finite
    values let through; ``changes`` replace keys."""
    return {
        "auth": "none",
        "tls": False,
        "max_frame_bytes": 1 << 20,
        "reject_nonfinite": False,
        **changes,
    }
