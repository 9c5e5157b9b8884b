"""`peak_rss_bytes`: the process's own peak, which a large temporary raises and freeing it
does not lower."""

import numpy as np

from tandem.parties.memory import peak_rss_bytes


def test_peak_rss_follows_this_process():
    before = peak_rss_bytes()
    block = np.ones(256 * 2**20 // 8)  # 256 MiB, every page touched
    during = peak_rss_bytes()
    del block
    after = peak_rss_bytes()
    assert during - before >= 200 * 2**20
    assert after >= during - 4 * 2**20  # the kernel's RSS counters are batched per CPU
