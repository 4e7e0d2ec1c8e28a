"""The scheduler service: HTTP API, scheduling loop, node-agent hub, embedded mode."""
