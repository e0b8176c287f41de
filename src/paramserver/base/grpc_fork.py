"""gRPC's fork handlers, turned off before grpc loads (paramserver/__init__.py imports this first).

With gRPC's fork handlers on (grpcio's default), every fork() of a worker -- a torch DataLoader
starting its worker processes, each epoch -- restarts gRPC's threads inside the child, on state
copied from the parent's threads that were busy in gRPC (heartbeats, channels, the coordinator's
server): the child segfaults or hangs. Off, a forked child leaves gRPC alone (it never calls it).
gRPC reads the variable when it is loaded; a value the user set wins. Children of
`paramserver run` inherit it. See docs/configuration.md.
"""

from __future__ import annotations

import os
import sys

GRPC_FORK_SUPPORT_ENV = "GRPC_ENABLE_FORK_SUPPORT"
# grpc was loaded before paramserver with the variable unset: its fork handlers stay on in this process
grpc_fork_handlers_on = "grpc" in sys.modules and not os.environ.get(GRPC_FORK_SUPPORT_ENV)
if not os.environ.get(GRPC_FORK_SUPPORT_ENV):
    os.environ[GRPC_FORK_SUPPORT_ENV] = "0"
