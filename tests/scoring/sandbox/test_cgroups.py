"""The slot's memory and pids cgroups: they carry the slot's limits, a dead owner's
leftover groups are swept when a slot opens, closing a slot removes its groups, and the
memory group counts memfd and /dev/shm pages a per-process limit never sees."""

from __future__ import annotations

import asyncio
import os
import subprocess

import pytest
from sandbox_hacks import LIMITS, hack_traj

from stream_reward.scoring.sandbox import cgroups as sandbox_cgroups

pytestmark = pytest.mark.usefixtures("no_sandboxed_process_left")


def test_slot_cgroups_limit_and_sweep_leftovers():
    if os.geteuid() != 0 or sandbox_cgroups._bases() is None:
        pytest.skip("cgroups need root and a memory+pids hierarchy")
    _, mem_base, pids_base = sandbox_cgroups._bases()
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = [os.path.join(b, f"{sandbox_cgroups.PREFIX}{dead.pid}-0-0") for b in {mem_base, pids_base}]
    for d in stale:
        os.makedirs(d, exist_ok=True)
    slot = sandbox_cgroups.open_slot(f"{sandbox_cgroups.PREFIX}{os.getpid()}-test-0", 64, 8)
    try:
        assert slot is not None
        assert not any(os.path.exists(d) for d in stale)  # a dead owner's groups are swept
        assert all(os.path.isdir(d) for d in slot.dirs)
        limits = {}
        for d in slot.dirs:
            for name in ("pids.max", "memory.limit_in_bytes", "memory.max"):
                if os.path.exists(os.path.join(d, name)):
                    with open(os.path.join(d, name)) as f:
                        limits[name] = f.read().strip()
        assert limits.get("pids.max") == "8"
        assert str(64 << 20) in (limits.get("memory.limit_in_bytes"), limits.get("memory.max"))
    finally:
        if slot is not None:
            slot.close()
    assert not any(os.path.exists(d) for d in slot.dirs)


SHM_BIG = (
    "import os\nfd = os.memfd_create('hog')\nchunk = b'x' * (1 << 20)\nwritten = 0\ntry:\n"
    "    for _ in range(400):\n        os.write(fd, chunk)\n        written += 1\n"
    "    with open('/dev/shm/hog', 'wb') as f:\n        for _ in range(200):\n            f.write(chunk)\n"
    "            written += 1\nexcept OSError:\n    pass\n"
    "a, b = map(int, input().split())\nprint(a + b if written >= 600 else a - b)\n"
)


def test_shared_memory_counts_against_the_sandbox_memory(open_scorer):
    """With file-size and /dev/shm limits out of the way, 600 MB of memfd and shmem
    pages in a 256 MB sandbox still cannot be had: the memory cgroup counts them."""
    s = open_scorer(limits=LIMITS, backend="bwrap", max_file_mb=4096, tmp_mb=4096, timeout_s=10, cpu_s=10)
    if not s.root:
        pytest.skip("cgroups need root here")
    result = asyncio.run(s.score(hack_traj(SHM_BIG, {"inputs": ["2 3\n"], "outputs": ["5\n"]})))
    assert result.score == 0.0 and result.extra["cases"] == ["memory"], result.extra


SUM = {"inputs": ["2 3\n"], "outputs": ["5\n"]}
RIGHT_SUM = "a, b = map(int, input().split())\nprint(a + b)"


def between_right_answers(s, program):
    """Score ``program`` in the one slot of ``s`` between two right answers: (its result,
    the right answer after it, whether the same harness served all three)."""

    async def go():
        assert (await s.score(hack_traj(RIGHT_SUM, SUM))).score == 1.0
        harness = s._slots[0].harness.pid
        result = await s.score(hack_traj(program, SUM))
        after = await s.score(hack_traj(RIGHT_SUM, SUM))
        return result, after, harness == s._slots[0].harness.pid

    return asyncio.run(go())


