"""The CUDA backend (backend.py): Triton kernels compiled ahead of time per GPU architecture."""
