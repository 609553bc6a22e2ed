"""cpu_budget: the CPUs a device may use (affinity, cgroup v1/v2 quota) and its default threads."""

from pathlib import Path

import pytest

from stageserve.device.kernels.cpu_budget import cgroup_cpu_quota, default_compute_threads, usable_cpus


def test_cgroup_v2_quota(tmp_path: Path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_quota(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(tmp_path) is None


def test_cgroup_v1_quota(tmp_path: Path):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    assert cgroup_cpu_quota(tmp_path) == 3.0
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_quota(tmp_path) is None


def test_usable_cpus_is_the_affinity_capped_by_the_quota(tmp_path: Path):
    import os

    affinity = len(os.sched_getaffinity(0))
    assert usable_cpus(tmp_path) == affinity  # no cgroup files: no quota
    (tmp_path / "cpu.max").write_text("50000 100000\n")
    assert usable_cpus(tmp_path) == min(affinity, 0.5)


@pytest.mark.parametrize("cpus, threads", [(0.5, 1), (1, 1), (1.5, 1), (2, 2), (4, 4), (8, 8), (2.7, 2), (2.8, 3)])
def test_default_compute_threads(cpus, threads):
    assert default_compute_threads(cpus) == threads
