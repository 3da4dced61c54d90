"""``python -m oomless ...`` is the ``oomless`` command."""

import sys

from oomless.cli.main import main

sys.exit(main())
