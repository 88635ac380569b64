"""``python -m headprobe``: the same as the ``headprobe`` command."""

import sys

from headprobe.cli import main

sys.exit(main())
