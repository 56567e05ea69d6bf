"""``rlt-hal bench kv-sharing`` on the tiny preset: both modes' capacity at one pool, measured
around the accounting's prediction, with well-formed JSON. (Figures: docs/benchmarks.md.)"""

from __future__ import annotations

from tests.test_bench import _bench


def test_bench_kv_sharing_measures_capacity_throughput_and_tpot(tmp_path):
    # bs 16: full KV needs ceil(79 / 16) = 5 blocks a request; shared 1 + 4 generated blocks
    # (1 pool block), 2: a pool of 20 blocks (20 x 16 x 2048 bytes) serves 4 and 10.
    report, table = _bench(
        tmp_path,
        "kv-sharing --preset tiny --input-len 16 --output-len 64 --block-size 16 "
        f"--kv-cache-memory {20 * 16 * 2048} --runs 1",
    )
    none, last = report["modes"]["none"], report["modes"]["last"]
    assert (none["capacity"], last["capacity"]) == (4, 10)
    for mode in (none, last):
        assert mode["at_capacity"]["served_together_without_preemption"]
        assert not mode["one_more"]["served_together_without_preemption"]
        assert mode["c1_tpot_s"] > 0 and mode["same_load"]["requests"] == 10
    assert last["same_load"]["preemptions"] == 0 < none["same_load"]["preemptions"]
    assert report["capacity_ratio"] == 2.5
    assert "| last | 10 |" in table and "| none | 4 |" in table
