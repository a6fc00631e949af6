"""`python -m tests.runtime.unchecked_http_port_launch`: the launcher without its early HTTP port check.

So that a port taken after the check (or one the check missed) reaches the
HTTP server itself, which must then fail the launch: the launcher waits for
its own server to say it listens, not for anything at all to accept
connections on the port. Everything else is the real launcher.
"""

from __future__ import annotations

import sys

from asyncpp import launch

if __name__ == "__main__":
    launch.check_http_port = lambda config: None
    sys.exit(launch.main())
