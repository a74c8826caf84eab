"""graphpar.backends.cuda: the CUDA backend.

``paged_attention.cu`` holds the paged-attention kernels and ``paged_attention.py`` launches
them through CuPy, which is imported only when a kernel first runs.
"""
