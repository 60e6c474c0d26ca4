"""Screenshots of a Snakemake report zip in headless Chromium (used by test_report.py).

    python tests/report_shots.py results/demo/report.zip /tmp/report_shots [RESULT ...]

unzips the report, saves ``main.png`` (the page a reader first sees) and, for each
RESULT (a substring of a result's file name, default ``memory.png``), a PNG of that
result's page: the figure itself with its caption in the side panel. The report is a
single-page app without addressable views, so the result's page is opened by a copy of
``report.html`` that calls the app's own navigation (``app.setView`` with the
result's info panel and content, what clicking the result does) once the page has loaded.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

WINDOW = "1400,1000"

_OPEN_RESULT = """
<script>
window.addEventListener("load", function () {
  setTimeout(function () {
    var key = Object.keys(results).find(function (k) { return k.indexOf(%s) >= 0; });
    if (key === undefined) { document.title = "RESULT NOT FOUND"; return; }
    var kind = results[key].mime_type.indexOf("image/") === 0 ? "img" : "html";
    app.setView({navbarMode: "resultinfo", content: kind, contentPath: results[key].data_uri, resultPath: key});
  }, 200);
});
</script>
"""


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


def install_chromium() -> str | None:
    """``apt-get install -y chromium`` when apt is usable (root, Debian/Ubuntu); the browser or None."""
    if find_chromium():
        return find_chromium()
    if not shutil.which("apt-get") or os.geteuid() != 0:
        return None
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "install", "-y", "-q", "chromium"], ["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "chromium"]):
        subprocess.run(cmd, env=env, capture_output=True, timeout=900)
        if find_chromium():
            break
    return find_chromium()


def screenshot(browser: str, page: Path, out: Path, window: str = WINDOW) -> Path:
    """Render ``page`` (a local HTML file) into ``out`` (PNG); raises if nothing was written."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    cmd = [
        browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
        "--allow-file-access-from-files", f"--window-size={window}", "--virtual-time-budget=15000",
        f"--screenshot={out}", page.resolve().as_uri(),
    ]  # fmt: skip
    # headless Chromium now and then hangs on a loaded machine, before or after it writes
    # the file: a written screenshot is kept, and a hung run without one is run once more
    for attempt in (1, 2):
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
            why = f"exit {r.returncode}: {r.stderr[-2000:]}"
        except subprocess.TimeoutExpired as e:
            why = f"no exit within {e.timeout:g} s (attempt {attempt})"
            if out.exists() and out.stat().st_size > 0:
                break
            continue
        break
    if not out.exists() or out.stat().st_size == 0:
        raise RuntimeError(f"{browser} wrote no screenshot ({why})")
    return out


def unzip_report(zip_path: Path, dest: Path) -> Path:
    """Extract ``zip_path`` into ``dest``; the path of its ``report.html``."""
    with zipfile.ZipFile(zip_path) as z:
        z.extractall(dest)
    pages = sorted(dest.rglob("report.html"))
    if not pages:
        raise RuntimeError(f"{zip_path} holds no report.html")
    return pages[0]


def result_page(report_html: Path, needle: str) -> Path:
    """A copy of ``report_html`` beside it that opens the first result whose path contains ``needle``."""
    text = report_html.read_text(encoding="utf-8")
    script = _OPEN_RESULT % json.dumps(needle)
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", needle)
    page = report_html.with_name(f"view_{name}.html")
    # the last </body>: inlined libraries hold the string too
    head, tag, tail = text.rpartition("</body>")
    if not tag:
        raise RuntimeError(f"{report_html} has no </body>")
    page.write_text(head + script + tag + tail, encoding="utf-8")
    return page


def report_screenshots(zip_path, out_dir, results=("memory.png",), browser: str | None = None) -> dict[str, Path]:
    """``main`` and one screenshot per entry of ``results``, as PNGs in ``out_dir``."""
    browser = browser or find_chromium()
    if browser is None:
        raise RuntimeError("no Chromium found")
    out_dir = Path(out_dir)
    html = unzip_report(Path(zip_path), out_dir / "unzipped")
    shots = {"main": screenshot(browser, html, out_dir / "main.png")}
    for needle in results:
        stem = Path(needle).stem
        shots[needle] = screenshot(browser, result_page(html, needle), out_dir / f"result_{stem}.png")
    return shots


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    for key, path in report_screenshots(sys.argv[1], sys.argv[2], tuple(sys.argv[3:]) or ("memory.png",)).items():
        print(f"{key}: {path}")
