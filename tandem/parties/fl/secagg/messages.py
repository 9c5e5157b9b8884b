"""Wire format of secure aggregation: one channel each way between the server and a client.

Channel ``fl/secagg``; every message has ``meta.kind`` and ``meta.round``:

client -> server
  ``advertise``: ``c_pk``, ``s_pk`` (hex X25519 public keys), ``key_id``, ``sig`` (Ed25519
  over `crypto.advert_bytes`, empty without per-party keys);
  ``shares``: ``to`` (names: the other holders of its shares), ``b_hash`` (hex); arrays:
  sealed shares, one row per name of ``to`` (uint8 ``(m, SEALED)``), and commitments, one
  ``(2, 32)`` pair per holder (`graph.Graph.holders`; uint8 ``(h, 2, 32)``: the b-share's,
  then the s-share's);
  ``masked``: arrays: the masked payload (uint32, the uplink's payload shape);
  ``unmask``: ``b_of``, ``s_of`` (names); arrays: the shares held of each (uint8 rows).
server -> client
  ``keys``: ``t`` (shares that rebuild a secret), ``k`` (the sharing graph's degree,
  ``len(names) - 1`` for the complete graph) and, per client of the round in name order,
  ``names``, ``c_pk``, ``s_pk``, ``key_id``, ``sig``;
  ``shares``: ``from`` (names); arrays: the sealed rows those clients made for this one;
  ``survivors``: ``names``: the clients whose masked input is in the sum;
  ``abort``: the round's secure sum was abandoned (too few clients left, or a cheat found).
"""

from __future__ import annotations

from .shamir import share_size

SECAGG = "fl/secagg"
SECRET = 32  # bytes of a self-mask seed and of an X25519 private key
SHARE = share_size(SECRET)  # bytes of one share of either secret
SEALED = 12 + 2 * SHARE + 16  # nonce + (b-share, s-share) + tag
