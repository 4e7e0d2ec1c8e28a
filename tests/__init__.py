"""The test suite (``make test``); shared skip reasons live here."""

import sys

# The reason PyTorch's tests skip with the default extras. The root conftest lets exactly
# this skip through under CI, where `make test-gpu` runs these tests with the gpu extra.
GPU_EXTRA = "needs PyTorch (the gpu extra): `make test-gpu` installs it and runs these tests"

# `tangram` as a subprocess, through the console script's own function: a lent GPU machine
# runs the tests from the source tree, where no console script is installed.
TANGRAM_CLI = [sys.executable, "-m", "tangram.cli.main"]
