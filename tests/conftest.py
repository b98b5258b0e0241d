"""Every test process keeps to one CPU thread: ``make test`` runs one pytest process per core (pytest-xdist), and
two processes each taking every core run several times slower than one. Set before torch is imported."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
