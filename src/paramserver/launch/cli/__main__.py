"""`python -m paramserver.launch.cli`: the `paramserver` command."""

import sys

from paramserver.launch.cli.entry import main

sys.exit(main())
