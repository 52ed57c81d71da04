"""tawpipe: topology-aware weight pipeline parallelism for PyTorch."""
