"""``python -m slipstream.operator …`` is ``slipstream operator …``."""
import sys

from slipstream.operator.cli import main

sys.exit(main())
