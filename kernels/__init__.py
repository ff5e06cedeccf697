"""CUDA C sources of the ddlkernels GPU kernels (installed as ``ddlkernels.kernels``)."""
