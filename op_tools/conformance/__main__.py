"""``python -m op_tools.conformance``: see ``op_tools.offline.conformance.cli``."""

import sys

from ..offline.conformance.cli import main

if __name__ == "__main__":
    sys.exit(main())
