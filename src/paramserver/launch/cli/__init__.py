"""The `paramserver` command: run, node, k8s, status, health, shutdown, checkpoint, certs, demo. See docs/cli.md.

- parser.py: each command's own flags; option_flags.py: the flags that set options, built from the
  `Options` fields (base/options/options.py), and which commands take them;
- commands.py: what each command does; entry.py: `main`, the console entry point;
- docs.py: docs/cli.md's option tables, generated from the same fields.
"""

from paramserver.launch.cli.entry import main
from paramserver.launch.cli.option_flags import given_options
from paramserver.launch.cli.parser import build_parser, command_parsers, parse_args

__all__ = ["build_parser", "command_parsers", "given_options", "main", "parse_args"]
