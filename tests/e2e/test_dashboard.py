"""The dashboard in headless Chromium during a real job: fleet, timeline and a growing loss curve,
its polls asking only for new steps (``?since_step=``).

Three agents run a 3-stage job (``stages=3``), so the timeline must show three rows.
Before it, the same three run a short job on groups ``2,1`` (``group_sizes``): its
pipeline view draws stage 0 as a group, each member with its share, and stage 1 as
one device, as every one-device stage looks; and where its step went draws, for each
of its three members, the predicted and the measured parts the API gives.

Needs Debian's ``chromium`` at ``/usr/bin/chromium`` and the ``playwright``
Python package (its own browser download is not used).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from support.markers import needs_mosquitto
from support.mosquitto import mosquitto_broker
from support.waiting import until

from coordinator.local.broker import free_port
from coordinator.local.fleet import LocalFleet
from coordinator.service.serve import serve_in_thread
from coordinator.service.settings import Settings

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]

try:
    from playwright.sync_api import sync_playwright
except ImportError:  # pragma: no cover - depends on the environment
    sync_playwright = None  # type: ignore[assignment]

pytestmark = [
    *needs_mosquitto,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="/usr/bin/chromium not installed"),
    pytest.mark.skipif(sync_playwright is None, reason="playwright not installed"),
]


def _call(url: str, method: str = "GET", body: dict[str, Any] | None = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


GROUP_JOB: dict[str, Any] = {
    "model": "mlp",
    "steps": 3,
    "batch_size": 16,
    "microbatches": 2,
    "partition": "even",
    "group_sizes": [2, 1],
}


def _check_group_drawn(
    page: Any, record: dict[str, Any], anatomy: dict[str, Any], tmp_path: Path
) -> None:
    """The job of :data:`GROUP_JOB`'s pipeline view: stage 0's members with their shares
    (from the plan's ``devices`` and ``shares``), stage 1 a plain one-device row; and
    where its step went, member by member."""
    first, second = record["plan"]["stages"]
    assert len(first["devices"]) == 2 and len(first["shares"]) == 2
    assert "device" not in first and second["devices"] == [second["device"]]
    page.evaluate(f"location.hash = '#/jobs/{record['id']}'")
    page.wait_for_selector("#timeline .tl-member", timeout=15_000)
    _check_anatomy_drawn(page, anatomy, record["plan"])
    page.screenshot(path=str(tmp_path / "dashboard-group.png"), full_page=True)
    group = page.locator('#timeline .tl-row[data-stage="0"]')
    assert group.get_attribute("data-members") == "2"
    assert group.locator("text").first.text_content() == "0 group of 2"
    members = group.locator(".tl-member")
    assert members.count() == 2
    total = sum(first["shares"])
    for m, (device, share) in enumerate(zip(first["devices"], first["shares"], strict=True)):
        member = members.nth(m)
        assert member.get_attribute("data-member") == str(m)
        assert member.get_attribute("data-device") == device
        assert member.get_attribute("data-share") == f"{share / total:.4f}"
        assert member.locator("text").first.text_content() == device[:12]
    alone = page.locator('#timeline .tl-row[data-stage="1"]')
    assert alone.get_attribute("data-members") == "1"
    assert alone.locator(".tl-member").count() == 0
    assert alone.locator("text").first.text_content() == f"1 {second['device']}"[:14]
    assert page.locator("#timeline .tl-row").count() == 2


def _check_anatomy_drawn(page: Any, anatomy: dict[str, Any], plan: dict[str, Any]) -> None:
    """Where the step goes, for an ended job: a row per member of the plan, each with its
    predicted parts stacked and its measured ones, as the API gives them."""
    members = [d for st in plan["stages"] for d in st["devices"]]
    assert anatomy["measured"]["steps"] == GROUP_JOB["steps"] - 2  # not the first, nor the last
    page.wait_for_selector('#anatomy .an-bar[data-kind="measured"]', timeout=15_000)
    rows = page.locator("#anatomy .an-row")
    assert rows.count() == len(members) == 3
    for i, device in enumerate(members):
        row = rows.nth(i)
        assert row.get_attribute("data-device") == device
        for kind in ("predicted", "measured"):
            bar = row.locator(f'.an-bar[data-kind="{kind}"]')
            parts = anatomy[kind]["members"][i]
            drawn = {
                name: float(bar.locator(f"rect.part-{name}").get_attribute("data-seconds") or 0)
                for name in anatomy[kind]["parts"]
            }
            assert drawn == pytest.approx({p: parts[p] for p in drawn}, abs=2e-6), (kind, device)


@pytest.mark.slow
def test_dashboard_shows_fleet_timeline_and_a_growing_loss_curve(tmp_path: Path) -> None:
    assert sync_playwright is not None
    with mosquitto_broker() as broker:
        settings = Settings(broker_url=broker.url, data_dir=tmp_path / "coord", port=free_port())
        with serve_in_thread(settings) as base, LocalFleet(3, broker.url, threads=1) as fleet:
            api = f"{base}/api/v1"

            def online() -> int:
                devices = _call(f"{api}/devices")["data"]
                return sum(d["state"] == "online" for d in devices)

            assert until(lambda: online() == 3, 90)
            grouped = _call(f"{api}/jobs", "POST", GROUP_JOB)["id"]
            assert until(lambda: _call(f"{api}/jobs/{grouped}")["state"] == "completed", 120)
            body = {
                "model": "cnn-digits",
                "steps": 5000,
                "batch_size": 16,
                "microbatches": 4,
                "stages": 3,
            }
            job = _call(f"{api}/jobs", "POST", body)["id"]
            try:
                assert until(lambda: _call(f"{api}/jobs/{job}")["steps_done"] >= 3, 120)
                with sync_playwright() as pw:
                    browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
                    try:
                        page = browser.new_page(viewport={"width": 1400, "height": 1000})
                        errors: list[str] = []
                        page.on("pageerror", lambda exc: errors.append(str(exc)))
                        requested: list[str] = []
                        page.on("request", lambda request: requested.append(request.url))
                        page.goto(base + "/")
                        for device in fleet.ids:
                            page.wait_for_selector(
                                f'#fleet tr[data-device="{device}"]', timeout=15_000
                            )
                        page.wait_for_selector(f'#jobs tr[data-job="{job}"]', timeout=15_000)
                        page.click(f'#jobs a[href="#/jobs/{job}"]')
                        page.wait_for_selector("#timeline .tl-row", timeout=15_000)
                        plan = _call(f"{api}/jobs/{job}")["plan"]
                        assert {st["device"] for st in plan["stages"]} == set(fleet.ids)
                        assert len(plan["stages"]) == 3
                        assert page.locator("#timeline .tl-row").count() == 3
                        # The measured step too: a row per stage once all three reported it.
                        page.wait_for_selector("#measured .tl-row", timeout=15_000)
                        rows = page.locator("#measured .tl-row")
                        assert until(lambda: rows.count() == 3, 20), rows.count()
                        page.wait_for_selector("#loss-chart polyline", timeout=15_000)

                        def points() -> int:
                            value = page.get_attribute("#loss-chart polyline", "data-points")
                            return int(value or 0)

                        first = points()
                        assert first >= 1
                        page.wait_for_timeout(4_000)
                        grew = until(lambda: points() > first, 20)
                        page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
                        record = _call(f"{api}/jobs/{job}")
                        assert grew, (
                            first,
                            points(),
                            record["state"],
                            record["steps_done"],
                            page.inner_text("#live"),
                        )
                        page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
                        _check_group_drawn(
                            page,
                            _call(f"{api}/jobs/{grouped}"),
                            _call(f"{api}/jobs/{grouped}/anatomy"),
                            tmp_path,
                        )
                        assert not errors, errors
                        # The whole history once, then only the steps after the ones held.
                        polls = [u for u in requested if f"/jobs/{job}/metrics" in u]
                        assert "since_step" not in polls[0], polls
                        assert any("?since_step=" in u for u in polls[1:]), polls
                    finally:
                        browser.close()
            finally:
                try:
                    _call(f"{api}/jobs/{job}/cancel", "POST")
                except urllib.error.HTTPError as exc:  # it may have finished already
                    assert exc.code == 409
