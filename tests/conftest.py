"""Session-wide settings: one intra-op thread for torch here and in every process a test spawns.

Tiny models gain nothing from several threads, and on a 2-core machine the threads of concurrent
processes (distributed ranks, DeepSpeed workers, pytest itself) contend and slow every test.
"""

import os

import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
torch.set_num_threads(1)
