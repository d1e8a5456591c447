"""kvfence benchmarks: one module per suite, run together by `python -m bench.run_all`."""
