"""The loopback cluster behind ``make cluster`` and ``make cluster-verify``."""
