import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Test shapes are tiny and gain nothing from intra-op threads, and on a busy 2-core machine an OpenMP barrier
    waiting for a descheduled thread costs a scheduler slice per op (a tiny forward went from 10 ms to 5 s)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
