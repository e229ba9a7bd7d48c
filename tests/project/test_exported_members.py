"""The public API stays small and honest: every exported name exists and is documented."""

import importlib
import pkgutil

import stream_reward


def test_top_level_exports_are_few_and_real():
    assert len(stream_reward.__all__) <= 10
    for name in stream_reward.__all__:
        assert getattr(stream_reward, name).__doc__, name


def test_every_module_all_names_exist():
    for info in pkgutil.walk_packages(stream_reward.__path__, "stream_reward."):
        if info.name.endswith(("sandbox._harness", "procpool_child", "__main__")):
            continue  # run as programs, not imported for their names
        module = importlib.import_module(info.name)
        for name in getattr(module, "__all__", []):
            assert hasattr(module, name), f"{info.name}.__all__ names missing {name!r}"


def test_workers_start_without_torch():
    import subprocess
    import sys

    code = "import sys, stream_reward.worker.main, stream_reward.worker.consumer, stream_reward.scoring.registry; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"  # torch is imported only where tensors are built
