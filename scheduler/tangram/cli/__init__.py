"""The ``tangram`` command line."""
