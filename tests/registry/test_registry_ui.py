"""The MLflow UI in a real browser: Debian's chromium driven by Playwright (no browser download).

After a training run is registered and published, the model version page must show the
`production` alias, the version's tags and its source run. The screenshot is kept in
`test-artifacts/registry-model-version.png`.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest

from tests.support.helpers import REPO
from tests.support.registry_support import register

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


@pytest.mark.slow
def test_model_version_page_shows_production_alias_tags_and_source_run(trained, tiny_base):
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
    publish(cfg, name, version=reg.version)
    run_name = registry.client(cfg).get_run(res.run_id).info.run_name

    server = ui.start(cfg, port=0)
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "registry-model-version.png"
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
            try:
                c = server.credentials  # the UI's login (MLflow's basic-auth app)
                page = browser.new_context(
                    viewport={"width": 1500, "height": 1400},
                    http_credentials={"username": c.username, "password": c.password},
                ).new_page()
                page.goto(ui.model_url(server.url, name, reg.version))
                page.get_by_text(run_name).first.wait_for(timeout=90_000)  # source run link
                body = page.locator("body")
                for text in (
                    "production",
                    "candidate",
                    "validation.verdict",
                    "weights_sha256",
                    "dataset_fingerprint",
                    "published.path",
                ):
                    sync_api.expect(body).to_contain_text(text, timeout=30_000)
                page.screenshot(path=str(shot), full_page=True)
            except BaseException:
                page.screenshot(path=str(ARTIFACTS / "registry-model-version-failed.png"), full_page=True)
                shutil.copy(server.log, ARTIFACTS / "mlflow-ui.log")
                raise
            finally:
                browser.close()
    finally:
        server.stop()
    assert shot.stat().st_size > 10_000
