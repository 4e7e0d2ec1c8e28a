"""The per-node agent of ARL-Tangram: inventory, environments, allocate-on-execution."""
