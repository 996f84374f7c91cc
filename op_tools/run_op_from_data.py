"""``python op_tools/run_op_from_data.py DIR [options]`` (the original's path), ``python -m op_tools.run_op_from_data``.

The code and its options are in ``op_tools/offline/run_op_from_data.py``.
"""

import os
import sys

if __package__ in (None, ""):  # run as a file: import the package, not the modules beside this file
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    sys.path.insert(0, os.path.dirname(_here))

from op_tools.offline.run_op_from_data import main  # noqa: E402

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
