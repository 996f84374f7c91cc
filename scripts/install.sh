#!/usr/bin/env bash
# Install ditorch (editable) with its dependencies, never replacing the torch already installed.
# Where no torch is importable, install the pinned CPU build: an unpinned `torch` would make pip
# download gigabytes of CUDA packages. Usage: scripts/install.sh [extra]   (extra: test, npu, ...;
# default: conformance)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_PIN=${DITORCH_TORCH_PIN:-torch==2.13.0}

if version=$("$PYTHON" -c "import torch; print(torch.__version__)" 2>/dev/null); then
  echo "ditorch install: keeping the installed torch $version"
else
  echo "ditorch install: no torch importable, installing $TORCH_PIN"
  read -r -a pin_args <<<"$TORCH_PIN"  # a pin may carry pip options: "torch==2.13.0 --index-url URL"
  "$PYTHON" -m pip install -q "${pin_args[@]}"
  version=$("$PYTHON" -c "import torch; print(torch.__version__)")
fi

# The constraint holds torch at the installed version while pip resolves everything else.
constraint=$(mktemp)
trap 'rm -f "$constraint"' EXIT
echo "torch==$version" >"$constraint"
# The default brings the conformance extra (expecttest, one small package): `make demo` then runs
# `python -m op_tools.conformance` as the README writes it.
target=".[conformance]"
[ $# -gt 0 ] && target=".[$1]"
"$PYTHON" -m pip install -q --disable-pip-version-check -c "$constraint" -e "$target"
