import sys

from paramserver.launch.cli import main

sys.exit(main())