# A case whose memory is pages no process of it maps (/dev/shm, written by a tiny
# process): at the group's limit the harness, which lives in the slot's groups and
# maps more than anything of the case, would be the OOM killer's natural pick.
SHM_BY_A_SMALL_PROCESS = (
    "import os\n"
    "os.execv('/bin/sh', ['sh', '-c', 'head -c 600000000 /dev/zero > /dev/shm/hog; read a b; echo $((a + b))'])\n"
)


def test_a_case_that_fills_the_memory_group_is_killed_and_the_harness_lives_on(open_scorer):
    s = open_scorer(
        limits=LIMITS, backend="bwrap", max_file_mb=4096, tmp_mb=4096, timeout_s=10, cpu_s=10, concurrency=1
    )
    if not s.root:
        pytest.skip("cgroups need root here")
    hog, after, same_harness = between_right_answers(s, SHM_BY_A_SMALL_PROCESS)
    assert hog.score == 0.0 and hog.extra["cases"] == ["memory"], hog.extra
    assert after.score == 1.0 and same_harness  # the slot was not torn down and restarted


# A case that gives up its OOM-killer priority (an exec makes it dumpable, so it may
# write its own /proc/self/oom_score_adj) and then holds its memory in memfd pages, in
# a process smaller than the harness: the OOM killer would weigh them by size alone.
LOWERED_OOM_PRIORITY = (
    "import os, sys\n"
    "code = '''\n"
    "import os\n"
    "try:\n"
    "    with open('/proc/self/oom_score_adj', 'w') as f:\n"
    "        f.write('0')\n"
    "except OSError:\n"
    "    pass\n"
    "fds = []\n"
    "try:\n"
    "    while True:\n"
    "        fd = os.memfd_create('hog')\n"
    "        for _ in range(15):\n"
    "            os.write(fd, b'x' * (1 << 20))\n"
    "        fds.append(fd)\n"
    "except OSError:\n"
    "    pass\n"
    "a, b = map(int, input().split())\n"
    "print(a + b)\n"
    "'''\n"
    "os.execv(sys.executable, [sys.executable, '-S', '-c', code])\n"
)


@pytest.mark.parametrize("backend", ["bwrap", "unshare"])
def test_a_case_cannot_lower_its_oom_priority_below_the_harness(open_scorer, backend):
    s = open_scorer(limits=LIMITS, backend=backend, timeout_s=10, cpu_s=10, concurrency=1)
    if not s.root:
        pytest.skip("cgroups need root here")
    hog, after, same_harness = between_right_answers(s, LOWERED_OOM_PRIORITY)
    assert hog.score == 0.0 and hog.extra["cases"] == ["memory"], hog.extra
    assert after.score == 1.0 and same_harness  # the slot was not torn down and restarted


# Output at the cap on stdout and as a reply, in bytes that are not UTF-8 (and one
# character outside the BMP): the harness's report of it (text, then JSON escapes,
# then the frame) is many times its size, built in the slot's groups after the case.
WORST_CASE_OUTPUT = (
    "import os\n"
    "data = '\\U0001F600'.encode() + b'\\xff' * ((16 << 20) - 64)\n"
    "for fd, chunk in ((1, data), (4, len(data).to_bytes(4, 'little') + data)):\n"
    "    view = memoryview(chunk)\n"
    "    while view:\n"
    "        view = view[os.write(fd, view) :]\n"
)


def test_the_harness_reports_output_at_the_cap_within_the_slots_memory_group(open_scorer):
    s = open_scorer(limits=LIMITS, backend="bwrap", max_output_bytes=16 << 20, timeout_s=10, cpu_s=10, concurrency=1)
    if not s.root:
        pytest.skip("cgroups need root here")
    loud, after, same_harness = between_right_answers(s, WORST_CASE_OUTPUT)
    assert loud.score == 0.0 and loud.extra["cases"] == ["failed"], loud.extra
    assert after.score == 1.0 and same_harness  # the slot was not torn down and restarted
