"""Device self-profiling: cgroup limits (v1 and v2 on fake trees), compute, link defaults."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch

from edge.errors import UserError
from edge.models.zoo import get_model
from edge.problem import DeviceSpec, parse_problem
from edge.profiling import device as profiler
from edge.profiling import matmul
from edge.profiling.device import (
    cgroup_limits,
    default_link,
    effective_cpu_count,
    parse_broker_url,
    profile_device,
    profile_unit_times,
    usable_memory_bytes,
)
from edge.profiling.matmul import measure_matmul_gflops

MiB = 1 << 20
V1_NO_LIMIT = "9223372036854771712"


def _write(base: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = base / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")


def _proc(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "proc-self-cgroup"
    path.write_text(text)
    return path


V1_PROC = "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n0::/\n"


def _v1_tree(root: Path, limit: int = 512 * MiB, usage: int = 300 * MiB) -> None:
    _write(
        root,
        {
            "memory/memory.limit_in_bytes": V1_NO_LIMIT,
            "memory/memory.usage_in_bytes": str(8000 * MiB),
            "memory/docker/memory.limit_in_bytes": V1_NO_LIMIT,
            "memory/docker/memory.usage_in_bytes": str(1000 * MiB),
            "memory/docker/abc/memory.limit_in_bytes": str(limit),
            "memory/docker/abc/memory.usage_in_bytes": str(usage),
            "memory/docker/abc/memory.stat": f"cache 1\ntotal_inactive_file {100 * MiB}\n",
            "cpu,cpuacct/cpu.cfs_quota_us": "-1",
            "cpu,cpuacct/cpu.cfs_period_us": "100000",
            "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "150000",
            "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000",
            "unified/cgroup.controllers": "",
        },
    )


def test_v1_limits_of_this_cgroup(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    _v1_tree(root)
    got = cgroup_limits(root, _proc(tmp_path, V1_PROC))
    assert got.memory_version == "v1"
    assert got.memory_limit_bytes == 512 * MiB
    # usage 300 MiB, of which 100 MiB is reclaimable page cache
    assert got.memory_headroom_bytes == (512 - 200) * MiB
    assert got.cpu_version == "v1"
    assert got.cpu_quota_cores == pytest.approx(1.5)


def test_v1_tighter_ancestor_wins(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    _v1_tree(root)
    _write(
        root,
        {
            "memory/docker/memory.limit_in_bytes": str(400 * MiB),
            "memory/docker/memory.usage_in_bytes": str(350 * MiB),
            "cpu,cpuacct/docker/cpu.cfs_quota_us": "50000",
            "cpu,cpuacct/docker/cpu.cfs_period_us": "100000",
        },
    )
    got = cgroup_limits(root, _proc(tmp_path, V1_PROC))
    assert got.memory_limit_bytes == 400 * MiB
    assert got.memory_headroom_bytes == 50 * MiB
    assert got.cpu_quota_cores == pytest.approx(0.5)


def test_v1_unlimited_reads_as_no_limit(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    _v1_tree(root)
    _write(
        root,
        {
            "memory/docker/abc/memory.limit_in_bytes": V1_NO_LIMIT,
            "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "-1",
        },
    )
    got = cgroup_limits(root, _proc(tmp_path, V1_PROC))
    assert got.memory_version == "v1" and got.cpu_version == "v1"
    assert got.memory_limit_bytes is None and got.memory_headroom_bytes is None
    assert got.cpu_quota_cores is None


def test_v1_container_sees_its_cgroup_at_the_mount_root(tmp_path: Path) -> None:
    # Docker without a cgroup namespace: /proc/self/cgroup names /docker/abc, but the
    # mount shows that cgroup itself at the root.
    root = tmp_path / "cgroup"
    _write(
        root,
        {
            "memory/memory.limit_in_bytes": str(256 * MiB),
            "memory/memory.usage_in_bytes": str(56 * MiB),
            "cpu/cpu.cfs_quota_us": "200000",
            "cpu/cpu.cfs_period_us": "100000",
        },
    )
    got = cgroup_limits(root, _proc(tmp_path, "9:memory:/docker/abc\n8:cpu:/docker/abc\n"))
    assert got.memory_headroom_bytes == 200 * MiB
    assert got.cpu_quota_cores == pytest.approx(2.0)


def _v2_tree(root: Path) -> Path:
    _write(
        root,
        {
            "cgroup.controllers": "cpu memory io",
            "user.slice/memory.max": "max",
            "user.slice/memory.current": str(900 * MiB),
            "user.slice/cpu.max": "max 100000",
            "user.slice/app/memory.max": str(1024 * MiB),
            "user.slice/app/memory.current": str(600 * MiB),
            "user.slice/app/memory.stat": f"anon 1\ninactive_file {64 * MiB}\nfile 2\n",
            "user.slice/app/cpu.max": "50000 100000",
        },
    )
    return root / "user.slice" / "app"


def test_v2_limits_of_this_cgroup(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    _v2_tree(root)
    got = cgroup_limits(root, _proc(tmp_path, "0::/user.slice/app\n"))
    assert got.memory_version == "v2" and got.cpu_version == "v2"
    assert got.memory_limit_bytes == 1024 * MiB
    assert got.memory_headroom_bytes == (1024 - 600 + 64) * MiB
    assert got.cpu_quota_cores == pytest.approx(0.5)


def test_v2_max_reads_as_no_limit(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    leaf = _v2_tree(root)
    _write(leaf, {"memory.max": "max", "cpu.max": "max 100000"})
    got = cgroup_limits(root, _proc(tmp_path, "0::/user.slice/app\n"))
    assert got.memory_version == "v2"
    assert got.memory_limit_bytes is None and got.cpu_quota_cores is None


def test_hybrid_host_reads_v2_from_unified_when_no_v1_controller(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    _write(
        root,
        {
            "unified/cgroup.controllers": "memory",
            "unified/svc/memory.max": str(128 * MiB),
            "unified/svc/memory.current": str(28 * MiB),
            "systemd/svc/tasks": "",
        },
    )
    got = cgroup_limits(root, _proc(tmp_path, "1:name=systemd:/svc\n0::/svc\n"))
    assert got.memory_version == "v2"
    assert got.memory_headroom_bytes == 100 * MiB


def test_no_cgroups_at_all(tmp_path: Path) -> None:
    got = cgroup_limits(tmp_path / "none", tmp_path / "missing")
    assert got == profiler.CgroupLimits()


def test_a_cpu_cgroup_out_of_sight_is_hidden_not_unlimited(tmp_path: Path) -> None:
    # ip netns exec mounts its own sysfs: /proc/self/cgroup names the testbed's cgroup,
    # and nothing of it is under the cgroup root.
    proc = _proc(tmp_path, "2:cpuacct:/\n1:cpu:/edgetrain-testbed-1/pi\n0::/\n")
    got = cgroup_limits(tmp_path / "none", proc)
    assert got.cpu_quota_cores is None and got.cpu_hidden
    root = cgroup_limits(tmp_path / "none", _proc(tmp_path, "1:cpu:/\n0::/\n"))
    assert not root.cpu_hidden  # the root cgroup holds no quota
    root_v2 = tmp_path / "cgroup"
    leaf = _v2_tree(root_v2)
    _write(leaf, {"cpu.max": "max 100000"})
    seen = cgroup_limits(root_v2, _proc(tmp_path, "0::/user.slice/app\n"))
    assert seen.cpu_quota_cores is None and not seen.cpu_hidden  # read: no quota


def test_usable_memory_never_above_the_cgroup_headroom(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    _v1_tree(root, limit=64 * MiB, usage=140 * MiB)  # 100 MiB of it reclaimable cache
    headroom = 24 * MiB
    got = usable_memory_bytes(root, _proc(tmp_path, V1_PROC))
    assert 0 < got <= headroom
    assert got == min(int(psutil.virtual_memory().available), headroom)


def test_usable_memory_without_limit_is_available_memory(tmp_path: Path) -> None:
    got = usable_memory_bytes(tmp_path / "none", tmp_path / "missing")
    assert 0 < got <= psutil.virtual_memory().total


def test_effective_cpu_count_respects_quota(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    _v2_tree(root)
    assert effective_cpu_count(root, _proc(tmp_path, "0::/user.slice/app\n")) == pytest.approx(0.5)
    assert effective_cpu_count(tmp_path / "none", tmp_path / "missing") >= 1


def test_this_machine_cgroups_read_without_error() -> None:
    got = cgroup_limits()
    if got.memory_headroom_bytes is not None:
        assert usable_memory_bytes() <= got.memory_headroom_bytes
    assert effective_cpu_count() > 0


def test_matmul_gflops_positive() -> None:
    assert measure_matmul_gflops(seconds=0.2) > 0
    assert measure_matmul_gflops(seconds=0.05, size=64) > 0
    assert measure_matmul_gflops(torch.bfloat16, seconds=0.05, size=128) > 0


def test_matmul_leaves_the_thread_count_alone() -> None:
    before = torch.get_num_threads()
    result = matmul.matmul_benchmark(seconds=0.05, size=128)
    assert torch.get_num_threads() == before == result.threads
    assert result.size == 128 and result.repeats >= 3


def test_default_link_from_interface_speed(tmp_path: Path, monkeypatch) -> None:
    route = tmp_path / "route"
    route.write_text(
        "Iface\tDestination\tGateway\tFlags\n"
        "wlan0\t000200C0\t00000000\t0001\n"
        "wlan0\t00000000\t010200C0\t0003\n"
    )
    speeds = {"wlan0": SimpleNamespace(speed=54)}
    monkeypatch.setattr(profiler.psutil, "net_if_stats", lambda: speeds)
    bandwidth, latency, details = default_link(route)
    assert (bandwidth, details) == (54.0, {"link_source": "interface-speed", "interface": "wlan0"})
    assert latency == profiler.DEFAULT_LATENCY_MS

    speeds["wlan0"] = SimpleNamespace(speed=0)  # psutil's "unknown"
    bandwidth, _, details = default_link(route)
    assert bandwidth == profiler.DEFAULT_BANDWIDTH_MBPS and details["link_source"] == "default"

    bandwidth, _, details = default_link(tmp_path / "no-route")
    assert details == {"link_source": "default", "interface": None}


@pytest.mark.parametrize(
    ("url", "expected"),
    [("mqtt://10.0.0.5:1884", ("10.0.0.5", 1884)), ("mqtt://broker.local", ("broker.local", 1883))],
)
def test_parse_broker_url(url: str, expected: tuple[str, int]) -> None:
    assert parse_broker_url(url) == expected


@pytest.mark.parametrize("url", ["http://host:1883", "host:1883", "mqtt://", "mqtt://h:99999"])
def test_bad_broker_url_is_one_line_naming_it(url: str) -> None:
    with pytest.raises(UserError) as err:
        parse_broker_url(url)
    assert url in err.value.message and "\n" not in err.value.message
    assert err.value.exit_code == 2


def test_profile_round_trips_as_a_device_spec() -> None:
    measured = profile_device(device_id="cam-01", seconds=0.1)
    spec = measured.to_device_spec()
    assert spec.id == "cam-01" and spec.gflops > 0 and spec.memory_bytes > 0
    assert spec.details is not None
    assert spec.details["link_source"] in ("interface-speed", "default")
    for key in ("hostname", "cores_logical", "cores_effective", "torch_version", "matmul"):
        assert key in spec.details

    text = json.dumps(measured.to_json())  # what `edgetrain profile --json` prints
    assert DeviceSpec.model_validate_json(text) == spec
    layer = {"name": "fc", "fwd_flops": 1e6, "param_bytes": 4e3, "out_bytes": 40.0}
    data = {"version": 1, "batch_size": 8, "microbatches": 2, "layers": [layer]}
    problem = parse_problem({**data, "devices": [json.loads(text)]})
    assert problem.devices[0] == spec


def test_device_spec_still_refuses_unknown_fields() -> None:
    good = {"id": "a", "gflops": 1.0, "memory_bytes": 1e9, "bandwidth_mbps": 10, "latency_ms": 1}
    assert DeviceSpec.model_validate(good).details is None
    with pytest.raises(ValueError, match="extra"):
        DeviceSpec.model_validate({**good, "detail": {}})


def test_unit_times_name_every_unit_in_order_with_its_seconds_per_batch() -> None:
    """``profile --model``'s ``details.units``: the model as named, the batch, and each
    unit's forward and backward seconds, as JSON."""
    units = profile_unit_times("mlp", 4)
    assert units["model"] == "mlp" and units["batch_size"] == 4
    assert [t["name"] for t in units["times"]] == get_model("mlp").unit_names
    assert all(t["fwd_time_s"] > 0 and t["bwd_time_s"] > 0 for t in units["times"])
    assert json.loads(json.dumps(units)) == units
