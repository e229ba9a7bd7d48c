"""Scorers the gateway's tests run in real workers (loaded by file path)."""


def echo(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """Exact match, and what reached the scorer as extra info; raises on the response
    'raise' (a verifier that is down: the sample fails, it is not a wrong answer)."""
    if solution_str == "raise":
        raise ConnectionError("the verifier is down")
    extra_info = extra_info or {}
    if solution_str.startswith("key-"):  # a key that came from the data: one per sample
        return {"score": 0.0, solution_str: 1.0}
    if solution_str == "nan-extra":  # a scored sample whose extra info JSON cannot hold
        return {"score": 1.0, "ratio": float("nan"), "spread": [1.0, float("inf")]}
    return {
        "score": float(solution_str.strip() == str(ground_truth).strip()),
        "source": data_source,
        "tag": extra_info.get("tag"),
        "meta_k": (extra_info.get("metadata") or {}).get("k"),
        "len": len(solution_str),
    }
