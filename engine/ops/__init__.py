"""The GPU kernels (Triton) that attention and the models call, with their launch helpers."""
