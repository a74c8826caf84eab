"""graphpar.backends.cuda: the CUDA backend.

- ``paged_attention.cu`` holds the paged-attention kernels and ``paged_attention.py`` launches
  them through CuPy, which is imported only when a kernel first runs;
- ``codegen`` writes the CUDA C of a listing's generated kernels (`lower-cuda`'s listings,
  ``graphpar.ir.cuda_listing``);
- ``cpu_executor`` runs a listing call for call on the CPU, ``gpu_executor`` on a GPU with
  CuPy (cuBLAS, NCCL, NVRTC). See docs/cuda-backend.md.
"""
