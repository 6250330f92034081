"""Device memory statistics in rows and pprof memory profiles."""
import gzip

import jax.numpy as jnp
import pytest

from jaxtrain.observe import MemoryProfile, MemoryReport, device_memory_stats


class _Device:
    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_stats_take_the_largest_over_devices_and_skip_silent_backends():
    devices = [_Device({"bytes_in_use": 10, "peak_bytes_in_use": 30, "bytes_limit": 100}),
               _Device({"bytes_in_use": 20, "peak_bytes_in_use": 25, "bytes_limit": 100}),
               _Device(None)]
    assert device_memory_stats(devices) == {"mem_bytes_in_use": 20, "mem_peak_bytes_in_use": 30,
                                            "mem_bytes_limit": 100}
    assert device_memory_stats([_Device(None)]) == {}
    assert isinstance(device_memory_stats(), dict)  # the CPU backend reports nothing


def test_rocm_mem_info_steps(cfg):
    devices = [_Device({"bytes_in_use": 2 ** 30})]
    report = MemoryReport.from_config(cfg())
    report.devices = devices
    assert [s for s in range(1, 6) if report.fields(s)] == [1, 2]
    report = MemoryReport.from_config(cfg("use_rocm_mem_info_iters=[3]"))
    report.devices = devices
    assert [s for s in range(1, 6) if report.fields(s)] == [3]
    report = MemoryReport.from_config(cfg("use_rocm_mem_info=true"))
    report.devices = devices
    assert [s for s in range(1, 6) if report.fields(s)] == [1, 2, 3, 4, 5]
    assert report.fields(1) == {"mem_bytes_in_use": 2 ** 30}


def _is_pprof(path):
    data = path.read_bytes()
    return data[:2] == b"\x1f\x8b" and len(gzip.decompress(data)) > 0


def test_memory_profile_after_the_first_step(cfg, tmp_path):
    off = MemoryProfile.from_config(cfg(), tmp_path)
    off.step_end(1)
    assert off.path is None and not list(tmp_path.iterdir())
    profile = MemoryProfile.from_config(cfg("record_memory_history=true"), tmp_path)
    keep = jnp.ones((256, 256))
    profile.step_end(1)
    path = tmp_path / "snapshot.pickle"
    assert profile.path == path and _is_pprof(path)
    path.unlink()
    profile.step_end(2)
    assert not path.exists()  # once per run
    other = MemoryProfile.from_config(cfg("record_memory_history=true",
                                          f"memory_snapshot_path={tmp_path / 'm' / 'mem.prof'}"),
                                      tmp_path, process_index=2)
    assert other.path == tmp_path / "m" / "mem.prof.2"
    del keep


@pytest.mark.parametrize("message, written", [
    ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB", True),
    ("INVALID_ARGUMENT: shapes do not match", False)])
def test_memory_profile_on_out_of_memory(cfg, tmp_path, message, written):
    profile = MemoryProfile.from_config(cfg("record_memory_history=true",
                                            "memory_snapshot_path=oom.prof"), tmp_path)
    assert profile.on_error(RuntimeError(message)) is written
    assert (tmp_path / "oom.prof").exists() is written
