"""Check an anatomy page in a real browser: headless Chromium (the Debian package `chromium`)
driven by Playwright (`pip install playwright`, a test dependency; no browser download: it
launches the system's Chromium).

    python -m torchllama.anatomy.browser anatomy/index.html --screenshot docs/anatomy.png

loads the page from disk, waits for it, and reports how many images decoded, which sections
are on the page, which explorers started and every console error; exit status 1 if an image
failed, an explorer did not start or the console logged an error. `--explorer-shots DIR`
writes a PNG of each explorer.
"""

from __future__ import annotations

import argparse
import contextlib
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
    errors and uncaught page errors, the explorers (ids) and which of them started."""

    images: int
    decoded: int
    sections: list[str]
    errors: list[str] = field(default_factory=list)
    explorers: list[str] = field(default_factory=list)
    started: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (self.images > 0 and self.decoded == self.images and not self.errors
                and self.started == self.explorers)


@contextlib.contextmanager
def open_page(index: str | os.PathLike, width: int = 1280, height: int = 1600):
    """`index` (a file) open in headless Chromium, offline (any request fails and is logged):
    yields (Playwright page, the list console errors, page errors and failed requests are
    appended to).

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
            yield page, errors
        finally:
            browser.close()


def _screenshot(target, path: str | os.PathLike) -> None:
    """A PNG of a page or an element, written atomically."""
    shot = Path(path)
    tmp = shot.with_name(f".{shot.name}.tmp{os.getpid()}.png")
    target.screenshot(path=str(tmp))
    os.replace(tmp, shot)


def check_page(index: str | os.PathLike, screenshot: Optional[str | os.PathLike] = None,
               width: int = 1280, height: int = 1600,
               explorer_shots: Optional[str | os.PathLike] = None) -> PageCheck:
    """Open `index` (a file) in headless Chromium, offline, and inspect it.

    Args:
        screenshot: write a PNG of the first width × height pixels of the page here
            (atomically).
        explorer_shots: a folder: write a PNG of each explorer there, `<its id>.png`.

    Raises:
        ArgumentError: as `open_page`.
    """
    with open_page(index, width, height) as (page, errors):
        images = page.evaluate("document.images.length")
        decoded = page.evaluate("Array.from(document.images).filter("
                                "i => i.complete && i.naturalWidth > 0).length")
        sections = page.evaluate("Array.from(document.querySelectorAll('section'))"
                                 ".map(s => s.id)")
        explorers = page.evaluate("Array.from(document.querySelectorAll('div.explorer'))"
                                  ".map(e => e.id)")
        started = page.evaluate("Array.from(document.querySelectorAll('div.explorer'))"
                                ".filter(e => e.dataset.ready === '1').map(e => e.id)")
        if screenshot is not None:
            _screenshot(page, screenshot)
        if explorer_shots is not None:
            Path(explorer_shots).mkdir(parents=True, exist_ok=True)
            for name in explorers:
                _screenshot(page.locator(f"#{name}"), Path(explorer_shots) / f"{name}.png")
    return PageCheck(images, decoded, sections, list(errors), explorers, started)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchllama.anatomy.browser",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("index", help="the report's index.html")
    parser.add_argument("--screenshot", help="write a PNG of the top of the page here")
    parser.add_argument("--explorer-shots", metavar="DIR",
                        help="write a PNG of each explorer into DIR (<explorer id>.png)")
    args = parser.parse_args(argv)
    try:
        check = check_page(args.index, args.screenshot, explorer_shots=args.explorer_shots)
    except ArgumentError as e:
        print(f"anatomy-check: error: {e}", file=sys.stderr)
        return 1
    print(f"{args.index}: {check.decoded}/{check.images} images decoded, sections "
          f"{', '.join(check.sections)}; explorers started {len(check.started)}/"
          f"{len(check.explorers)}; {len(check.errors)} console errors")
    for error in check.errors:
        print(f"  console error: {error}")
    return 0 if check.ok else 1


if __name__ == "__main__":
    sys.exit(main())
