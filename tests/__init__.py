"""The test suite (``make test``); shared skip reasons live here."""

# The reason PyTorch's tests skip with the default extras. The root conftest lets exactly
# this skip through under CI, where `make test-gpu` runs these tests with the gpu extra.
GPU_EXTRA = "needs PyTorch (the gpu extra): `make test-gpu` installs it and runs these tests"
