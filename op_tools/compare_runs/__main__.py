import sys

from ..offline.compare_runs import main

sys.exit(main())
