"""The federated global model, in the export format every system shares (a one-stage export).

`export_global(path, model_vec, setup, party=...)` writes ``path`` with
`tandem.parties.export.save_stages`: one stage, ``"global"``, owned by the server, on
the features, carrying the loss; the model spec, its output width, a training id and the loss
are recorded, so `tandem.parties.export.model.load_model_sync` rebuilds it like any party's
export. Its ``data`` field holds the server's preprocessing state
(`tandem.parties.data.Preprocessing.to_json`) and its data fingerprint, as every party's export
does: `tandem.parties.data.load_new_data` applies exactly that state to new rows.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

import numpy as np

from tandem.engine.topology import FEATURES, Stage, Topology
from tandem.parties.export import save_stages

from .compression import unflatten
from .task import Task
from .train import LocalTrainer


class Exportable(Protocol):
    """What `export_global` reads of a server's setup (`server_process.ServerSetup` is one)."""

    @property
    def task(self) -> Task: ...
    @property
    def trainer(self) -> LocalTrainer: ...
    @property
    def preprocessing(self) -> dict[str, Any]: ...
    @property
    def fingerprint(self) -> str: ...


STAGE = "global"


def global_topology(party: str) -> Topology:
    """One stage on ``party``'s features that owns the loss."""
    return Topology((Stage(STAGE, party, (FEATURES,), loss=True),))


def export_global(path: str, model: np.ndarray, setup: Exportable, *, party: str) -> str:
    """Write the export and its preprocessing file (blocking); returns ``path``."""
    import jax

    params = jax.tree_util.tree_map(np.asarray, unflatten(model, setup.trainer.spec))
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    task = setup.task
    save_stages(
        path,
        {STAGE: params},
        topology=global_topology(party).to_dict(),
        party=party,
        models={STAGE: dict(task.model)},
        widths={STAGE: setup.trainer.model.out_dim},
        training=f"fl-{task.identity}",
        loss=task.loss,
        data={"preprocessing": setup.preprocessing, "fingerprint": setup.fingerprint},
    )
    return path


__all__ = ["STAGE", "export_global", "global_topology"]
