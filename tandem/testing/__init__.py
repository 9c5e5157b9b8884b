"""Tools to attack a Tandem deployment, for its tests and for ``python -m bench.hostile``.

The other party is another organisation and the network is hostile (docs/security.md). These
modules hold the attacks the project's own checks run, so a user can aim the same ones at a
job of their own:

* `hostile_bodies`: an outsider's requests, no credentials needed: raw HTTP requests
  (`hostile_bodies.raw_request`), a compressed body that inflates far past every bound
  (`hostile_bodies.bomb`), bodies drained slowly;
* `hostile_insider`: a party that holds a key and misuses it (stalled partial frames, forged
  control messages, a stranger reading ``/metrics``) against parties that sign with keys
  only they hold;
* `hostile_roles`: insider and outsider attacks on the elastic and federated roles, each
  against a small job of its own in the calling process.

Every attack is bounded (a count or a deadline) and stops by itself. Nothing here is imported
by the rest of Tandem.
"""
