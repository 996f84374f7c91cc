"""The repository's root, which is not a package: the packages are its folders ``ditorch/`` and ``op_tools/``.

A clone of the repository named ``ditorch``, in the folder a script runs from, is what ``import ditorch`` finds
first. Without this file Python would import it as an empty namespace package: no banner, nothing patched, and
"Torch not compiled with CUDA enabled" far from the cause. Imported under that name, this file hands the import
over to the ditorch package found further along the import path (an install, ``pip install -e`` of this very
clone included), and fails at once, saying what to do, where there is none. Under any other name (pytest imports
it under the clone folder's name) it does nothing.
"""

import importlib.machinery
import importlib.util
import os
import sys

if __name__ == "ditorch":
    _CLONE = os.path.dirname(os.path.abspath(__file__))


    def _package_spec():
        """The spec of the ditorch package that the import path holds past the folder this clone lies in."""
        beside = os.path.realpath(os.path.dirname(_CLONE))
        path = [entry for entry in sys.path if os.path.realpath(entry or os.curdir) != beside]
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            if find_spec is None:
                continue
            # PathFinder searches the import path less that folder; an editable install's finder needs none
            spec = find_spec("ditorch", path if finder is importlib.machinery.PathFinder else None)
            if (spec is not None and spec.origin is not None and spec.loader is not None
                    and os.path.realpath(spec.origin) != os.path.realpath(__file__)):
                return spec
        return None


    _spec = _package_spec()
    if _spec is None:
        raise ImportError(
            f"import ditorch found {_CLONE}, a clone of the ditorch repository, not the ditorch package (its "
            f"ditorch/ folder), and no ditorch is installed: install it with `pip install -e {_CLONE}`, or run "
            "your script from a folder that does not hold the clone.", name="ditorch", path=__file__)
    _package = importlib.util.module_from_spec(_spec)
    sys.modules["ditorch"] = _package  # the import returns what sys.modules holds once this file has run
    _spec.loader.exec_module(_package)
