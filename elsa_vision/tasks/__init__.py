"""Tasks: training modules and evaluation pipelines."""
