"""The leader's remembered micro-batch count: where an earlier run of the same job settled.

With ``[train] groups = "auto"`` the leader's tuner searches the count (trying a few, each a
new kernel shape) at the start of every run. A repeated run of the same job (a daily
retrain, a rerun with other data) on the same machines would search again and, for every
count it tries that the earlier run did not, compile again. So the leader keeps, in its
compile cache folder (`tandem.parties.compile_cache`; off with it), the count each job last
settled on (`Settled`: with the tuner's wait between re-checks then and the count's wall),
and a later run of the job starts there, settled (`GroupTuner.resume`): it loads that
count's kernels from the cache and skips the search. It waits twice as long as the earlier
run before probing the neighbours again (each probe runs slower counts), unless its own
wall at the count drifts from the remembered one (the tuner's rule 6): then it re-checks at
once, as it does after any change of machine or link.

The job is identified by `job_key`: the agreed task spec without its data (topology,
stages, edges, hyper-parameters, security; not the datasets, row counts, alignment, nor the
data fingerprints and test and validation sizes recorded among the hyper-parameters,
which change from run to run without changing the kernels or the traffic per batch) and
the leader's peers' hosts (another link may want another count; not their ports, which a
rerun may pick anew). A checkpoint's count, when a run resumes, wins over the remembered one.

The file (`FILE`) is a cache: a missing, unreadable or malformed file, or an entry that is
not a count the batch allows, is ignored (and then rewritten), since any count trains the
same model (docs/design.md, "Exactness"); only the speed of the first batches is at stake.
For the same reason a file that cannot be written (a read-only folder, a full disk) is
logged as a warning and the run goes on. It holds at most `KEEP` jobs, the most recently
written first, and is replaced atomically.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import tempfile
from collections.abc import Mapping
from urllib.parse import urlsplit

from ..spec import TaskSpec

#: The file's name in the compile cache folder.
FILE = "tuned-groups.json"
#: Jobs the file remembers (the oldest written is dropped first).
KEEP = 64
#: The spec's ``hyper`` keys that describe the data, not the job (left out of `job_key`).
_DATA_HYPER = ("fingerprints", "test_samples", "validation_samples")

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Settled:
    """Where a run's tuner settled: the count ``n``, its wait between re-checks
    (``interval``, `TunerState.interval`; 0: none yet) and the count's wall in seconds per
    batch (``wall``, `GroupTuner.mean`; None: too few samples)."""

    n: int
    interval: int = 0
    wall: float | None = None


def job_key(spec: TaskSpec, peers: Mapping[str, str]) -> str:
    """SHA-256 hex of the spec's data-free fields and the peers' names and hosts (module
    docstring); ``peers`` maps each peer's name to its URL."""
    fields = spec.to_dict()
    for data_field in ("datasets", "samples", "alignment"):
        fields.pop(data_field)
    fields["hyper"] = {k: v for k, v in fields["hyper"].items() if k not in _DATA_HYPER}
    fields["peers"] = {name: urlsplit(url).hostname for name, url in sorted(peers.items())}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def recall(folder: str | None, key: str, batch: int) -> Settled | None:
    """Where the job ``key`` settled before, from ``folder``, or None (no folder, no file, no
    entry, or an entry `parse` refuses). Blocking file I/O: call it in a thread from async
    code."""
    if folder is None:
        return None
    return parse(_read(os.path.join(folder, FILE)).get(key), batch)


def parse(entry: object, batch: int) -> Settled | None:
    """An entry (``{"n", "interval", "wall"}``, or a bare count as earlier versions wrote) as
    `Settled`, or None when its count is not an int in ``[1, batch]``; a malformed
    ``interval`` or ``wall`` is dropped (0, None) and the count still used. The file's
    entries and a checkpoint's ``tuned_*`` fields are read so."""
    if not isinstance(entry, dict):
        entry = {"n": entry}
    n, interval, wall = entry.get("n"), entry.get("interval"), entry.get("wall")
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= batch:
        return None
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
        interval = 0
    if not isinstance(wall, int | float) or isinstance(wall, bool):
        wall = None
    elif not (math.isfinite(wall) and wall > 0):
        wall = None
    return Settled(n, interval, None if wall is None else float(wall))


def remember(folder: str | None, key: str, settled: Settled) -> bool:
    """Record ``settled`` for ``key`` in ``folder`` (nothing without a folder), keeping the
    `KEEP` most recently written jobs; the file is replaced atomically. False (and a warning
    logged) when it cannot be written. Blocking file I/O."""
    if folder is None:
        return False
    path = os.path.join(folder, FILE)
    entries = {k: v for k, v in _read(path).items() if k != key}
    kept = dict([(key, dataclasses.asdict(settled)), *list(entries.items())[: KEEP - 1]])
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tuned-", suffix=".json")
    except OSError as exc:
        log.warning("could not remember the tuned micro-batch count in %s: %s", folder, exc)
        return False
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(kept, f)
        os.replace(tmp, path)
    except OSError as exc:
        os.unlink(tmp)
        log.warning("could not remember the tuned micro-batch count in %s: %s", path, exc)
        return False
    return True


def _read(path: str) -> dict[str, object]:
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
