"""Retake the README's viewer screenshot from a scan folder's index.html (no model is loaded).

Opens the page in headless Chromium (Playwright, ``--chromium`` or the first chromium on PATH),
shows the induction-score map, clicks one head and saves a 1280 x 900 screenshot:

    python scripts/viewer_screenshot.py figures/smollm2-135m --head 18.6
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("dir", type=Path, help="a scan folder with index.html (headprobe scan --html)")
    p.add_argument("--head", default="18.6", help="the head to click, LAYER.HEAD")
    p.add_argument("--map", default="induction score", help="the map to show (its label in the page)")
    p.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser"))
    p.add_argument("--out", type=Path, help="the PNG to write (default DIR/viewer.png)")
    args = p.parse_args()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900}, bypass_csp=True)
        page.goto((args.dir / "index.html").resolve().as_uri())
        page.select_option("#map-select", label=args.map)
        page.click(f'[data-head="{args.head}"]')
        page.wait_for_function(f'document.getElementById("pattern").dataset.head === "{args.head}"', timeout=10000)
        page.mouse.move(1275, 895)  # off the heads: no tooltip over the pattern
        page.wait_for_timeout(300)
        out = args.out or args.dir / "viewer.png"
        page.screenshot(path=str(out))
        browser.close()
    print(out)


if __name__ == "__main__":
    main()
