import sys

from ..offline.run_report import main

sys.exit(main())
