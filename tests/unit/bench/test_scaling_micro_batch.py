from vigil_bench.scaling import gpu_micro_batch

GIB = 2**30


def test_the_micro_batch_grows_with_the_gpus_memory():
    assert gpu_micro_batch(16 * GIB, 1024) == 8
    assert gpu_micro_batch(80 * GIB, 1024) == 32
    assert gpu_micro_batch(141 * GIB, 1024) == 32
    assert gpu_micro_batch(1024 * GIB, 1024) == 64  # at most 64


def test_a_flag_overrides_it(monkeypatch):
    monkeypatch.setenv("VIGIL_BENCH_SCALING_MICRO_BATCH", "12")
    assert gpu_micro_batch(80 * GIB, 1024) == 12
