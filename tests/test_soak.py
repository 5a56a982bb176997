"""Two minutes of the soak (`torchllama bench soak`, Locust, 16 users): nothing fails, no
stream is lost, the server's memory stays flat after the warm-up, and the sampled
temperature-0 answers equal the same requests sent alone (the batch-invariance oracle).
The 20-minute run is `make soak`; its figures are in benchmarks/results/."""

from __future__ import annotations

import importlib.util

import pytest

# (never imported here: Locust monkey-patches the process with gevent; the soak runs it in
# its own process)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("locust") is None,
                                reason="needs locust (the soak extra)")


@pytest.mark.slow
def test_two_minutes_of_mixed_load_lose_nothing():
    from torchllama.bench.soak import run_soak

    lines: list[str] = []
    result = run_soak(None, minutes=2, users=16, warmup=45, sample=20, print_fn=lines.append)
    report = "\n".join(lines)
    assert result.requests > 100, report
    assert result.failures == 0 and result.server_errors == 0 and result.lost_streams == 0, \
        report
    assert result.rss_flat, report
    assert result.sampled >= 10 and result.equal == result.sampled, report
