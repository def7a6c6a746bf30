"""``python -m slipstream.server serve ...``: the same as the ``slipstream`` command."""
import sys

from slipstream.server.cli import main

sys.exit(main())
