#!/usr/bin/env bash
# Download the few wheels torchspeed needs beyond a machine's own PyTorch stack into .whl/ (ignored by git),
# for an offline machine: the lent GPU machine (Python 3.12) or a cluster node. `make gpu-wheels`; then
# carry .whl/ there and run `make gpu-check PYTHON=python3`. Pass other Python versions as arguments
# (default: 3.12 and this machine's own, so the check can be rehearsed here). About 1.6 MB a version.
set -euo pipefail
cd "$(dirname "$0")/.."
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(3.12 "$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')")
# the versions this repository is tested with (constraints.txt)
pins=$(grep -iE '^(lmdb|simplejpeg|torch-pruning|turbojpeg)==' constraints.txt)
mkdir -p .whl
for v in $(printf '%s\n' "${versions[@]}" | sort -u); do
    python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
        --python-version "$v" --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl $pins
done
ls -1 .whl
