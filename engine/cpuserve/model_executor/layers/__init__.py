"""Model building blocks: plain Python objects over native kernels, sharded for tensor parallelism."""
