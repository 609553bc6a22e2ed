"""Settings for the whole suite's own process, made before any test module imports grpc."""

from __future__ import annotations

import os

# Tests fork this process (pexpect's pty spawn of `stageserve up`) after gRPC channels have run here.
# Where gRPC's fork handlers run, they restart its poller in the child, which finds its epoll
# descriptor closed before exec and crashes the child (grpc/grpc#43055: seen twice as
# test_up_ctrl_c's launcher ending before "ready" with "Epoll1Poller encountered epoll_wait error:
# Bad file descriptor"). Nothing here forks to use gRPC in the child.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
