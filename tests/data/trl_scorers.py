"""compute_score functions the TRL reward-function tests load by path (python:FILE:FN)."""


def echo(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """The ground truth as a number, plus the ``bonus`` column when the dataset has one;
    raises on the ground truth "boom" (a scorer fault: the sample fails, not 0)."""
    if ground_truth == "boom":
        raise RuntimeError("the scorer broke on this sample")
    bonus = float((extra_info or {}).get("bonus", 0.0))
    return float(ground_truth) + bonus


def length(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """The response's length in characters: what text reached the scorer."""
    return float(len(solution_str))


def length_plus(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """The response's length plus the ground truth as a number; raises on "boom"."""
    if ground_truth == "boom":
        raise RuntimeError("the scorer broke on this sample")
    return float(len(solution_str)) + float(ground_truth)
