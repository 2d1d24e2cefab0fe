"""The MLflow UI in a real browser: Debian's chromium driven by Playwright (no browser download).

After a training run is registered and published, and a second version gated (issue 27 item 10):
the model list names the production version and its path in its Tags column (the aliases column
hides `production` behind "+1"); the model page's description says production, the gated
candidate and how to ship; a gated version's page starts with `GATED, stays candidate: <reason>`,
the published one's with `PUBLISHED to <path>`, above the fold; the version page still shows the
tags and the source run. What the project cannot change is checked as docs/registry.md describes
it: the promo modal and the Assistant panel on first open, gone with the documented browser keys.
Screenshots in `test-artifacts/`.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest

from tests.support import registry_support
from tests.support.helpers import REPO
from tests.support.registry_support import register

two_adapters = registry_support.two_adapters
CHROMIUM = Path("/usr/bin/chromium")
# Flags for Debian chromium as root in a closed network (the machines' notes): without the
# background-networking ones it keeps trying to reach Google's hosts.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = REPO / "test-artifacts"
# docs/registry.md, "What the UI shows first": the browser-side state of MLflow 3.17's UI
RETURNING_USER = """
localStorage.setItem('_mlflow_model_registry_promo_modal_dismissed_v1', 'true');
localStorage.setItem('mlflow.assistant.fab.autoOpenedOnFirstLoad_v1', 'true');
localStorage.setItem('mlflow.assistant.panelOpen_v1', 'false');
"""
VIEWPORT = {"width": 1400, "height": 900}
PROMO = "Flexible, governed deployments"  # the promo modal's title
ASSISTANT = "Ask questions about your experiments"  # the Assistant panel's greeting


@pytest.mark.slow
def test_the_ui_shows_production_the_gate_and_the_path_first(trained, tiny_base, two_adapters):
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright not installed: pip install -e '.[dev]'"
    )
    if not CHROMIUM.exists():
        pytest.skip("Debian chromium not installed (/usr/bin/chromium): run `bash scripts/ci_deps.sh`")
    from pipeline import registry
    from pipeline.registry import ui
    from pipeline.release.publish import publish

    cfg, res = trained
    name = f"ui-agent-{uuid.uuid4().hex[:6]}"
    reg = register(cfg, res.adapter_dir, tiny_base, name)
    pub = publish(cfg, name, version=reg.version)
    gated = register(cfg, two_adapters[1], tiny_base, name).version
    reason = (
        "eval_loss 6.9 is worse than production v1's 6.2143 by 0.6857, more than run.eval_loss_margin 0.05"
    )
    registry.record_gate(cfg, name, gated, "gated", reason)
    run_name = registry.client(cfg).get_run(res.run_id).info.run_name

    server = ui.start(cfg, port=0)
    ARTIFACTS.mkdir(exist_ok=True)
    expect = sync_api.expect
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
            page = None
            try:
                c = server.credentials  # the UI's login (MLflow's basic-auth app)
                login = {"username": c.username, "password": c.password}
                # first open: MLflow's own promo modal and Assistant panel (not ours to switch off)
                page = browser.new_context(viewport=VIEWPORT, http_credentials=login).new_page()
                page.goto(ui.model_url(server.url))
                expect(page.get_by_text(PROMO).first).to_be_visible(timeout=90_000)
                expect(page.get_by_text(ASSISTANT).first).to_be_visible(timeout=30_000)
                page.screenshot(path=str(ARTIFACTS / "registry-first-open.png"))
                page.close()

                ctx = browser.new_context(viewport=VIEWPORT, http_credentials=login)
                ctx.add_init_script(RETURNING_USER)
                page = ctx.new_page()
                page.goto(ui.model_url(server.url))
                row = page.get_by_role("row").filter(has_text=name)
                expect(row).to_contain_text(f"production: v{reg.version}", timeout=90_000)
                expect(row).to_contain_text(str(pub.path))
                expect(row).to_contain_text(f"candidate: v{gated} gated")
                expect(page.get_by_text(PROMO)).to_have_count(0)
                expect(page.get_by_text(ASSISTANT)).to_have_count(0)
                page.screenshot(path=str(ARTIFACTS / "registry-model-list.png"))

                page.goto(ui.model_url(server.url, name))
                expect(page.locator("body")).to_contain_text(
                    f"production: v{reg.version}, published to {pub.path}", timeout=60_000
                )
                expect(page.locator("body")).to_contain_text(f"pipeline promote {name} VERSION")
                page.screenshot(path=str(ARTIFACTS / "registry-model.png"))

                page.goto(ui.model_url(server.url, name, gated))
                first = page.get_by_text(f"GATED, stays candidate: {reason}").first
                expect(first).to_be_visible(timeout=60_000)
                assert first.bounding_box()["y"] < VIEWPORT["height"] / 2  # the top of the page
                page.screenshot(path=str(ARTIFACTS / "registry-gated-version.png"))

                page.goto(ui.model_url(server.url, name, reg.version))
                page.get_by_text(run_name).first.wait_for(timeout=90_000)  # source run link
                shipped = page.get_by_text(f"PUBLISHED to {pub.path}").first
                expect(shipped).to_be_visible(timeout=30_000)
                assert shipped.bounding_box()["y"] < VIEWPORT["height"] / 2
                body = page.locator("body")
                for text in ("production", "validation.verdict", "weights_sha256", "published.path"):
                    expect(body).to_contain_text(text, timeout=30_000)
                page.screenshot(path=str(ARTIFACTS / "registry-model-version.png"), full_page=True)
            except BaseException:
                if page is not None and not page.is_closed():
                    page.screenshot(path=str(ARTIFACTS / "registry-ui-failed.png"), full_page=True)
                shutil.copy(server.log, ARTIFACTS / "mlflow-ui.log")
                raise
            finally:
                browser.close()
    finally:
        server.stop()
    assert (ARTIFACTS / "registry-model-version.png").stat().st_size > 10_000
