"""``python -m tandem``: the same as the ``tandem`` command."""

import sys

from tandem.parties.cli import entry

sys.exit(entry())
