"""Shared test configuration.

JAX runs on the CPU in tests; the suite must pass on a 2-core machine without an accelerator.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
