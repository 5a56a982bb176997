"""Check an anatomy page in a real browser: headless Chromium (the Debian package `chromium`)
driven by Playwright (`pip install playwright`, a test dependency; no browser download: it
launches the system's Chromium).

    python -m torchllama.anatomy.browser anatomy/index.html --screenshot docs/anatomy.png

loads the page from disk, waits for it, and reports how many images decoded, which sections
are on the page and every console error; exit status 1 if an image failed or the console
logged an error.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from torchllama.errors import ArgumentError

#: where a Chromium may be, in order (the Debian package installs /usr/bin/chromium)
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "chrome")


def find_chromium() -> Optional[str]:
    """Path of a Chromium executable ($CHROMIUM first, then PATH), or None."""
    env = os.environ.get("CHROMIUM")
    if env and Path(env).is_file():
        return env
    return next((p for p in map(shutil.which, CHROMIUM_NAMES) if p), None)


@dataclass
class PageCheck:
    """What the browser saw: images on the page and how many decoded, the section ids, console
    errors and uncaught page errors."""

    images: int
    decoded: int
    sections: list[str]
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.images > 0 and self.decoded == self.images and not self.errors


def check_page(index: str | os.PathLike, screenshot: Optional[str | os.PathLike] = None,
               width: int = 1280, height: int = 1600) -> PageCheck:
    """Open `index` (a file) in headless Chromium, offline, and inspect it.

    Args:
        screenshot: write a PNG of the first width × height pixels of the page here
            (atomically).

    Raises:
        ArgumentError: the file is missing, Playwright is not installed or no Chromium is found
            (the message says how to install them).
    """
    index = Path(index).resolve()
    if not index.is_file():
        raise ArgumentError(f"{index}: no such page")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        raise ArgumentError("checking the page needs Playwright: pip install playwright "
                            "(in `make test`'s test extra)") from None
    chromium = find_chromium()
    if chromium is None:
        raise ArgumentError("no Chromium found: apt-get install chromium (or set $CHROMIUM)")
    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium,
                                    args=["--no-sandbox", "--disable-gpu"])
        try:
            context = browser.new_context(viewport={"width": width, "height": height},
                                          offline=True)
            page = context.new_page()
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("requestfailed", lambda r: errors.append(f"request failed: {r.url}"))
            page.goto(index.as_uri(), wait_until="load")
            images = page.evaluate("document.images.length")
            decoded = page.evaluate("Array.from(document.images).filter("
                                    "i => i.complete && i.naturalWidth > 0).length")
            sections = page.evaluate("Array.from(document.querySelectorAll('section'))"
                                     ".map(s => s.id)")
            if screenshot is not None:
                shot = Path(screenshot)
                tmp = shot.with_name(f".{shot.name}.tmp{os.getpid()}.png")
                page.screenshot(path=str(tmp))
                os.replace(tmp, shot)
        finally:
            browser.close()
    return PageCheck(images, decoded, sections, errors)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchllama.anatomy.browser",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("index", help="the report's index.html")
    parser.add_argument("--screenshot", help="write a PNG of the top of the page here")
    args = parser.parse_args(argv)
    try:
        check = check_page(args.index, args.screenshot)
    except ArgumentError as e:
        print(f"anatomy-check: error: {e}", file=sys.stderr)
        return 1
    print(f"{args.index}: {check.decoded}/{check.images} images decoded, sections "
          f"{', '.join(check.sections)}; {len(check.errors)} console errors")
    for error in check.errors:
        print(f"  console error: {error}")
    return 0 if check.ok else 1


if __name__ == "__main__":
    sys.exit(main())
