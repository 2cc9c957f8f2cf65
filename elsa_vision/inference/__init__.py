"""Inference entry points (run as ``python -m elsa_vision.inference.<name>``)."""
