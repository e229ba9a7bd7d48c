"""`bench faults` at a tiny size: it must run, kill, and find nothing lost or doubled."""

import json

from stream_reward.bench import faults


def test_faults_bench_tiny(capsys):
    code = faults.main(
        ["--n", "400", "--workers", "2", "--kills", "2", "--kill-every-s", "0.1", "--reclaim-idle-ms", "300", "--json"]
    )
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    assert report["n"] == 400 and report["kills"] == 2
    assert report["lost"] == 0 and report["duplicates"] == 0 and report["wrong_scores"] == 0
    assert report["scored"] == 400
