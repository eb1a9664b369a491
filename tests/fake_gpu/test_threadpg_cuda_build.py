"""The threaded process group's tests (tests/unit/test_threadpg.py, on CPU tensors) under this
venv's torch: a CUDA build of another version (2.14.1), as a one-GPU machine's is. c10d
changes between versions (2.14's batch_isend_irecv asks every group's device backend whether
it coalesces, which 2.13 asked of plain process groups only); the threads launcher must work
on both. Fake tensors are no use here: a collective moves one rank's tensors into another's,
and torch's fake-tensor modes are per thread and cannot mix."""

from test_threadpg import *  # noqa: F403 - the same tests, collected here again
