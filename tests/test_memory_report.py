"""`peak_rss_bytes`: the process's own peak, which a large temporary raises and freeing it
does not lower. Measured in a fresh interpreter: a test worker's peak is whatever its
earlier tests reached."""

import subprocess
import sys

CHILD = """
import numpy as np
from tandem.parties.memory import peak_rss_bytes
before = peak_rss_bytes()
block = np.ones(256 * 2**20 // 8)  # 256 MiB, every page touched
during = peak_rss_bytes()
del block
after = peak_rss_bytes()
print(before, during, after)
"""


def test_peak_rss_follows_this_process():
    out = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, check=True, timeout=120
    )
    before, during, after = map(int, out.stdout.split())
    assert during - before >= 200 * 2**20
    assert after >= during - 4 * 2**20  # the kernel's RSS counters are batched per CPU
