"""The device-profile catalogue (edge.profiling.catalog, device_profiles/, `edgetrain devices`).

Every shipped profile loads and converts into a planning-problem device (with its
predicted power only when asked); names resolve to profiles and memory variants;
corrupted copies of a profile are refused with one line naming the file and the
field. tests/integration/test_devices_cli.py runs `edgetrain devices` itself.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.catalog import TESTBED_NAMES, rpi4_data, shipped_files

from edge.errors import UserError
from edge.problem import DeviceSpec, PlanningProblem
from edge.profiling.catalog import (
    GIB,
    DeviceProfile,
    all_resolved,
    catalogue_dir,
    load_catalogue,
    load_profile_file,
    profile_names,
    resolve,
)

REQUIRED = {
    "rpi3b-plus",
    "rpi4",
    "rpi5",
    "jetson-nano",
    "jetson-xavier-nx",
    "jetson-orin-nano",
    "jetson-agx-orin",
    "phone-sd8g3",
    "nuc",
    "laptop",
    "t4",
    "a100-80gb",
    "h100-sxm",
    "h200",
}


# --- the shipped catalogue -------------------------------------------------------


def test_catalogue_holds_the_required_devices() -> None:
    files = shipped_files()
    assert len(files) >= 14
    assert {f.stem for f in files} >= REQUIRED
    assert set(load_catalogue()) == {f.stem for f in files}


@pytest.mark.parametrize("path", shipped_files(), ids=lambda p: p.stem)
def test_every_profile_file_loads_and_is_consistent(path: Path) -> None:
    profile = load_profile_file(path)
    assert profile.id == path.stem
    t = profile.training
    if t.unit == "cpu":
        peak = profile.cpu.peak_fp32_gflops
    else:
        assert profile.accelerator is not None
        found = profile.accelerator.peak(t.precision)
        assert found is not None
        peak = found
    assert 0 < t.sustained_gflops <= peak
    assert len(t.basis) > 40, "the sustained figure needs a real explanation"
    wanted = {"cpu", "scalar", "training", "memory", "link", "power"}
    assert profile.scalar is not None, "every shipped device has a sourced scalar speed"
    assert len(profile.scalar.basis) > 40, "the scalar score needs a real explanation"
    if profile.accelerator is not None:
        wanted.add("accelerator")
        if profile.accelerator.peak("fp32") is not None:
            assert profile.accelerator.peak("fp16") is not None
    assert set(profile.sources) == wanted
    assert all(source.title for refs in profile.sources.values() for source in refs)


def test_every_shipped_scalar_score_is_of_one_benchmark_and_reaches_the_device() -> None:
    """Scores are compared as ratios ([Note: two speeds of a device]): one benchmark for all;
    a Pi 4's single core is several times slower than the laptop's on scalar code, but not
    the 29x of their FLOP rates."""
    catalogue = load_catalogue()
    benchmarks = {p.scalar.benchmark for p in catalogue.values() if p.scalar is not None}
    assert len(benchmarks) == 1
    for r in all_resolved(catalogue):
        assert r.profile.scalar is not None
        assert r.to_device_spec().details == {
            "scalar_score": r.profile.scalar.score,
            "scalar_benchmark": r.profile.scalar.benchmark,
        }
    pi, laptop = catalogue["rpi4"], catalogue["laptop"]
    assert pi.scalar is not None and laptop.scalar is not None
    scalar_ratio = laptop.scalar.score / pi.scalar.score
    flop_ratio = laptop.training.sustained_gflops / pi.training.sustained_gflops
    assert 3 < scalar_ratio < flop_ratio / 2


def test_every_profile_and_variant_converts_to_a_valid_device_spec() -> None:
    resolved = all_resolved(load_catalogue())
    assert len(resolved) >= 14
    specs = []
    for r in resolved:
        spec = r.to_device_spec()
        assert isinstance(spec, DeviceSpec)
        assert spec.id == r.name
        assert spec.gflops == r.profile.training.sustained_gflops
        assert spec.memory_bytes == pytest.approx(r.sizes.usable_gib * GIB)
        assert spec.bandwidth_mbps == r.profile.link.bandwidth_mbps
        assert spec.latency_ms == r.profile.link.latency_ms
        assert all(math.isfinite(v) for v in (spec.gflops, spec.memory_bytes, spec.latency_ms))
        specs.append(spec.model_dump(mode="json", exclude_none=True))
    # Together they form the devices of a valid planning problem (unique ids, strict types).
    problem = PlanningProblem.model_validate(
        {
            "version": 1,
            "batch_size": 32,
            "microbatches": 4,
            "layers": [{"name": "fc", "fwd_flops": 1e6, "param_bytes": 4e3, "out_bytes": 40.0}],
            "devices": specs,
        }
    )
    assert len(problem.devices) == len(resolved)


@pytest.mark.parametrize("path", shipped_files(), ids=lambda p: p.stem)
def test_every_profile_predicts_busy_and_idle_power_with_a_source(path: Path) -> None:
    profile = load_profile_file(path)
    power = profile.power
    assert 0 < power.idle_w <= power.busy_w
    assert power.max_w is None or power.busy_w <= power.max_w
    # The basis says where each figure comes from, and that none is measured here.
    assert power.basis.startswith("busy: ") and " idle: " in power.basis
    assert "nothing here measures power" in power.basis.lower()
    assert profile.sources["power"] and all(s.title for s in profile.sources["power"])


def test_device_specs_carry_the_predicted_watts_only_when_asked() -> None:
    resolved = all_resolved(load_catalogue())
    plain = [r.to_device_spec() for r in resolved]
    assert all(d.watts_busy is None and d.watts_idle is None for d in plain)
    powered = [r.to_device_spec(power=True) for r in resolved]
    for r, without, spec in zip(resolved, plain, powered, strict=True):
        assert spec.watts_busy == r.profile.power.busy_w
        assert spec.watts_idle == r.profile.power.idle_w
        assert spec.model_copy(update={"watts_busy": None, "watts_idle": None}) == without
    assert resolve("rpi4-4gb").to_device_spec("pi", power=True).model_dump(
        mode="json", exclude_none=True
    ) == {
        "id": "pi",
        "gflops": 7.2,
        "memory_bytes": float(round(3.0 * GIB)),
        "bandwidth_mbps": 940.0,
        "latency_ms": 0.15,
        "watts_busy": 6.4,
        "watts_idle": 2.7,
        "details": {"scalar_score": 240.0, "scalar_benchmark": "Geekbench 5 single-core"},
    }
    problem = {
        "batch_size": 32,
        "microbatches": 4,
        "layers": [{"name": "fc", "fwd_flops": 1e6, "param_bytes": 4e3, "out_bytes": 40.0}],
    }
    devices = [d.model_dump(mode="json", exclude_none=True) for d in powered]
    v2 = PlanningProblem.model_validate({**problem, "version": 2, "devices": devices})
    assert [d.watts_busy for d in v2.devices] == [r.profile.power.busy_w for r in resolved]
    with pytest.raises(ValueError, match=r"devices\.0\.watts_busy: only in version 2"):
        PlanningProblem.model_validate({**problem, "version": 1, "devices": devices})


def test_figures_are_in_the_right_order_and_match_vendor_numbers() -> None:
    cat = load_catalogue()

    def speed(pid: str) -> float:
        return cat[pid].training.sustained_gflops

    assert speed("rpi3b-plus") < speed("rpi4") < speed("rpi5") < speed("jetson-nano")
    jetsons = ["jetson-nano", "jetson-xavier-nx", "jetson-orin-nano", "jetson-agx-orin"]
    assert [speed(j) for j in jetsons] == sorted(speed(j) for j in jetsons)
    assert speed("jetson-agx-orin") < speed("t4") < speed("a100-80gb") < speed("h100-sxm")
    nano, h100, h200 = cat["jetson-nano"], cat["h100-sxm"], cat["h200"]
    assert nano.accelerator and nano.accelerator.peak("fp16") == pytest.approx(472, rel=0.01)
    assert nano.accelerator.peak("fp32") == pytest.approx(236, rel=0.01)
    assert h100.accelerator and h100.accelerator.peak("fp32") == pytest.approx(67_000)
    assert h100.accelerator.peak("bf16") == pytest.approx(989_400, rel=0.01)
    assert h200.accelerator and h200.accelerator.peak("bf16") == h100.accelerator.peak("bf16")
    assert h200.memory.bandwidth_gb_s == 4800
    assert resolve("h200").sizes.total_gib > 130 > resolve("h100-sxm").sizes.total_gib


# --- name resolution -------------------------------------------------------------


@pytest.mark.parametrize("name", TESTBED_NAMES)
def test_testbed_names_resolve(name: str) -> None:
    r = resolve(name)
    # A name without a variant means the default one: `laptop` is `laptop-32gb`.
    assert r.name == name or (
        r.name == f"{name}-{r.variant}" == f"{name}-{r.profile.default_variant}"
    )
    assert r.to_device_spec().id == r.name
    assert r.to_device_spec("node-7").id == "node-7"


def test_variants_resolve_with_their_own_memory() -> None:
    small, large = resolve("rpi4-4gb"), resolve("rpi4-8gb")
    assert small.profile is large.profile
    assert small.sizes.total_gib == 4 and large.sizes.total_gib == 8
    assert small.to_device_spec().memory_bytes < large.to_device_spec().memory_bytes
    assert small.to_device_spec().gflops == large.to_device_spec().gflops
    default = resolve("rpi4")
    assert default.variant == "4gb" and default.name == "rpi4-4gb"
    assert resolve(" RPi5-8GB ").name == "rpi5-8gb"
    assert resolve("t4").variant is None
    names = profile_names(load_catalogue())
    assert {"rpi4", "rpi4-2gb", "rpi4-4gb", "rpi4-8gb", "h200"} <= set(names)


def test_unknown_names_give_a_helpful_user_error() -> None:
    with pytest.raises(UserError) as typo:
        resolve("jetson-nan")
    assert typo.value.exit_code == 2
    assert "jetson-nano" in typo.value.message and "\n" not in typo.value.message
    with pytest.raises(UserError) as variant:
        resolve("rpi4-16gb")
    assert "16gb" in variant.value.message and "rpi4-8gb" in variant.value.message
    with pytest.raises(UserError, match="devices list"):
        resolve("zzzz")


def _write(tmp_path: Path, data: dict[str, Any], name: str = "rpi4.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _refused(path: Path) -> str:
    with pytest.raises(UserError) as err:
        load_profile_file(path)
    assert err.value.exit_code == 2
    assert "\n" not in err.value.message
    assert err.value.message.startswith(f"{path}: ")
    return err.value.message


@pytest.mark.parametrize(
    ("section", "key", "value", "expected"),
    [
        (
            "memory",
            "bandwidth_gb_s",
            float("nan"),
            "memory.bandwidth_gb_s: Input should be a finite",
        ),
        (
            "memory",
            "bandwidth_gb_s",
            float("inf"),
            "memory.bandwidth_gb_s: Input should be a finite",
        ),
        ("link", "latency_ms", -1.0, "link.latency_ms: Input should be greater than or equal to 0"),
        ("link", "bandwidth_mbps", 0, "link.bandwidth_mbps: Input should be greater than 0"),
        ("cpu", "cores", 4.5, "cpu.cores: Input should be a valid integer"),
        (
            "training",
            "sustained_gflops",
            True,
            "training.sustained_gflops: Input should be a valid",
        ),
        ("training", "precision", "fp8", "training.precision: Input should be"),
        ("power", "typical_w", 99.0, "power: typical_w (99.0) exceeds max_w (15.3)"),
        ("power", "idle_w", 9.0, "power: idle_w (9.0) exceeds busy_w (6.4)"),
        ("power", "busy_w", 20.0, "power: busy_w (20.0) exceeds max_w (15.3)"),
        ("power", "idle_w", 0, "power.idle_w: Input should be greater than 0"),
        ("power", "busy_w", "6.4", "power.busy_w: Input should be a valid number"),
    ],
)
def test_bad_numbers_are_refused(
    tmp_path: Path, section: str, key: str, value: object, expected: str
) -> None:
    data = rpi4_data()
    data[section][key] = value
    assert expected in _refused(_write(tmp_path, data))


def test_memory_cross_checks(tmp_path: Path) -> None:
    data = rpi4_data()
    data["variants"]["8gb"]["usable_gib"] = 9.0
    assert "variants.8gb: usable_gib (9.0) exceeds total_gib (8.0)" in _refused(
        _write(tmp_path, data)
    )
    data = rpi4_data()
    data["variants"]["4gb"]["total_gib"] = 0
    assert "variants.4gb.total_gib: Input should be greater than 0" in _refused(
        _write(tmp_path, data)
    )
    data = rpi4_data()
    data["default_variant"] = "3gb"
    assert "default_variant: must name one of 2gb, 4gb, 8gb (got '3gb')" in _refused(
        _write(tmp_path, data)
    )
    data = rpi4_data()
    del data["variants"]
    del data["default_variant"]
    assert "memory.total_gib: Field required" in _refused(_write(tmp_path, data))


def test_structural_errors_are_refused(tmp_path: Path) -> None:
    for key in ("busy_w", "idle_w"):
        data = rpi4_data()
        del data["power"][key]
        assert f"power.{key}: Field required" in _refused(_write(tmp_path, data))
    data = rpi4_data()
    del data["sources"]["power"]
    assert "sources.power: Field required" in _refused(_write(tmp_path, data))
    data = rpi4_data()
    data["sources"]["accelerator"] = [{"title": "nothing"}]
    assert "sources.accelerator: no such part" in _refused(_write(tmp_path, data))
    data = rpi4_data()
    data["training"]["unit"] = "accelerator"
    assert "training.unit: 'accelerator', but the profile has none" in _refused(
        _write(tmp_path, data)
    )
    assert "id: 'rpi4' does not match the file name" in _refused(
        _write(tmp_path, rpi4_data(), "pi.yaml")
    )
    data = rpi4_data()
    data["schema_version"] = 2
    assert "schema_version: unknown version 2" in _refused(_write(tmp_path, data))


def test_yaml_problems_are_one_line(tmp_path: Path) -> None:
    path = tmp_path / "rpi4.yaml"
    path.write_text("id: rpi4\nname: [unclosed\n")
    assert "not valid YAML" in _refused(path) and "line" in _refused(path)
    path.write_text((catalogue_dir() / "rpi4.yaml").read_text() + "name: Another name\n")
    assert "duplicate key 'name'" in _refused(path)
    path.write_text("- just\n- a list\n")
    assert "expected a mapping" in _refused(path)
    path.write_text("")
    assert "an empty file" in _refused(path)
    assert "cannot read" in _refused(tmp_path / "missing.yaml")


def test_exponent_numbers_read_as_numbers(tmp_path: Path) -> None:
    text = (catalogue_dir() / "rpi4.yaml").read_text()
    path = tmp_path / "rpi4.yaml"
    path.write_text(text.replace("bandwidth_mbps: 940.0", "bandwidth_mbps: 9.4e2"))
    profile: DeviceProfile = load_profile_file(path)
    assert profile.link.bandwidth_mbps == 940.0


def test_a_name_colliding_across_files_is_refused(tmp_path: Path) -> None:
    for f in shipped_files():
        (tmp_path / f.name).write_text(f.read_text())
    data = yaml.safe_load((catalogue_dir() / "t4.yaml").read_text())
    data["id"] = "rpi4-8gb"
    _write(tmp_path, data, "rpi4-8gb.yaml")
    with pytest.raises(UserError, match=r"variants\.8gb: the name 'rpi4-8gb' is also the id"):
        load_catalogue(tmp_path)
    assert set(load_catalogue(catalogue_dir())) == set(load_catalogue())
