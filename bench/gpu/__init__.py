"""The pieces of ``bench/gpu_check.py``: plan, models, roofline, greedy, throughput, isolation, report."""
