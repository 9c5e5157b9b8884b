"""What a party's shared tensors reveal, and the defenses that bound it.

Split learning must send activations (feature owners) and cut gradients (the label owner); both
can reveal what the sender protects. This package holds the leakage audit each party runs on its
own data, the defenses configured under ``[privacy]``, and the secure sum of the followers' cuts.
"""
