"""The status page at `/`: rendered in-process from recorded runs, and driven in a real browser.

The browser test runs Debian's chromium through the playwright package (never `playwright
install`) against a real exporter while a real 4-rank gloo job with a slowed rank trains, and
waits for the page to flag the slowed rank *by refreshing itself*. It saves a screenshot under
the test's tmp dir, and also at $SYNCSCOPE_SCREENSHOT when set: that is how docs/status-page.png
is made (`SYNCSCOPE_SCREENSHOT=docs/status-page.png pytest tests/e2e/test_status_page.py`).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from syncscope.exporter.app import create_app
from syncscope.exporter.diagnosis import diagnose_job
from syncscope.exporter.page import render_page, render_status
from syncscope.exporter.settings import Settings
from syncscope.exporter.store import JobView, RankView, StoreView

from tests.conftest import wait_until

SCENARIOS = Path(__file__).resolve().parents[1] / "fixtures" / "scenarios"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SLOW_RANK = 2


def recorded_view(name: str, job: str = "demo") -> StoreView:
    with gzip.open(SCENARIOS / f"{name}.json.gz", "rt") as f:
        data = json.load(f)["job"]
    now = time.time()
    ranks = [replace(RankView.from_json(r), last_report_unix_s=now) for r in data["ranks"]]
    return view_of(ranks, job, now)


def view_of(ranks: list[RankView], job: str, now: float) -> StoreView:
    """One job's ranks as the store would show them, diagnosed."""
    diagnosis = diagnose_job(ranks, Settings())
    return StoreView(now, now, 1, {}, {job: JobView(tuple(ranks), diagnosis, job)})


# -- in-process: the routes and the renderer ------------------------------------------------------
def test_page_works_with_no_ranks_and_serves_its_own_assets() -> None:
    with TestClient(create_app(Settings())) as client:
        page = client.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "No ranks have reported yet" in page.text
        csp = page.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "default-src 'none'" in csp
        # Everything the page loads is served by the exporter itself: no CDN, no inline script.
        assert "http://" not in page.text and "https://" not in page.text
        assert "<script>" not in page.text and " style=" not in page.text
        for asset, kind in (("ui/page.css", "text/css"), ("ui/page.js", "text/javascript")):
            reply = client.get("/" + asset)
            assert reply.status_code == 200 and reply.headers["content-type"].startswith(kind)
            assert f'"{asset}?v=' in page.text
        assert client.get("/ui/../app.py").status_code == 404
        assert client.get("/ui/nothing.js").status_code == 404
        body = client.get("/ui/status")
        assert body.status_code == 200 and "data-headline" in body.text
        # The page is not part of the API description.
        assert "/ui/status" not in client.get("/openapi.json").text


def test_straggler_is_flagged_in_words_not_only_colour() -> None:
    html = render_status(recorded_view("forward_straggler"), Settings())
    assert "STRAGGLER: rank 2" in html
    assert "Cause: <strong" in html and "forward" in html
    assert '<tr class="straggler">' in html and "⚠ STRAGGLER" in html
    assert "▲ DETECTED" in html  # verdicts are words too
    assert 'aria-label="share of step: forward' in html  # the stacked bar's text equivalent
    assert "Step time over the last 120 steps" in html  # the sparkline's text equivalent
    for mode in ("Synchronization amplification", "Fabric contention", "Runtime jitter"):
        assert mode in html
    assert "GPU locality" in html and "not assessed" in html


def test_no_straggler_and_jitter_read_differently() -> None:
    html = render_status(recorded_view("jitter"), Settings())
    assert "STRAGGLER:" not in html and "No straggler" in html
    assert "Runtime jitter" in html and "rotates" in html


def test_labels_from_agents_are_escaped() -> None:
    job = '<img src=x onerror="alert(1)">'
    view = recorded_view("forward_straggler", job=job)
    ranks = list(view.jobs[job].ranks)
    ranks[0] = replace(ranks[0], hostname="<script>x</script>")
    html = render_page(view_of(ranks, job, view.now_unix_s), Settings())
    assert "<img src=x" not in html and "<script>x" not in html
    assert "&lt;img src=x" in html


