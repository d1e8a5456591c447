"""Fixtures of the verify suite (see ``tests/verify``)."""

from tests.verify.fixtures import medium, medium_dir, record, tiny, tiny_dir

__all__ = ["medium", "medium_dir", "record", "tiny", "tiny_dir"]
