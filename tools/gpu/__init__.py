"""The pieces of ``tools/gpu_check.py``: plan, models, roofline, greedy, throughput, isolation, report."""