def test_stale_ranks_and_gpu_topology_are_shown() -> None:
    view = recorded_view("balanced")
    now = view.now_unix_s
    healthy = {
        "gpu_name": "NVIDIA H100",
        "pcie_link_width": 16,
        "pcie_link_max_width": 16,
        "gpu_numa_node": 0,
        "process_numa_nodes": "0",
        "numa_mismatch": 0,
    }
    faults = {1: {"pcie_link_width": 8}, 2: {"numa_mismatch": True, "process_numa_nodes": "1"}}
    ranks = [
        replace(r, topology={**healthy, **faults.get(i, {})})
        for i, r in enumerate(view.jobs["demo"].ranks)
    ]
    ranks[3] = replace(ranks[3], stale=True, last_report_unix_s=now - 45)
    html = render_status(view_of(ranks, "demo", now), Settings())
    assert "⏸ stale" in html and "silent 45 s" in html
    assert "NVIDIA H100" in html and "⚠ degraded" in html
    assert "rank 1: PCIe link x8 of x16 (+1 more ranks)" in html
    assert "⚠ mismatch" in html and "process 1" in html


# -- a real browser on a real run --------------------------------------------------------------
def _browser_available() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (pip install playwright)"
    if not os.path.exists(CHROMIUM) and not shutil.which("chromium"):
        return "Debian chromium is not installed (apt-get install chromium)"
    return None


@pytest.mark.slow
@pytest.mark.skipif(_browser_available() is not None, reason=str(_browser_available()))
def test_browser_shows_the_slowed_rank_during_a_real_run(
    exporter: Any, job_factory: Any, tmp_path: Path
) -> None:
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.goto(exporter.url + "/")
            # Before any rank reports, the page says so (and keeps running).
            expect(page.locator(".banner-title")).to_have_text("No ranks have reported yet")
            expect(page.locator("#status")).to_have_attribute("data-live", "1")

            job_factory(
                4,
                ["--duration", "60", "--slow-rank", str(SLOW_RANK), "--slow-ms", "30"],
                exporter.url,
                job="demo",
            )
            # No reload: the page must refresh itself until the slowed rank is flagged.
            banner = page.locator(".banner-bad .banner-title")
            expect(banner).to_have_text(f"STRAGGLER: rank {SLOW_RANK}", timeout=60_000)
            row = page.locator("table.ranks tbody tr.straggler")
            expect(row).to_have_count(1)
            expect(row.locator("th")).to_have_text(str(SLOW_RANK))
            expect(row).to_contain_text("⚠ STRAGGLER")
            expect(row).to_contain_text("cause: forward")
            expect(page.locator(".banner-bad")).to_contain_text("Cause: forward")
            expect(page.locator("table.ranks tbody tr")).to_have_count(4)
            expect(page.locator("table.modes")).to_contain_text("Synchronization amplification")

            # Links to the data behind the page work from the page itself.
            for href, needle in (
                ("metrics", "syncscope_straggler_cause"),
                ("v1/state?recent=300", '"jobs"'),
            ):
                link = page.locator(f'nav a[href="{href}"]')
                expect(link).to_have_count(1)
                reply = page.request.get(exporter.url + "/" + href)
                assert reply.ok and needle in reply.text()

            # The pause button stops the refresh and says so to assistive technology.
            pause = page.locator("#pause")
            pause.click()
            expect(pause).to_have_attribute("aria-pressed", "true")
            pause.click()
            expect(pause).to_have_attribute("aria-pressed", "false")

            # Let the window fill (120-step sparklines) before the picture.
            wait_until(
                lambda: (
                    min(r["steps_total"] for r in exporter.state()["jobs"]["demo"]["ranks"]) >= 200
                ),
                timeout=30,
            )
            page.wait_for_timeout(2500)
            expect(banner).to_have_text(f"STRAGGLER: rank {SLOW_RANK}")
            shot = tmp_path / "status-page.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 20_000
            target = os.environ.get("SYNCSCOPE_SCREENSHOT")
            if target:
                shutil.copyfile(shot, target)
            assert not errors, errors
        finally:
            browser.close()
