"""bench/prompt_pass.py on small odd shapes: it checks the one-pass output against the flash
kernel's before timing, reports every way it times, and refuses heads that do not group (nothing
here checks a time)."""

import pytest


@pytest.fixture(scope="module")
def bench(bench_script):
    return bench_script("prompt_pass")


def test_measure_times_every_way(bench):
    times = bench.measure(batch=2, heads=6, kv_heads=2, head_dim=32, context=37, repeat=2, seed=5)
    assert set(times) == {"flash", "flash + significance", "one pass", "one pass + significance"}
    assert all(t > 0 for t in times.values())


def test_cli_prints_one_row_per_context(bench, capsys):
    bench.main(["--context", "19", "40", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--repeat", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "x |" in line]
    assert [r.split("|")[1].strip() for r in rows] == ["19", "40"]
    with pytest.raises(SystemExit):
        bench.main(["--heads", "5", "--kv-heads", "2"])
