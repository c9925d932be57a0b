from vigil_worker.refusals import RefusalReports, TokenBucket


def test_the_bucket_lets_a_burst_through_then_the_rate() -> None:
    bucket = TokenBucket(rate=10.0, burst=5, at=0.0)
    assert [bucket.take(0.0) for _ in range(6)] == [True] * 5 + [False]
    assert bucket.take(0.1) and not bucket.take(0.1)  # one token in a tenth of a second
    assert sum(bucket.take(10.0) for _ in range(100)) == 5  # never more than the burst saved up


def test_refusals_are_reported_once_per_job_and_field_per_period_with_the_count() -> None:
    reports = RefusalReports(every_s=30.0)
    assert reports.due("j", "rate", now=0.0) == 1
    assert [reports.due("j", "rate", now=t) for t in (1.0, 2.0, 29.0)] == [0, 0, 0]
    assert reports.due("j", "culprits", now=3.0) == 1  # another field: its own
    assert reports.due("k", "rate", now=3.0) == 1  # another job: its own
    assert reports.due("j", "rate", now=31.0) == 4  # the three held back, and this one
    reports.forget("j")
    assert reports.due("j", "rate", now=32.0) == 1
