"""The parts of benchmarks/gpu_check.py, one module per log file."""
