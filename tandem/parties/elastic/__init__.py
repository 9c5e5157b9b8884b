"""Elastic training: a static coordinator, data servers hosting parameter servers, and
stateless workers that may join or die at any moment (see ``docs/elastic.md``).

Pure state machines: `membership` (heartbeat survival detection against an injected clock) and
`ledger` (batch bookkeeping per generation). Roles: `coordinator`, `data_server`, `worker`,
all speaking only through `tandem.transports.base.Transport`.
"""
