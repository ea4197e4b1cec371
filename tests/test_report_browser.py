"""The A/B report of a tiny real job (three variants of the tiny checkpoint, tiny ASR and speaker models),
opened in headless Chromium: no console or page error, no failed request, every plot titled, every
player's audio loaded with a duration. Rendered three ways: in the job, as a copy of report/ alone
somewhere else (the job deleted), and with the audio embedded in the page.

Chromium is Debian's `chromium` (or OVBATCH_CHROMIUM), driven by the `playwright` package without its own
browser download. Where the browser is absent the test skips, except in CI (CI=true): .ci/run installs it,
and a CI run without it fails.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
from tiny_models import tiny_wavlm_xvector, tiny_whisper

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# Every player reports loadedmetadata or error, or the page is stuck; either way the test reads each one.
PLAYERS_JS = """async (timeoutMs) => {
  const one = (a) => new Promise((resolve) => {
    const done = (why) => resolve({src: (a.currentSrc || a.src).slice(0, 120), duration: a.duration,
                                   error: a.error ? a.error.code : why});
    if (a.readyState >= 1) return done(null);
    a.addEventListener('loadedmetadata', () => done(null), {once: true});
    a.addEventListener('error', () => done('error event'), {once: true});
    setTimeout(() => done('no metadata after ' + timeoutMs + ' ms'), timeoutMs);
    if (a.preload === 'none') a.load();
  });
  return Promise.all([...document.querySelectorAll('audio')].map(one));
}"""


def _browser() -> str | None:
    given = os.environ.get("OVBATCH_CHROMIUM")
    if given:
        return given
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


def _browser_or_skip() -> tuple[object, str]:
    in_ci = os.environ.get("CI", "").lower() in ("1", "true", "yes")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        why = "the playwright package is not installed (pip install -e '.[test]')"
    else:
        executable = _browser()
        if executable:
            return sync_playwright, executable
        why = f"no Chromium ({', '.join(BROWSERS)} on PATH, or OVBATCH_CHROMIUM): apt-get install chromium"
    if in_ci:
        pytest.fail(f"CI must run the browser test, but {why}; .ci/run installs both")
    pytest.skip(why)


def _tiny_ab_job(root: Path):
    from engine.tiny import ensure_tiny_checkpoint
    from pipeline.config import load_job_config
    from pipeline.demo import DEMO_OVERRIDES, ab_settings, write_demo_manifest
    from pipeline.job import submit
    from pipeline.sizing import frontend_sizer

    checkpoint = ensure_tiny_checkpoint()
    literal = {
        "manifest": str(write_demo_manifest(root / "manifest.parquet", rows=3)),
        "engine.checkpoint": str(checkpoint),
        "local": True,
        **ab_settings(checkpoint),  # fp32 and w4a4
        "variants.bf16.checkpoint": str(checkpoint),
        "variants.bf16.precision": "bf16",
        "compare.asr_model": str(tiny_whisper(root / "whisper")),
        "compare.speaker_model": str(tiny_wavlm_xvector(root / "wavlm")),
    }
    overrides = [*DEMO_OVERRIDES, "engine.generation.num_step=4", "progress=false", "compare.device=cpu"]
    cfg = load_job_config(None, overrides, literal)
    return submit(cfg, root / "job", frontend_sizer).job, cfg


def _render(browser, page_path: Path) -> dict:
    page = browser.new_page()
    problems: list[str] = []
    page.on(
        "console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None
    )
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url[:120]} ({r.failure})"))
    page.goto(page_path.as_uri(), wait_until="load")
    players = page.evaluate(PLAYERS_JS, 20000)
    figures = page.evaluate(
        """() => ({
          tables: document.querySelectorAll('table').length,
          plots: [...document.querySelectorAll('svg')].map(s => s.querySelector('title')?.textContent || ''),
          text: document.body.innerText,
        })"""
    )
    page.close()
    return {"problems": problems, "players": players, **figures}


def _check(rendered: dict, where: str) -> None:
    assert rendered["problems"] == [], f"{where}: {rendered['problems']}"
    bad = [p for p in rendered["players"] if p["error"] is not None or not p["duration"] > 0]
    assert rendered["players"] and not bad, f"{where}: players without audio: {bad}"
    assert len(rendered["plots"]) >= 8 and all(rendered["plots"]), (
        f"{where}: untitled plots {rendered['plots']}"
    )
    assert rendered["tables"] >= 10, where
    for heading in (
        "A/B: w4a4 against fp32",
        "A/B: bf16 against fp32",
        "Intelligibility and speaker similarity",
    ):
        assert heading in rendered["text"], f"{where}: no {heading!r}"
    assert "Token agreement per codebook" in rendered["text"] and "Not measured" not in rendered["text"]


def test_the_ab_report_renders_and_plays_in_headless_chromium(tmp_path: Path):
    sync_playwright, executable = _browser_or_skip()
    from pipeline.report import write_report

    t0 = time.perf_counter()
    job, cfg = _tiny_ab_job(tmp_path)
    built = time.perf_counter() - t0
    moved = shutil.copytree(job.report_dir, tmp_path / "elsewhere" / "report")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        try:
            _check(_render(browser, job.report_dir / "index.html"), "in the job")
            cfg.compare.audio = "embed"
            write_report(job, cfg.compare)
            _check(_render(browser, job.report_dir / "index.html"), "embedded audio")
            shutil.rmtree(job.path)
            _check(_render(browser, moved / "index.html"), "report/ copied alone")
        finally:
            browser.close()
    print(f"tiny A/B job and report {built:.1f} s; rendering {time.perf_counter() - t0 - built:.1f} s")
