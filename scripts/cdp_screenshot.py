"""Screenshots of pages once they show what they are for, through the Chrome DevTools protocol; exit 1 if one
never does.

Each page comes with a check, a JavaScript expression that is true once the page has rendered its content (chart
lines drawn, table rows filled, a report's images decoded). It is evaluated in every frame of the page, sandboxed
ones included (MLflow shows an HTML artifact in a sandboxed iframe), until one frame says true; then the page gets
a moment to settle and is captured. A page whose check stays false until ``--wait`` seconds is captured anyway,
as ``<name>.failed.png``, and the script exits 1 naming it: a loading skeleton is never saved as a result.

It starts its own headless Chromium (Debian's ``chromium``: apt-get install chromium) with a fresh profile, with
sandboxed and cross-site frames kept in the page's process (``--disable-features=...``), where DevTools can reach
them from the page.

Usage: cdp_screenshot.py [--wait S] PNG URL CHECK [PNG URL CHECK ...]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp


class Page:
    """One browser tab and its DevTools connection."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse):
        self.ws = ws
        self.counter = itertools.count(1)
        self.worlds: dict[str, int] = {}  # frame id -> isolated world in which checks run

    async def call(self, method: str, **params) -> dict:
        ident = next(self.counter)
        await self.ws.send_json({"id": ident, "method": method, "params": params})
        async for message in self.ws:
            data = message.json()
            if data.get("id") == ident:
                if "error" in data:
                    raise RuntimeError(f"{method}: {data['error']}")
                return data.get("result", {})
        raise RuntimeError("the browser closed the connection")

    async def frames(self) -> list[str]:
        tree = (await self.call("Page.getFrameTree"))["frameTree"]
        found, todo = [], [tree]
        while todo:
            node = todo.pop()
            found.append(node["frame"]["id"])
            todo.extend(node.get("childFrames", []))
        return found

    async def check(self, expression: str) -> bool:
        """Whether ``expression`` is true in any frame (each evaluated in an isolated world of that frame, which
        sees its DOM whatever the frame's sandbox)."""
        for frame in await self.frames():
            try:
                if frame not in self.worlds:
                    world = await self.call("Page.createIsolatedWorld", frameId=frame, worldName="check")
                    self.worlds[frame] = world["executionContextId"]
                result = await self.call("Runtime.evaluate", expression=f"Boolean({expression})",
                                         contextId=self.worlds[frame])
            except RuntimeError:  # a frame that went away or navigated: try it afresh next time
                self.worlds.pop(frame, None)
                continue
            if result.get("result", {}).get("value") is True:
                return True
        return False


async def capture(session: aiohttp.ClientSession, port: int, url: str, check: str, target: Path,
                  wait: float) -> bool:
    async with session.put(f"http://127.0.0.1:{port}/json/new?about:blank") as response:
        tab = await response.json()
    try:
        async with session.ws_connect(tab["webSocketDebuggerUrl"], max_msg_size=0) as ws:
            page = Page(ws)
            await page.call("Emulation.setDeviceMetricsOverride", width=1600, height=1100, deviceScaleFactor=1,
                            mobile=False)
            await page.call("Page.enable")
            await page.call("Page.navigate", url=url)
            deadline, rendered = time.monotonic() + wait, False
            while not rendered and time.monotonic() < deadline:
                await asyncio.sleep(1.0)
                rendered = await page.check(check)
            if rendered:
                await asyncio.sleep(2.0)  # animations and the last fetches
            shot = await page.call("Page.captureScreenshot", format="png")
    finally:
        async with session.get(f"http://127.0.0.1:{port}/json/close/{tab['id']}"):
            pass
    path = target if rendered else target.with_suffix(".failed.png")
    path.write_bytes(base64.b64decode(shot["data"]))
    return rendered


CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-features=IsolateOrigins,site-per-process,IsolateSandboxedIframes")


@contextlib.contextmanager
def chromium() -> Iterator[int]:
    """A headless Chromium with a throw-away profile; yields its DevTools port."""
    binary = shutil.which("chromium")
    if binary is None:
        sys.exit("needs chromium: apt-get install -y chromium")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        proc = subprocess.Popen([binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                                 f"--remote-debugging-port={port}", "about:blank"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            for _ in range(240):
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/json/version", timeout=1).close()
                    break
                except OSError:
                    time.sleep(0.25)
            yield port
        finally:  # the browser's own processes too, which would otherwise write into the profile being removed
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def shoot(port: int, triples: list[tuple[str, str, str]], wait: float) -> list[str]:
    failed = []
    async with aiohttp.ClientSession() as session:
        for target, url, check in triples:
            if await capture(session, port, url, check, Path(target), wait):
                print(f"rendered: {target}")
            else:
                failed.append(f"{target} ({url}): not rendered after {wait:.0f} s; check: {check}")
    return failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("triples", nargs="+", help="PNG URL CHECK triples")
    parser.add_argument("--wait", type=float, default=90.0, help="seconds a page may take to render")
    args = parser.parse_args()
    if len(args.triples) % 3:
        parser.error("give PNG URL CHECK triples")
    triples = list(zip(args.triples[::3], args.triples[1::3], args.triples[2::3], strict=True))
    with chromium() as port:
        failed = asyncio.run(shoot(port, triples, args.wait))
    for line in failed:
        print(f"FAILED {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
