import os

# One thread per rank and per test process: the machine has 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
