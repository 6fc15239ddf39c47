"""Execution: the model runner (inputs, sampling, CUDA graphs) and the rank processes of tensor parallelism."""
