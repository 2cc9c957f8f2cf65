"""Datasets, data modules and dataset metadata."""
