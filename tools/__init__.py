"""Developer tools that are not shipped: ``python -m tools.mutants`` (``make mutants``)."""
