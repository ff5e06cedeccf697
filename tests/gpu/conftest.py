"""tests/gpu runs on real CUDA devices only (tests/gpu/gpu_env.py says why it skips elsewhere)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
