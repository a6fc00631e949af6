"""`LatestPerKey`: one sample per key (the largest), counted once, oldest keys dropped past the bound."""

from asyncpp.samples import LatestPerKey


def test_one_sample_per_key_the_largest():
    samples = LatestPerKey(max_samples=3)
    assert samples.summary("x") == {"x_mean": None, "x_p50": None, "x_p99": None}
    samples.put("a", 1.0)
    samples.put("a", 3.0)  # a later stage of the same request
    samples.put("a", 2.0)  # an earlier one reported late: the largest stays
    assert samples.count == 1 and samples.summary("x") == {"x_mean": 3.0, "x_p50": 3.0, "x_p99": 3.0}
    samples.put("b", 5.0)
    assert samples.count == 2 and samples.summary("x")["x_mean"] == 4.0
    for key in "cd":
        samples.put(key, 10.0)
    assert samples.count == 4
    assert samples.summary("x") == {"x_mean": 25.0 / 3, "x_p50": 10.0, "x_p99": 10.0}  # "a" dropped
    samples.put("b", 1.0)  # still kept: unchanged, and not counted again
    assert samples.count == 4 and samples.summary("x")["x_mean"] == 25.0 / 3
