"""mpext against native PyTorch, measured in the same run: ``python -m benchmarks.run_all`` (what
``make bench`` runs) or one module (``python -m benchmarks.bench_adam``); benchmarks/README.md."""
