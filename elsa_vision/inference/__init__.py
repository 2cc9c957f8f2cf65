"""Inference entry points (``python -m elsa_vision.inference.<task>``)."""
