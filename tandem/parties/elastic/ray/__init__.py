"""Elastic training placed, scaled and restarted by a Ray cluster (``tandem[ray]``).

``tandem elastic launch --config job.toml --ray ADDRESS``, or from Python (in a running loop)::

    summary = await tandem.parties.elastic.ray.launch("job.toml", address="auto")

The job file (`job`), the one actor class (`actors`), each role's main from a table (`roles`),
the scaling rule (`supervisor`) and the launch itself (`launch`). Importing this package does
not import Ray; launching does (through `tandem._extras.needs`). docs/cluster.md.
"""

from .job import Job, RaySection, read_job
from .launch import RayLaunch, launch
from .supervisor import decide

__all__ = ["Job", "RayLaunch", "RaySection", "decide", "launch", "read_job"]
