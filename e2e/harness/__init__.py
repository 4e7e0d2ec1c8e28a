"""Harness for the end-to-end tests: a real Kubernetes control plane on 127.0.0.1."""
