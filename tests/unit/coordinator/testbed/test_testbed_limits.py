"""Method detection from mountinfo text, cgroup limits, tc and sh command construction;
what ``Testbed.up`` refuses before it starts anything."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from coordinator.planner.build import parse_fleet
from coordinator.testbed import limits, netns, procs
from coordinator.testbed.limits import Controller, Detection, find_controllers
from coordinator.testbed.testbed import Testbed
from edge.errors import UserError
from edgetrain.cli.testbed import _parse_links

V1 = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
V2 = "29 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
HYBRID = """\
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct
41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw
"""


def controllers_file(text: str) -> Callable[[str], str]:
    return lambda path: text if path.endswith("cgroup.controllers") else ""


def test_v1_hierarchies_win() -> None:
    found = find_controllers(V1, controllers_file("hugetlb"))
    assert found["cpu"] == Controller("cpu", "v1", Path("/sys/fs/cgroup/cpu"))
    assert found["memory"] == Controller("memory", "v1", Path("/sys/fs/cgroup/memory"))


def test_v2_controllers_come_from_cgroup_controllers() -> None:
    found = find_controllers(V2, controllers_file("cpuset cpu io memory pids"))
    assert found == {
        "cpu": Controller("cpu", "v2", Path("/sys/fs/cgroup")),
        "memory": Controller("memory", "v2", Path("/sys/fs/cgroup")),
    }
    assert find_controllers(V2, controllers_file("pids")) == {}


def test_hybrid_mixes_versions() -> None:
    found = find_controllers(HYBRID, controllers_file("memory pids"))
    assert found["cpu"].version == "v1" and found["cpu"].root == Path("/sys/fs/cgroup/cpu,cpuacct")
    assert found["memory"] == Controller("memory", "v2", Path("/sys/fs/cgroup/unified"))


def test_software_when_asked_and_its_line() -> None:
    detection = limits.detect("software")
    assert detection.method == "software"
    assert detection.line == (
        "software (duty-cycled compute, token bucket in the agent transport): "
        "requested (--method software)"
    )
    cpu = Controller("cpu", "v1", Path("/c"))
    kernel = Detection("kernel", "root", cpu, Controller("memory", "v1", Path("/m")))
    assert kernel.line == "kernel (cgroup v1, netns + tc tbf, delay proxy; quota at the FLOP speed)"
    scalar = Detection("scalar", "root", cpu, Controller("memory", "v1", Path("/m")))
    assert scalar.line == (
        "scalar (cgroup v1, netns + tc tbf, delay proxy; "
        "quota at the scalar speed, compute throttled to FLOPs)"
    )


def test_cgroup_limits_v1_and_v2() -> None:
    cpu1, mem1 = Controller("cpu", "v1", Path("/c")), Controller("memory", "v1", Path("/m"))
    cpu2, mem2 = Controller("cpu", "v2", Path("/u")), Controller("memory", "v2", Path("/u"))
    assert limits.cgroup_limits(cpu1, 0.25, 1) == {
        "cpu.cfs_period_us": "20000",
        "cpu.cfs_quota_us": "5000",
    }
    assert limits.cgroup_limits(cpu2, 1.5, 1) == {"cpu.max": "30000 20000"}
    assert limits.cgroup_limits(mem1, 1, 2**30) == {"memory.limit_in_bytes": str(2**30)}
    assert limits.cgroup_limits(mem2, 1, 2**30) == {"memory.max": str(2**30)}
    # A tiny share gets a longer period so its quota stays at least one tick.
    assert limits.cgroup_limits(cpu1, 0.01, 1) == {
        "cpu.cfs_period_us": "400000",
        "cpu.cfs_quota_us": "4000",
    }
    assert limits.cgroup_parent(cpu1, "ab12") == Path("/c/edgetrain-testbed-ab12")


def test_tbf_burst_and_limit_scale_with_the_rate() -> None:
    slow = netns.tbf_args(1)
    assert slow == [
        "tbf",
        "rate",
        "1000kbit",
        "burst",
        str(16 * 1024),
        "limit",
        str(16 * 1024 + 64 * 1024),
    ]
    fast = netns.tbf_args(1000)  # 125 MB/s: 4 ms is 500 kB of burst, 50 ms of queue
    assert fast[fast.index("burst") + 1] == "500000"
    assert fast[fast.index("limit") + 1] == str(500000 + 6250000)


def test_link_names_fit_ifnamsiz() -> None:
    link = netns.link_names("ab12", 63, "10.201.7")
    assert link.namespace == "et-ab12-63"
    assert max(len(link.host_if), len(link.agent_if)) <= 15
    assert (link.host_ip, link.agent_ip) == ("10.201.7.253", "10.201.7.254")
    with pytest.raises(ValueError):
        netns.link_names("ab12", 64, "10.201.7")


def test_agent_command_joins_cgroups_then_namespace() -> None:
    agent = procs.agent_command(
        procs.login_args(Path("/s/credentials/rpi.json"), "mqtts://10.0.0.1:8883"),
        "rpi",
        profile=Path("/s/rpi.json"),
        data_dir=Path("/s/agents/rpi"),
        threads=1,
        shaping={"--slowdown": 4.0, "--link-mbps": 100.0},
    )
    assert agent[agent.index("--profile") + 1] == "/s/rpi.json"
    assert agent[agent.index("--credentials") + 1] == "/s/credentials/rpi.json"
    assert "--insecure" not in agent and "--broker" not in agent  # the file names the broker
    assert "--data" not in agent
    assert agent[-4:] == ["--slowdown", "4", "--link-mbps", "100"]
    files = [Path("/c/a/cgroup.procs"), Path("/m/a/cgroup.procs")]
    cmd = procs.in_cgroups_and_netns(agent, files, "et-ab12-0")
    assert cmd[:5] == ["sh", "-c", procs.CGROUP_EXEC, "sh", "2"]
    assert cmd[5:11] == [*map(str, files), "ip", "netns", "exec", "et-ab12-0"]
    assert cmd[11:] == agent  # passed as arguments, never spliced into the script


def test_agents_log_in_by_credentials_and_only_an_anonymous_broker_by_url() -> None:
    creds = Path("/s/credentials/rpi.json")
    assert procs.login_args(creds, "mqtts://127.0.0.1:8883") == ["--credentials", str(creds)]
    url = "mqtt://127.0.0.1:1883"
    assert procs.login_args(None, url) == ["--broker", url, "--insecure"]


def test_link_overrides_parse() -> None:
    assert _parse_links(["rpi4-4gb-1=5", "laptop=0.5"]) == {"rpi4-4gb-1": 5.0, "laptop": 0.5}
    for bad in ("rpi", "=5", "rpi=0", "rpi=fast"):
        with pytest.raises(UserError, match="--link"):
            _parse_links([bad])


def test_agent_command_passes_local_data() -> None:
    agent = procs.agent_command(
        procs.login_args(None, "mqtt://127.0.0.1:1883"),
        "rpi",
        profile=Path("/s/rpi.json"),
        data_dir=Path("/s/agents/rpi"),
        threads=1,
        data=["digits=digits:shard=1/2", "images=synthetic-images:shard=1/2"],
    )
    got = [agent[i + 1] for i, arg in enumerate(agent) if arg == "--data"]
    assert got == ["digits=digits:shard=1/2", "images=synthetic-images:shard=1/2"]


def test_up_refuses_local_data_for_a_device_not_in_the_fleet(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="local data for 'nope': no such device"):
        Testbed.up(parse_fleet("rpi4-4gb"), state_dir=tmp_path, data={"nope": ["d=digits"]})
    assert not list(tmp_path.iterdir())  # refused before anything was made
